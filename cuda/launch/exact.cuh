/// @brief The exact preconditioners on CUDA (SPEC §2 ExactATK: Mesa layer, ExactATQ: ridge readout): launch
/// arguments, workspace layout and launchers of the forward, decode and backward.
///
/// The inverse Gram P_t = G_t^{-1} (K x K, kept by Sherman-Morrison) depends on every earlier token of its key
/// head, so there is no chunkwise form: one thread block per (sequence, key head) runs P through the tokens,
/// and the state S (K x V, float32) runs in separate blocks per (sequence, value head, 32 value columns) from
/// the keys it wrote. Kernels (kernels/exact.cuh):
///   1. `exact_precond_kernel` (forward, decode, backward): P in float64, spread over 4 K threads (one row per
///      four threads, a quarter of its columns each, in registers). Per token: y = P_{t-1} k, w = P_{t-1} q,
///      kappa = k.y, den = a + beta_p kappa, f = beta_p / den; the write key kw = y / den (ExactATK) or the
///      read query qr = (w - f y (y.q)) / a (ExactATQ); then P_t = P_{t-1} / a - sg s s^T, s = sqrt(|f| / a) y,
///      sg = sign(f), formed so that P stays exactly symmetric (as the CPU's ExactPre). Writes the read key,
///      query and the mapped vectors of every token (`keys`), aT, and for the backward y, w, the scalars and P_T.
///   2. `exact_state_kernel` (forward, decode): per (sequence, value head, 32 columns), 4 threads per column,
///      the decay, the delta-rule (Online) or accumulating (Offline) write and the readout o = S_t^T qr.
///   Backward (SPEC §3.8), in reverse:
///   3. `exact_state_bwd_kernel`: the state side per (sequence, value head, 32 columns): a forward sweep that
///      checkpoints S every kExactChunk tokens, then per chunk (in reverse) a recompute that holds S_{t-1} of
///      its tokens and the reverse recurrence of dS: dv, dh0, and per token and block the partial sums of the
///      gradients of the read query, write key and read key and of the decay and gain.
///   4. `exact_combine_kernel`: sums those partials over the column blocks and the group's value heads (GVA):
///      dg, dbeta, and the gradient of the mapped vector dm with the direct terms of dq and dk.
///   5. `exact_precond_bwd_kernel`: per (sequence, key head), P run back from P_T by the inverse
///      Sherman-Morrison step P_{t-1} = a P_t + f y y^T (two positive semi-definite terms, no cancellation) with
///      the gradient Pi = dL/dP (shared memory, float64) in the same sweep: dg_p, dbeta_p, da0 and the
///      preconditioner's terms of dq, dk (the CPU's exact_backward, backends/cpu/exact_backward.hpp).
///   6. `exact_norm_kernel`: the L2 norm's and scale's backward (SPEC §1): dq, dk.
/// Fixed-order reductions throughout (no atomics): repeated calls give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "launch/backward.cuh"
#include "launch/recurrent.cuh"
#include "plan.hpp"

namespace dgps::cuda::kernels {

/// Tokens per checkpoint of the backward's state sweep (and per held block of states).
constexpr int kExactChunk = 32;
/// Value columns per block of the state kernels.
constexpr int kExactCols = 32;

/// The launch arguments of the exact kernels: the call (b.a the forward's inputs; b's gradients for the
/// backward) and the workspace.
struct ExactArgs {
  BwdArgs b;
  int KP = 16;         ///< K padded to the key tile (16, 32, 64 or 128)
  int ncb = 1;         ///< value column blocks of kExactCols
  int64_t rows = 0;    ///< B * T token rows
  int64_t slots = 0;   ///< checkpoint slots: rows / kExactChunk + N + 1
  bool save = false;   ///< exact_precond_kernel keeps y, w, the scalars and P_T (the backward)
  float* keys = nullptr;   ///< [rows, H, 4, KP]: read key kn, normalised scaled q, write key kw, read query qr
  double* yw = nullptr;    ///< [rows, H, 2, KP]: y = P_{t-1} k, w = P_{t-1} q
  double* scal = nullptr;  ///< [rows, H, 8]: a, beta_p, kappa, den, f, y.q
  double* PT = nullptr;    ///< [N, H, KP, KP]: P after the last token
  float* ck = nullptr;     ///< [slots, HV, ncb, KP * 32]: the state entering each chunk, per block
  float* held = nullptr;   ///< [N * HV * ncb, kExactChunk, KP * 32]: states S_{t-1} of one chunk, per block
  float* part = nullptr;   ///< [rows, HV, ncb, 4, KP]: partial dqr, dkw, dkn, dgamma per block
  float* pdb = nullptr;    ///< [rows, HV, ncb]: partial dbeta per block
  float* dmq = nullptr;    ///< [rows, H, 3, KP]: dm, the direct dq and dk (of the normalised q, k)
  float* dqk = nullptr;    ///< [rows, H, 2, KP]: gradients of the normalised scaled q and of the normalised k
};

/// K padded to the exact kernels' key tile.
inline int exact_keys(int K) { return K <= 16 ? 16 : K <= 32 ? 32 : K <= 64 ? 64 : 128; }

/// Bytes of workspace of a call (`backward`: the backward's arrays too); with `base` non-null (256-byte
/// aligned), also points e's workspace pointers into it.
size_t exact_workspace(ExactArgs& e, bool backward, void* base);

/// Launches the forward (Plan::Kernel::exact_forward or exact_decode: kernels 1, 2) or the backward
/// (exact_backward: kernels 1, 3 to 6) of the plan, for input type Tin.
template <class Tin>
cudaError_t launch_exact(const ExactArgs& e, const Plan& plan, cudaStream_t stream);

}  // namespace dgps::cuda::kernels
