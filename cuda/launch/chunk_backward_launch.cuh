/// @brief The chunkwise backward on tensor cores (SPEC §3.8, §4): its launcher, and the algorithm below.
///
/// Every decay, 16-bit operands, float32 accumulation, fixed-order reductions (deterministic). The kernels:
/// chunk_bwd_state.cuh (steps 1, 2), chunk_bwd_grad.cuh (3), chunk_bwd_keys.cuh (4).
///
/// Per chunk (C = 64 rows i, j; gamma the chunk-local cumulative gate, E = e^gamma, Ed = e^{gamma_L - gamma};
/// Bm_ij = e^{gamma_i - gamma_j} kn_i . kw_j (j < i); T2 = (I + Bm Diag(beta))^{-1}; P_ij = e^{gamma_i - gamma_j}
/// qr_i . kw_j (j <= i)), the forward is
///   r = T2 (V - (Kn ⊙ E) S_0),  O = (Qr ⊙ E) S_0 + P Diag(beta) r,  S_C = e^{gamma_L} S_0 + (KW ⊙ Ed)^T Diag(beta) r,
/// and with H = dS_C the backward is
///   dX = dv = Ub + Wb H,  Ub = T2^T Diag(beta) P^T dO,  Wb = T2^T (Diag(beta) KW ⊙ Ed),
///   dS_0 = e^{gamma_L} H + Qr^T (E ⊙ dO) - Kn^T (E ⊙ dX)            (online; offline: no dX term, r = V).
/// Kernels, after the forward's intra-chunk kernel (backward mode: T2 and Kn) and its state pass
/// (backward mode: S_0 and r of every chunk):
///   1. `bwd_prep_kernel` (chunk, value head): Ub, Wb and a copy of do;
///   2. `bwd_rev_kernel` (sequence, value head, value tile): chunks in reverse order, the state
///      gradient in float32 registers; writes dv and H of every chunk, and dh0;
///   3. `bwd_grad_kernel` (chunk, value head), with Aq = dO r^T, Ar = dX r^T masked and decayed to
///      Mq (j < i), Mr (j < i), the diagonal d_i = dO_i . r_i apart:
///        dqr = E ⊙ (dO S_0^T) + Mq Diag(beta) KW + d ⊙ beta ⊙ KW,   dkn = -E ⊙ (dX S_0^T) - Mr Diag(beta) KW,
///        Pr  = Ed ⊙ (r H^T) + Mq^T Qr - Mr^T Kn + d ⊙ Qr,           dkw = beta ⊙ Pr,  dbeta = rowsum(kw ⊙ Pr),
///        dgamma_i = qr_i . dqr_i + kn_i . dkn_i - kw_i . dkw_i (+ sum H ⊙ S_C at the last row) with the
///      gate-free terms (d, and the last row's H r) kept out of it, as the float32 backward does; dg
///      = suffix sums of dgamma;
///      Diagonal decay: gamma is a vector per row, E, Ed act per channel and every e^{gamma_i - gamma_j}
///      above is per channel. The forward's tiles carry the decays (Qr ⊙ E, Kn ⊙ E, KW ⊙ Ed: steps 1
///      and 2 then run as written with gamma = 0, H's rows decaying by e^{gamma_L} per channel); the
///      gradient kernel reads the undecayed tiles, splits e^{gamma_i - gamma_j} at the 16-row block
///      boundaries (as the forward's diag_decay_akk_p does), and sums dgamma per channel (dg per channel,
///      with a boundary term per channel);
///   4. unless 3 finishes dq and dk itself (Identity preconditioner, no GVA), per (chunk, key head),
///      thread = channel: `key_local_kernel` and `key_carry_kernel` (diagonal preconditioners) scan dA
///      in reverse through A_t = e^{g_p,t} A_{t-1} + beta_p,t kn_t^2, chunk-locally then across the
///      chunks; `key_apply_kernel` sums the group's key-side gradients, chains them through M, applies
///      the scanned dA (dk, dg_p, dbeta_p, dcenter's per-chunk part) and the L2 norm's backward.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/backward.cuh"
#include "launch/chunk.cuh"
#include "kernels/chunk_bwd_grad.cuh"
#include "kernels/chunk_bwd_keys.cuh"
#include "kernels/chunk_bwd_state.cuh"
#include "launch/chunk_launch.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

template <class Tin, class Op, int VT, int WARPS = 4, int NBUF = 2>
cudaError_t launch_rev(const ChunkArgs& ca, const BwdArgs& bw, cudaStream_t stream) {
  constexpr size_t bytes = bwd_rev_smem_bytes(VT, NBUF);
  static const cudaError_t set = allow_smem(bwd_rev_kernel<Tin, Op, VT, WARPS, NBUF>, bytes);
  if (set != cudaSuccess) return set;
  const dim3 grid(ca.Vpad / VT, ca.a.HV, ca.a.N);
  bwd_rev_kernel<Tin, Op, VT, WARPS, NBUF><<<grid, WARPS * 32 + (WARPS == 4 ? 32 : 0), bytes, stream>>>(ca, bw);
  return cudaGetLastError();
}

template <class Tin, class Op>
cudaError_t launch_bwd_all(const ChunkArgs& ca, const BwdArgs& bw, cudaStream_t stream) {
  const RecArgs& a = ca.a;
  if (ca.chunk_bound == 0) return cudaSuccess;
  const char* impl = nullptr;
  // The intra-chunk kernel and state pass in backward mode, unless a training forward ran them.
  cudaError_t e = ca.saved ? cudaSuccess : launch_all<Tin, Op>(ca, stream, &impl);
  if (e != cudaSuccess) return e;
  const dim3 tiles(static_cast<unsigned>(ca.chunk_bound), a.HV);
  static const cudaError_t set_prep = allow_smem(bwd_prep_kernel<Tin, Op>, bwd_prep_smem_bytes());
  if (set_prep != cudaSuccess) return set_prep;
  bwd_prep_kernel<Tin, Op><<<tiles, kThreads, bwd_prep_smem_bytes(), stream>>>(ca, bw);
  const int sms = sm_count();
  const int64_t heads = int64_t(a.N) * a.HV;
  const size_t smem = chunk_max_smem();
  if (ca.Vpad == 128 && heads >= sms * 9 / 10 && bwd_rev_smem_bytes(128) <= smem)
    e = launch_rev<Tin, Op, 128, 16>(ca, bw, stream);
  else if (heads * (ca.Vpad / 64) >= sms && bwd_rev_smem_bytes(64) <= smem)
    e = launch_rev<Tin, Op, 64>(ca, bw, stream);
  else if (heads * (ca.Vpad / 32) >= sms && bwd_rev_smem_bytes(32) <= smem)
    e = launch_rev<Tin, Op, 32>(ca, bw, stream);
  else if (bwd_rev_smem_bytes(16, 3) <= smem)  // three buffers (the producer two chunks ahead) where they fit
    e = launch_rev<Tin, Op, 16, 4, 3>(ca, bw, stream);
  else
    e = launch_rev<Tin, Op, 16>(ca, bw, stream);
  if (e != cudaSuccess) return e;
  if (a.decay == kDecayDiagonal) {
    static const cudaError_t set = allow_smem(bwd_grad_kernel<Tin, Op, true>, bwd_grad_smem_bytes());
    if (set != cudaSuccess) return set;
    bwd_grad_kernel<Tin, Op, true><<<tiles, kGradThreads, bwd_grad_smem_bytes(), stream>>>(ca, bw);
  } else {
    static const cudaError_t set = allow_smem(bwd_grad_kernel<Tin, Op, false>, bwd_grad_smem_bytes());
    if (set != cudaSuccess) return set;
    bwd_grad_kernel<Tin, Op, false><<<tiles, kGradThreads, bwd_grad_smem_bytes(), stream>>>(ca, bw);
  }
  if (fused_key_grads(bw)) return cudaGetLastError();
  // The key gradients per chunk: preconditioner chain, statistics' reverse scan, L2 norm.
  const dim3 keys(static_cast<unsigned>(ca.chunk_bound), a.H);
  if (a.precond == kPrecondATK)
    key_local_kernel<Tin, true><<<keys, kThreads, 0, stream>>>(ca, bw);
  else if (a.precond == kPrecondATQ)
    key_local_kernel<Tin, false><<<keys, kThreads, 0, stream>>>(ca, bw);
  if (a.precond != kPrecondIdentity) key_carry_kernel<<<dim3(a.H, a.N), bw.Kp, 0, stream>>>(ca, bw);
  if (a.precond == kPrecondATK)
    key_apply_kernel<Tin, kPrecondATK><<<keys, kThreads, 0, stream>>>(ca, bw);
  else if (a.precond == kPrecondATQ)
    key_apply_kernel<Tin, kPrecondATQ><<<keys, kThreads, 0, stream>>>(ca, bw);
  else
    key_apply_kernel<Tin, kPrecondIdentity><<<keys, kThreads, 0, stream>>>(ca, bw);
  return cudaGetLastError();
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk

namespace dgps::cuda::kernels {

template <class Tin>
cudaError_t launch_chunk_backward(const ChunkArgs& c, const BwdArgs& b, cudaStream_t stream) {
  using Op = std::conditional_t<std::is_same_v<Tin, __half>, __half, __nv_bfloat16>;
  return chunk::launch_bwd_all<Tin, Op>(c, b, stream);
}

}  // namespace dgps::cuda::kernels
