/// @brief Public value types of the API: Shape, Options, Backend, Algorithm, Inputs/Outputs/Grads views.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dgps/tensor.hpp"

namespace dgps {

/// Where a call runs. `automatic` picks the fastest available for host data (the CPU backend);
/// the environment variable DGPS_BACKEND (reference|cpu|cuda) overrides `automatic` only.
enum class Backend { automatic, reference, cpu, cuda };
/// How a call runs: token by token, or chunkwise-parallel (SPEC §4). `automatic` lets the backend choose.
enum class Algorithm { automatic, recurrent, chunkwise };

/// "automatic", "reference", "cpu", "cuda".
inline const char* to_string(Backend b) {
  static constexpr const char* n[] = {"automatic", "reference", "cpu", "cuda"};
  return n[int(b)];
}
/// "automatic", "recurrent", "chunkwise".
inline const char* to_string(Algorithm a) {
  static constexpr const char* n[] = {"automatic", "recurrent", "chunkwise"};
  return n[int(a)];
}

/// The state type kept for inputs of type T: double for double, float otherwise (SPEC §5).
template <class T>
using state_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// Problem sizes (SPEC §1). `v_heads == 0` means `v_heads = heads` (no GVA).
struct Shape {
  int64_t batch = 1;      ///< B (1 with cu_seqlens)
  int64_t time = 0;       ///< T (total tokens with cu_seqlens)
  int64_t heads = 1;      ///< H, key heads
  int64_t v_heads = 0;    ///< HV, value heads: H or a multiple of H (GVA)
  int64_t key_dim = 0;    ///< K
  int64_t value_dim = 0;  ///< V
};

/// Options of every call (SPEC §1).
struct Options {
  std::optional<double> scale;  ///< multiplies q after the L2 norm; default 1/sqrt(K)
  bool l2norm_qk = true;        ///< L2-normalise q and k per head, x / sqrt(sum x^2 + 1e-6)
  double x = 1.5;               ///< squash bound of the diagonal preconditioners, > 0
  double eps = 1e-6;            ///< inside log(A + eps), >= 0
  double lambda = 1.0;          ///< ridge of the exact preconditioners (P_0 = I / lambda), > 0
  Backend backend = Backend::automatic;
  Algorithm algorithm = Algorithm::automatic;
  int threads = 0;         ///< CPU threads; 0 = all available
  int64_t chunk_size = 64; ///< chunk length of the chunkwise algorithm and of backward checkpoints
};

/// What ran: returned by every call (and printed to stderr when DGPS_VERBOSE=1).
struct RunInfo {
  Backend backend = Backend::automatic;
  Algorithm algorithm = Algorithm::automatic;
  std::string impl;  ///< e.g. "cpu/recurrent/avx512" or "reference/recurrent"
};

namespace detail {
/// Rank marker of a view built from a bare pointer: validation gives it the SPEC shape, contiguous.
inline constexpr int kImplicitRank = -2;

template <class T>
TensorView<const T> implicit(const T* p) {
  TensorView<const T> v;
  v.data = p;
  v.rank = p ? kImplicitRank : 0;
  return v;
}
template <class T>
TensorView<T> implicit_mut(T* p) {
  TensorView<T> v;
  v.data = p;
  v.rank = p ? kImplicitRank : 0;
  return v;
}
}  // namespace detail

/// A view argument: either a TensorView or a bare pointer to contiguous data in the SPEC shape.
template <class T>
struct In {
  TensorView<const T> view;
  In() = default;
  In(std::nullptr_t) {}
  In(const T* p) : view(detail::implicit(p)) {}
  In(TensorView<const T> v) : view(v) {}
  In(TensorView<T> v) : view(v) {}
};
/// A writable view argument: a TensorView or a bare pointer to contiguous memory in the SPEC shape.
template <class T>
struct Out {
  TensorView<T> view;
  Out() = default;
  Out(std::nullptr_t) {}
  Out(T* p) : view(detail::implicit_mut(p)) {}
  Out(TensorView<T> v) : view(v) {}
};

/// The inputs of a forward or backward call (SPEC §1). Build with `dgps::inputs(shape, q, k, v)`
/// and the chained setters; a model's policies say which of the optional tensors it needs.
template <class T>
struct Inputs {
  using S = state_t<T>;
  Shape shape;
  TensorView<const T> q, k, v, g, beta, g_p, beta_p, center;
  TensorView<const S> h0, a0;
  TensorView<const int64_t> cu_seqlens;

  /// `g`: [B, T, HV] (scalar decay) or [B, T, HV, K] (diagonal decay), natural-log decay.
  Inputs& decay(In<T> g_) { g = g_.view; return *this; }
  /// `beta`: [B, T, HV].
  Inputs& gain(In<T> beta_) { beta = beta_.view; return *this; }
  /// `g_p`, `beta_p`: [B, T, H]; `center`: [H] (diagonal preconditioners only; pass nullptr otherwise).
  Inputs& precond(In<T> g_p_, In<T> beta_p_, In<T> center_ = nullptr) {
    g_p = g_p_.view; beta_p = beta_p_.view; center = center_.view;
    return *this;
  }
  /// `h0`: [N, HV, K, V]; `a0`: [N, H, K] (diagonal) or [N, H, K, K] (exact, the inverse Gram P).
  Inputs& initial_state(In<S> h0_, In<S> a0_ = nullptr) { h0 = h0_.view; a0 = a0_.view; return *this; }
  /// Packed variable-length batch: `cu_seqlens` [N+1], B must be 1.
  Inputs& varlen(TensorView<const int64_t> cu) { cu_seqlens = cu; return *this; }
  /// Packed variable-length batch from a pointer to `num_seqs + 1` offsets.
  Inputs& varlen(const int64_t* cu, int64_t num_seqs) {
    cu_seqlens = TensorView<const int64_t>(cu, {num_seqs + 1});
    return *this;
  }
};

/// Starts an Inputs with the three tensors every model needs.
template <class T>
Inputs<T> inputs(const Shape& shape, In<T> q, In<T> k, In<T> v) {
  Inputs<T> in;
  in.shape = shape;
  in.q = q.view;
  in.k = k.view;
  in.v = v.view;
  return in;
}

/// The outputs of a forward call: `o` [B, T, HV, V] (required), optional final states.
template <class T>
struct Outputs {
  using S = state_t<T>;
  TensorView<T> o;
  TensorView<S> hT, aT;
  /// Requests the final states `hT` [N, HV, K, V] and (with a preconditioner) `aT`.
  Outputs& final_state(Out<S> hT_, Out<S> aT_ = nullptr) { hT = hT_.view; aT = aT_.view; return *this; }
};

/// Starts an Outputs with `o`.
template <class T>
Outputs<T> outputs(Out<T> o) {
  Outputs<T> out;
  out.o = o.view;
  return out;
}

/// The cotangents of a backward call: `do` [B, T, HV, V] (required), optional `dhT`, `daT`.
template <class T>
struct GradsIn {
  using S = state_t<T>;
  TensorView<const T> d_o;
  TensorView<const S> dhT, daT;
};

/// Builds GradsIn from `do` and optional final-state cotangents.
template <class T>
GradsIn<T> grads_in(In<T> d_o, In<state_t<T>> dhT = nullptr, In<state_t<T>> daT = nullptr) {
  return {d_o.view, dhT.view, daT.view};
}

/// Where a backward call writes gradients. Each one is optional; it must be absent when its input
/// is absent. Shapes equal the inputs'.
template <class T>
struct Grads {
  using S = state_t<T>;
  TensorView<T> dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter;
  TensorView<S> dh0, da0;
};

/// The recurrent state of a batch of sequences for `decode`: `h` [P, HV, K, V] and, with a
/// preconditioner, `a` [P, H, K] or [P, H, K, K]. Updated in place. Without `slots`, P = N (one
/// state per sequence); with `slots` [N] (int64), sequence n uses state `slots[n]` of a pool of P.
template <class T>
struct DecodeState {
  using S = state_t<T>;
  TensorView<S> h, a;
  TensorView<const int64_t> slots;
};

}  // namespace dgps
