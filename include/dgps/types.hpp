/// @brief Public value types of the API: Shape, Options, Backend, Algorithm, Inputs/Outputs/Grads views.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "dgps/tensor.hpp"

namespace dgps {

class TrainingCache;  // dgps/training_cache.hpp

/// Where a call runs. `automatic` picks the fastest available for host data (the CPU backend);
/// the environment variable DGPS_BACKEND (reference|cpu|cuda) overrides `automatic` only.
enum class Backend { automatic, reference, cpu, cuda };
/// How a call runs: token by token, or chunkwise-parallel (SPEC §4). `automatic` lets the backend choose.
enum class Algorithm { automatic, recurrent, chunkwise };

/// "automatic", "reference", "cpu", "cuda" ("?" for a value outside the enumeration).
inline const char* to_string(Backend b) {
  static constexpr const char* n[] = {"automatic", "reference", "cpu", "cuda"};
  return unsigned(b) < 4 ? n[int(b)] : "?";
}
/// "automatic", "recurrent", "chunkwise" ("?" for a value outside the enumeration).
inline const char* to_string(Algorithm a) {
  static constexpr const char* n[] = {"automatic", "recurrent", "chunkwise"};
  return unsigned(a) < 3 ? n[int(a)] : "?";
}

namespace detail {

/// float -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN of the same sign.
constexpr uint16_t float_to_bf16_bits(float f) noexcept {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// float -> IEEE binary16 bits, round to nearest even, with subnormals, overflow to infinity and
/// NaN kept a (quiet) NaN.
constexpr uint16_t float_to_f16_bits(float f) noexcept {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 (and inf): infinity
  if (a >= 0x38800000u) {                                                  // a normal half (>= 2^-14)
    const uint32_t r = a - 0x38000000u;                                    // rebias the exponent (127 -> 15)
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  const uint32_t e = a >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
  // Subnormal half: round(value / 2^-24) = round(mantissa * 2^(e - 126)), e in [102, 112].
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, s = 126 - e;
  uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

/// IEEE binary16 bits -> float (exact).
constexpr float f16_bits_to_float(uint16_t h) noexcept {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e == 0) return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(float(m) * 0x1p-24f));
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

/// double -> float rounded to odd (truncate, then set the last bit when inexact). Rounding that
/// result to bfloat16 or half (13+ bits shorter) equals rounding the double directly: no double rounding.
constexpr float round_to_odd_float(double d) noexcept {
  if (!(d == d) || d - d != 0) return static_cast<float>(d);  // NaN, infinity
  const float f = static_cast<float>(d);
  if (double(f) == d) return f;
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((d < 0 ? -double(f) : double(f)) > (d < 0 ? -d : d)) --u;  // rounded away from zero: step back
  return std::bit_cast<float>(u | 1u);
}

}  // namespace detail

/// bfloat16 storage type for inputs and outputs (1 sign, 8 exponent, 7 mantissa bits): a trivial
/// 16-bit struct with explicit conversions; computation is in float (SPEC §5). Conversion from
/// float or double rounds to nearest even; NaN and infinities are kept.
struct bf16 {
  uint16_t bits;  ///< the raw bit pattern
  bf16() = default;
  /// Rounds `f` to nearest even.
  explicit constexpr bf16(float f) noexcept : bits(detail::float_to_bf16_bits(f)) {}
  /// Rounds `d` to nearest even (correctly: no double rounding through float).
  explicit constexpr bf16(double d) noexcept : bits(detail::float_to_bf16_bits(detail::round_to_odd_float(d))) {}
  /// Converts an integer (through double).
  template <class I>
    requires std::is_integral_v<I>
  explicit constexpr bf16(I i) noexcept : bf16(double(i)) {}
  /// The exact float value.
  explicit constexpr operator float() const noexcept { return std::bit_cast<float>(uint32_t(bits) << 16); }
  /// The exact double value.
  explicit constexpr operator double() const noexcept { return double(float(*this)); }
  /// The value with the bit pattern `b`.
  static constexpr bf16 from_bits(uint16_t b) noexcept {
    bf16 x{};
    x.bits = b;
    return x;
  }
};

/// IEEE 754 binary16 ("half") storage type for inputs and outputs (1 sign, 5 exponent, 10 mantissa
/// bits, subnormals below 2^-14, largest finite 65504): a trivial 16-bit struct with explicit
/// conversions; computation is in float (SPEC §5). Conversion rounds to nearest even, overflows to
/// infinity and keeps NaN.
struct f16 {
  uint16_t bits;  ///< the raw bit pattern
  f16() = default;
  /// Rounds `f` to nearest even.
  explicit constexpr f16(float f) noexcept : bits(detail::float_to_f16_bits(f)) {}
  /// Rounds `d` to nearest even (correctly: no double rounding through float).
  explicit constexpr f16(double d) noexcept : bits(detail::float_to_f16_bits(detail::round_to_odd_float(d))) {}
  /// Converts an integer (through double).
  template <class I>
    requires std::is_integral_v<I>
  explicit constexpr f16(I i) noexcept : f16(double(i)) {}
  /// The exact float value.
  explicit constexpr operator float() const noexcept { return detail::f16_bits_to_float(bits); }
  /// The exact double value.
  explicit constexpr operator double() const noexcept { return double(float(*this)); }
  /// The value with the bit pattern `b`.
  static constexpr f16 from_bits(uint16_t b) noexcept {
    f16 x{};
    x.bits = b;
    return x;
  }
};

/// True for the 16-bit storage types bf16 and f16 (float compute, float states).
template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

/// The state type kept for inputs of type T: double for double, float otherwise (float for
/// float, bf16 and f16; SPEC §5).
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
  /// Reject NaN and infinite values in every float input of a host call (q, k, v, gates, states, do,
  /// dhT, daT) with dgps::Error naming the tensor and the first bad index; off: they propagate causally.
  bool check_finite = false;
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

/// The outputs of a forward call: `o` [B, T, HV, V] (required), optional final states, and an
/// optional training cache to fill for the backward.
template <class T>
struct Outputs {
  using S = state_t<T>;
  TensorView<T> o;
  TensorView<S> hT, aT;
  TrainingCache* cache = nullptr;  ///< filled by the forward when given (dgps/training_cache.hpp)
  /// Requests the final states `hT` [N, HV, K, V] and (with a preconditioner) `aT`.
  Outputs& final_state(Out<S> hT_, Out<S> aT_ = nullptr) { hT = hT_.view; aT = aT_.view; return *this; }
  /// Asks the forward to save into `c` what the backward would otherwise recompute (a training
  /// forward; see dgps::TrainingCache for which paths save and the memory it takes). The cache must
  /// outlive the call; its previous contents are replaced.
  Outputs& save_for_backward(TrainingCache& c) { cache = &c; return *this; }
};

/// Starts an Outputs with `o`.
template <class T>
Outputs<T> outputs(Out<T> o) {
  Outputs<T> out;
  out.o = o.view;
  return out;
}

/// The cotangents of a backward call: `do` [B, T, HV, V] (required), optional `dhT`, `daT`, and an
/// optional training cache filled by the matching forward.
template <class T>
struct GradsIn {
  using S = state_t<T>;
  TensorView<const T> d_o;
  TensorView<const S> dhT, daT;
  const TrainingCache* cache = nullptr;  ///< read by the backward when given and filled
  /// Lets the backward read what the forward saved into `c` (Outputs::save_for_backward) instead of
  /// recomputing it. A filled cache from a different call (model, shape, options, input tensors) makes
  /// the backward throw dgps::Error; an empty one is ignored.
  GradsIn& use_saved(const TrainingCache& c) { cache = &c; return *this; }
};

/// Builds GradsIn from `do` and optional final-state cotangents.
template <class T>
GradsIn<T> grads_in(In<T> d_o, In<state_t<T>> dhT = nullptr, In<state_t<T>> daT = nullptr) {
  GradsIn<T> g;
  g.d_o = d_o.view;
  g.dhT = dhT.view;
  g.daT = daT.view;
  return g;
}

/// Where a backward call writes gradients. Each one is optional; it must be absent when its input
/// is absent. Shapes equal the inputs'.
template <class T>
struct Grads {
  using S = state_t<T>;
  TensorView<T> dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter;
  TensorView<S> dh0, da0;
};

/// Layout of the recurrent states `h` of a DecodeState: K-major [.., K, V] (dgps's and FLA's default) or
/// K-last [.., V, K] (FlashInfer, SGLang and ggml; FLA's `state_v_first`). Only `h` has a layout; `a` is
/// [.., K] or the symmetric [.., K, K].
enum class StateLayout { k_major, k_last };

/// The recurrent states of a batch of sequences for `decode`: a pool `h` [P, HV, K, V] (or K-last
/// [P, HV, V, K], `layout`) and, with a preconditioner, `a` [P, H, K] or [P, H, K, K] (a serving engine's
/// state pool). Updated in place.
///
/// Without `slots`, P = N: sequence n reads and writes state n. The index tensors (int64, contiguous)
/// address the pool instead:
/// - `slots` [N]: sequence n starts from state `slots[n]` and, unless `out_slots` is given, writes its
///   final state back there. A negative slot marks a padding sequence: nothing of the pool is read or
///   written for it and its outputs are zero. A slot >= P is an error.
/// - `out_slots` [N]: the final state of sequence n goes to `out_slots[n]` instead (negative: padding).
/// - `has_initial` [N] (uint8, 0 or 1): 0 starts sequence n from zero states (h = 0, a = 0 or I/lambda)
///   whatever its slot holds; its final state is still written.
/// - speculative verification: `token_slots` [N, D] with `num_accepted` [N]: sequence n (at most D
///   tokens) starts from state `token_slots[n, num_accepted[n] - 1]` (negative: padding) and writes
///   the state after its token t to `token_slots[n, t]` (skipped where negative); no other final
///   state is written. `slots`, `out_slots` and `has_initial` must be absent then.
/// A state written by a sequence may be read or written by no other sequence of the call (a slot
/// that only sequences read may be shared); the same slot read and written by one sequence is the
/// in-place update.
template <class T>
struct DecodeState {
  using S = state_t<T>;
  TensorView<S> h, a;
  /// `h` is [P, HV, K, V] (k_major) or [P, HV, V, K] (k_last). The CPU backend updates a K-last pool where
  /// it is (the decode kernel sweeps its rows of K; docs/serving.md); the CUDA backend takes k_major only.
  StateLayout layout = StateLayout::k_major;
  TensorView<const int64_t> slots;
  TensorView<const int64_t> out_slots;
  TensorView<const uint8_t> has_initial;
  TensorView<const int64_t> token_slots;
  TensorView<const int64_t> num_accepted;
};

}  // namespace dgps
