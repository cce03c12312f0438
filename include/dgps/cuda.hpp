/// @brief dgps::cuda, the CUDA backend's public API: device-pointer forward and decode on a caller's stream.
///
/// Link `dgps::cuda` to use it. The calls take raw device pointers (described by `dgps::cuda::Params`,
/// the plain params struct at the kernel boundary) and a `cudaStream_t` passed as `void*`, so this
/// header does not need `cuda_runtime.h`. Nothing here synchronises with the host: a call can be
/// captured in a CUDA graph. Values inside device tensors (`cu_seqlens`, `slots`) are the caller's
/// contract (SPEC §1); only shapes, pointers and options are validated on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "dgps/detail/problem.hpp"
#include "dgps/error.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/types.hpp"

namespace dgps::cuda {

/// Element type of a device tensor. States (h0, hT, a0, aT) are always float32.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

/// "f32", "bf16", "f16".
inline const char* to_string(DType d) {
  static constexpr const char* n[] = {"f32", "bf16", "f16"};
  return n[int(d)];
}

/// A device tensor: its data pointer and the element strides of its first three dimensions (the
/// last dimension is contiguous, so a rank-3 tensor has stride[2] == 1). Absent tensors have
/// `data == nullptr`.
/// Layouts (SPEC §1): q, k [B,T,H,K]; v, o [B,T,HV,V]; g [B,T,HV] or [B,T,HV,K]; beta [B,T,HV];
/// g_p, beta_p [B,T,H]; center [H]; h0, hT [N,HV,K,V]; a0, aT [N,H,K] (diagonal preconditioners) or
/// [N,H,K,K] (exact preconditioners: the inverse Gram P, rows of stride[2] elements).
struct Tensor {
  const void* data = nullptr;
  int64_t stride[3] = {0, 0, 0};

  /// A contiguous tensor of sizes [d0, d1, d2, d3] (rank 4), or [d0, d1, d2] with d3 = 1 (rank 3).
  static Tensor contiguous(const void* p, int64_t d1, int64_t d2, int64_t d3) {
    Tensor t;
    t.data = p;
    t.stride[2] = d3;
    t.stride[1] = d2 * d3;
    t.stride[0] = d1 * d2 * d3;
    return t;
  }
};

/// Everything a CUDA forward or decode call needs (the params struct at the kernel boundary).
struct Params {
  ModelSpec spec;                   ///< the recurrence (SPEC §2), every decay, gain, preconditioner and solve
  DType dtype = DType::bf16;        ///< element type of q, k, v and o
  DType gate_dtype = DType::f32;    ///< element type of g, beta, g_p, beta_p, center
  int64_t B = 1, T = 0, H = 1, HV = 1, K = 0, V = 0;
  int64_t N = 1;                    ///< number of sequences: B, or the length of cu_seqlens minus one
  Tensor q, k, v, g, beta, g_p, beta_p, center;
  Tensor h0, a0;                    ///< optional initial states (float32)
  Tensor o, hT, aT;                 ///< output (dtype) and optional final states (float32)
  const int64_t* cu_seqlens = nullptr;  ///< device [N+1], packed varlen batch (B = 1), or null
  const int64_t* slots = nullptr;       ///< decode only: device [N], state index of each sequence, or null
  float scale = 0;                  ///< multiplies q after the L2 norm; 0 means 1/sqrt(K)
  float x = 1.5f;                   ///< squash bound of the diagonal preconditioners
  float eps = 1e-6f;                ///< inside log(A + eps)
  float lambda = 1.f;               ///< ridge of the exact preconditioners (P_0 = I / lambda without a0), > 0
  bool l2norm = true;               ///< L2-normalise q and k per head (SPEC §1)
  /// `automatic`: the chunkwise tensor-core kernels for bf16/f16 inputs where they cover the model
  /// (every decay, K, V <= 128, not the exact preconditioners), else the float32 recurrent kernels (the
  /// exact preconditioners: the exact kernels, launch/exact.cuh). `chunkwise` forces the
  /// former (its products use 16-bit operands, so float32 inputs then see bf16-level rounding, about
  /// 1e-2 relative); `recurrent` the latter.
  Algorithm algorithm = Algorithm::automatic;
};

/// Device scratch memory owned by the caller and reused across calls: it grows when a call needs
/// more and never shrinks, so repeated calls of one size do not allocate. Not thread-safe: use one
/// per stream.
///
/// CUDA graphs: a call may be captured (any capture mode), also the first call on a fresh workspace
/// and one that grows it: the allocation runs outside the capture (relaxed capture mode), and a
/// buffer outgrown is kept, not freed, until the workspace is destroyed, since a graph captured
/// earlier still reads it on replay. Growth is geometric (at least 1.5x), so the buffers kept add
/// up to at most twice the current one. Destroy a workspace only after the graphs that used it.
class Workspace {
 public:
  Workspace() = default;
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  /// Moves the buffers; the source becomes empty.
  Workspace(Workspace&& o) noexcept
      : ptr_(o.ptr_), bytes_(o.bytes_), saved_(o.saved_), retired_(std::move(o.retired_)) {
    o.ptr_ = nullptr, o.bytes_ = 0, o.saved_ = 0;
    o.retired_.clear();
  }
  /// At least `bytes` of device memory, 256-byte aligned; valid while the workspace lives (growing
  /// moves later calls to a new buffer and drops the saved forward, see saved_forward()).
  void* get(size_t bytes);
  /// Bytes currently held.
  size_t bytes() const { return bytes_; }
  /// Fingerprint of the training forward (forward_training) whose activations the workspace holds, 0
  /// for none. forward_training sets it; every other call that uses the workspace clears it.
  uint64_t saved_forward() const { return saved_; }
  /// Sets the fingerprint (the library's calls do; 0 forgets the saved forward).
  void set_saved_forward(uint64_t key) { saved_ = key; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  uint64_t saved_ = 0;
  std::vector<void*> retired_;  ///< outgrown buffers, freed with the workspace (captured graphs may read them)
};

/// True when the CUDA runtime finds a usable GPU (false on a machine without a GPU or driver).
bool available();

/// True when `p` points to device (or managed) memory of the current device.
bool is_device_pointer(const void* p);

/// True when the CUDA backend implements model `spec` with `algorithm`: every decay, gain and solve with
/// the Identity, diagonal and exact preconditioners for the recurrent (and automatic) algorithm; the
/// chunkwise algorithm (tensor cores, SPEC §4) for the Identity and diagonal ones (K, V <= 128). The exact
/// preconditioners (ExactATK: Mesa layer, ExactATQ: ridge readout) have no chunkwise form (SPEC §4 covers the
/// diagonal ones): they run the exact kernels, the inverse Gram P (K x K, K <= 128) kept in float64.
constexpr bool supports(const ModelSpec& spec, Algorithm algorithm = Algorithm::automatic) {
  const bool diag_or_identity = spec.precond == precond::Kind::identity ||
                                spec.precond == precond::Kind::diagonal_atk ||
                                spec.precond == precond::Kind::diagonal_atq;
  const bool exact = spec.precond == precond::Kind::exact_atk || spec.precond == precond::Kind::exact_atq;
  if (exact) return algorithm == Algorithm::automatic || algorithm == Algorithm::recurrent;
  return diag_or_identity && (algorithm == Algorithm::automatic || algorithm == Algorithm::recurrent ||
                              algorithm == Algorithm::chunkwise);
}

/// Forward pass (SPEC §2, §4) on `stream` (a cudaStream_t; null = the default stream). Writes `o`
/// and, when given, `hT`/`aT`. Throws dgps::Error for a call it cannot run (nothing is launched
/// then). Returns the name of the kernel that ran: "cuda/chunkwise/v64" (or v128, v32, v16: the
/// chunkwise kernels, value columns per block of the state pass; "/raw" when it reads q and k rows
/// from the inputs; "cuda/chunkwise/wgmma/v128" or "/v64" when it runs on Hopper's warpgroup
/// products, "cuda/chunkwise/wgmma/v128/raw/tma" when it also copies the raw rows with tensor copies,
/// ".../v128/raw/tma/rv" (or ".../v128/tma/rv" without raw q and k rows) when with the delta rule
/// (16-bit inputs, V = 128) it also forms the residual from the raw v rows and the intra-chunk solve
/// instead of reading W and U, "/kw" when it also forms PGDN's and PDN's write keys, "/split" when a few long
/// sequences' pass runs in segments), "cuda/rowblock/v64" (block-row kernel, 64 value
/// columns per block), "cuda/rowblock/v32", or "cuda/recurrent/k128/ks2" (warp kernel, used when
/// the state rows cannot move 16 bytes at a time, e.g. V % 4 != 0). The exact preconditioners:
/// "cuda/exact/k128" (or k64, k32, k16: K padded to the kernels' key tile), see launch/exact.cuh.
const char* forward(const Params& p, Workspace& ws, void* stream = nullptr);

/// Forward pass of a training step: writes what `forward` writes and keeps in `ws` the activations
/// the chunkwise backward needs (its intra-chunk tiles, chunk-entry states and residuals), so that a
/// following `backward(p, g, ws, stream)` with the same `p` skips recomputing the forward (about a
/// third of a training step). The workspace then holds backward_workspace_bytes(p). The inputs must
/// not change between the two calls; any other call on `ws` in between (or a `p` that differs in a
/// pointer, stride, size or option) makes the backward recompute, so results never depend on it.
/// Where the backward is not chunkwise (see `backward`) this is `forward`. Returns the kernel's name.
const char* forward_training(const Params& p, Workspace& ws, void* stream = nullptr);

/// Decode: `p.T` (1 to a few) new tokens for each of `p.B` sequences (`p.N == p.B`, no cu_seqlens),
/// continuing from the states `p.h0`/`p.a0` (a pool of states addressed through `p.slots`, or one
/// per sequence) and writing them back in place (`p.hT`/`p.aT` must equal `p.h0`/`p.a0` or be null,
/// which means the same). Equal to `forward` with h0 = hT = state. On Hopper (sm_90) the kernels are
/// programmatic dependent launches (also inside a CUDA graph capture): their blocks are scheduled
/// while the previous kernel on the stream finishes and wait for it before reading anything; with a
/// diagonal preconditioner and a small batch each key head's
/// blocks form a thread block cluster; with a large batch (at least four (sequence, key head) pairs
/// per SM) and one token, one block per (sequence, key head) runs all its value heads and updates the
/// statistics it owns; with a small batch, one token and no preconditioner, a warp per 8 value
/// columns and no block barrier. Returns "cuda/decode/v64g" (that grouped kernel), "cuda/decode/w32"
/// (the warp-column kernel), "cuda/decode/v64" or "cuda/decode/v32" (one token), "cuda/decode/v128"
/// or "cuda/decode/v32" (more tokens), or the warp kernel's name. The exact preconditioners: the inverse Gram P
/// ([N, H, K, K] through `slots` like h) and h updated in place by the exact kernels, "cuda/exact/decode/k128"
/// (k64, k32, k16).
const char* decode(const Params& p, Workspace& ws, void* stream = nullptr);

/// Cotangents and gradient destinations of a CUDA backward call (device tensors, same layouts as the
/// forward's: SPEC §1). `d_o` is required; every other tensor is optional. Gradients take the
/// element type of their input: dq, dk, dv `Params::dtype`; dg, dbeta, dg_p, dbeta_p, dcenter
/// `Params::gate_dtype`; dh0, da0, dhT, daT float32. A gradient may be requested only when its input
/// is present (dh0/da0 are always allowed: the gradient with respect to a zero initial state).
struct GradParams {
  Tensor d_o;                                  ///< [B, T, HV, V] cotangent of o (dtype)
  Tensor dhT, daT;                             ///< optional cotangents of hT [N, HV, K, V] and aT ([N, H, K] or [N, H, K, K])
  Tensor dq, dk, dv;                           ///< [B, T, H, K], [B, T, H, K], [B, T, HV, V]
  Tensor dg, dbeta, dg_p, dbeta_p, dcenter;    ///< shapes of g, beta, g_p, beta_p, center
  Tensor dh0, da0;                             ///< [N, HV, K, V], [N, H, K] (exact: [N, H, K, K])
};

/// True when the CUDA backend has a backward for model `spec`: the forward's coverage (Identity, diagonal and
/// exact preconditioners, every decay, gain and solve).
constexpr bool supports_backward(const ModelSpec& spec) { return supports(spec, Algorithm::recurrent); }

/// Backward pass (SPEC §3.8): the gradients of `sum(o * d_o) + sum(hT * dhT) + sum(aT * daT)` with
/// respect to every input whose destination is given in `g`, for the forward described by `p`
/// (`p.o`, `p.hT`, `p.aT` are not read). Two algorithms, both with fixed-order reductions and no
/// atomics (two calls on the same inputs give bitwise equal gradients):
///  - chunkwise, on tensor cores (16-bit operands, float32 accumulation and state gradient; 64-token
///    chunks, SPEC §4): for bf16/f16 inputs by default (float32 inputs with Algorithm::chunkwise)
///    when the chunkwise forward covers the call (K, V <= 128, every decay) and K >= 64. Right after
///    forward_training(p, ws) it starts from the saved activations. Returns "cuda/backward/chunkwise"
///    ("cuda/backward/chunkwise/saved" when it did);
///  - otherwise (Algorithm::recurrent, float32 inputs, K < 64), float32 state
///    arithmetic throughout: a recurrent pass saves the state every 64 tokens, a reverse pass carries
///    its gradient, and the per-token gradients are formed chunk by chunk. Returns
///    "cuda/backward/recurrent";
///  - the exact preconditioners (any input type): their own kernels (launch/exact.cuh), the state side in float32
///    with checkpoints, the inverse Gram and its gradient in float64 run back token by token (P undone by the
///    inverse Sherman-Morrison step). Returns "cuda/exact/backward/k128" (k64, k32, k16).
/// Runs on `stream` without host synchronisation. Throws dgps::Error for a call it cannot run
/// (nothing is launched then).
const char* backward(const Params& p, const GradParams& g, Workspace& ws, void* stream = nullptr);

/// Bytes of workspace `backward` needs for the call `p` (the workspace grows to it on the first call).
size_t backward_workspace_bytes(const Params& p);

namespace detail {
/// The strides of a validated view's first three dimensions (the rest of the Tensor contract).
template <class T>
Tensor tensor_of(const TensorView<T>& v) {
  Tensor t;
  t.data = v.data;
  for (int d = 0; d < 3; ++d) t.stride[d] = d < v.rank ? v.stride[d] : 0;
  return t;
}
}  // namespace detail

}  // namespace dgps::cuda
