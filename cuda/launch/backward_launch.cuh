/// @brief The float32 backward's launcher (see launch/backward.cuh for the algorithm), compiled once per input type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch/backward.cuh"
#include "kernels/recurrent_bwd_grad.cuh"
#include "kernels/recurrent_bwd_inputs.cuh"
#include "kernels/recurrent_bwd_keys.cuh"
#include "kernels/recurrent_bwd_state.cuh"
#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels {
namespace {

template <class Tin, int KT, bool DIAG>
cudaError_t launch_chunk_grad(const BwdArgs& b, cudaStream_t st) {
  const size_t smem = GradLayout<KT>::bytes();
  const cudaError_t e = cudaFuncSetAttribute(chunk_grad_kernel<Tin, KT, DIAG>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  chunk_grad_kernel<Tin, KT, DIAG><<<dim3(unsigned(b.slots), b.a.HV), 256, smem, st>>>(b);
  return cudaGetLastError();
}

template <class Tin, int KT, int COLS>
cudaError_t launch_state(const BwdArgs& b, cudaStream_t st) {
  using SL = StateLayout<KT, COLS>;
  const dim3 grid((b.a.V + SL::NCOL - 1) / SL::NCOL, b.a.HV, b.a.N);
  const int smem = static_cast<int>(SL::bytes());
  for (const void* f : {reinterpret_cast<const void*>(state_fwd_kernel<Tin, KT, COLS>),
                        reinterpret_cast<const void*>(state_rev_kernel<Tin, KT, COLS>)}) {
    const cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  state_fwd_kernel<Tin, KT, COLS><<<grid, kStateWarps * 32, smem, st>>>(b);
  state_rev_kernel<Tin, KT, COLS><<<grid, kStateWarps * 32, smem, st>>>(b);
  return cudaGetLastError();
}

/// The state passes are latency-bound sequential loops: 8 value columns per warp when that gives
/// about 8 warps per SM, else 4 or 2 (more warps, each with fewer state rows per thread).
template <class Tin, int KT>
cudaError_t launch_backward_k(const BwdArgs& b, cudaStream_t st) {
  const RecArgs& a = b.a;
  const int sms = sm_count();
  const int64_t warps8 = int64_t(a.N) * a.HV * ((a.V + 7) / 8);
  const cudaError_t e = warps8 >= 8 * sms       ? launch_state<Tin, KT, 8>(b, st)
                        : 2 * warps8 >= 8 * sms ? launch_state<Tin, KT, 4>(b, st)
                                                : launch_state<Tin, KT, 2>(b, st);
  if (e != cudaSuccess) return e;
  if (b.rows == 0) return cudaGetLastError();
  return a.decay == kDecayDiagonal ? launch_chunk_grad<Tin, KT, true>(b, st) : launch_chunk_grad<Tin, KT, false>(b, st);
}

}  // namespace

template <class Tin>
cudaError_t launch_backward(const BwdArgs& b, cudaStream_t st) {
  const RecArgs& a = b.a;
  const bool has_p = a.precond != kPrecondIdentity;
  const unsigned warps = unsigned((b.rows * a.H + 3) / 4);
  if (b.chunk) {  // every step chunkwise
    const cudaError_t e = launch_chunk_backward<Tin>(*b.chunk, b, st);
    if (e != cudaSuccess) return e;
    if (has_p && b.dcenter) center_grad_kernel<<<a.H, 256, 0, st>>>(b, b.chunk->chunk_bound);
    return cudaGetLastError();
  }
  const dim3 chunks(unsigned(b.slots), a.H), seqs(a.H, a.N);
  if (warps) norm_kernel<Tin><<<warps, 128, 0, st>>>(b);
  if (has_p) {
    stats_local_kernel<<<chunks, b.Kp, 0, st>>>(b);
    stats_carry_kernel<<<seqs, b.Kp, 0, st>>>(b);
    stats_apply_kernel<<<chunks, b.Kp, 0, st>>>(b);
  }
  const cudaError_t e = b.Kp == 64 ? launch_backward_k<Tin, 64>(b, st) : launch_backward_k<Tin, 128>(b, st);
  if (e != cudaSuccess) return e;
  if (warps) key_grad_kernel<<<warps, 128, 0, st>>>(b);
  if (has_p) {
    stats_rev_local_kernel<<<chunks, b.Kp, 0, st>>>(b);
    stats_rev_carry_kernel<<<seqs, b.Kp, 0, st>>>(b);
    stats_rev_apply_kernel<<<chunks, b.Kp, 0, st>>>(b);
  }
  if (warps) input_grad_kernel<Tin><<<warps, 128, 0, st>>>(b);
  if (has_p && b.dcenter) center_grad_kernel<<<a.H, 256, 0, st>>>(b, b.rows);
  return cudaGetLastError();
}

}  // namespace dgps::cuda::kernels
