/// @brief The float32 backward's per-token inputs (backward.cuh, steps 1 and 2): normalised q, k and the statistics.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backward.cuh"
#include "chunk.cuh"
#include "recurrent.cuh"
#include "recurrent_bwd_common.cuh"
#include "recurrent_impl.cuh"

// Internal linkage: each input type's translation unit has its own copy of the non-template kernels.
namespace dgps::cuda::kernels {
namespace {

/// 1. Normalised q (times scale) and k of token row `row`, key head h (when qn is allocated) and their
/// inverse norms; one warp each, zero-padded to Kp.
template <class Tin>
__global__ void __launch_bounds__(128) norm_kernel(const BwdArgs b) {
  const RecArgs& a = b.a;
  const int64_t w = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (w >= b.rows * a.H) return;
  const int lane = threadIdx.x % 32, h = int(w % a.H);
  const int64_t row = w / a.H, bb = row / a.T, t = row % a.T;
  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  float qv[4], kv[4], ssq = 0.f, ssk = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane + 32 * j;
    const bool ok = c < a.K;
    qv[j] = ok ? to_float(q[at(a.sq, bb, t, h, c)]) : 0.f;
    kv[j] = ok ? to_float(k[at(a.sk, bb, t, h, c)]) : 0.f;
    ssq = fmaf(qv[j], qv[j], ssq);
    ssk = fmaf(kv[j], kv[j], ssk);
  }
  const float rq = a.l2norm ? rsqrtf(warp_sum(ssq) + 1e-6f) : 1.f;
  const float rk = a.l2norm ? rsqrtf(warp_sum(ssk) + 1e-6f) : 1.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane + 32 * j;
    if (c < b.Kp && b.qn) {
      b.qn[w * b.Kp + c] = qv[j] * rq * a.scale;
      b.kn[w * b.Kp + c] = kv[j] * rk;
    }
  }
  if (lane == 0) b.rq[w] = rq, b.rk[w] = rk;
}

/// e^{g_p} and beta_p k^2 of token i of sequence s (key head h, channel c): the statistics' step
/// A_t = e^{g_p} A_{t-1} + beta_p k^2 (SPEC §2).
__device__ __forceinline__ float2 stats_step(const BwdArgs& b, const Seq& s, int64_t i, int h, int c) {
  const RecArgs& a = b.a;
  const int64_t t = s.t0 + i;
  const float kn = b.kn[((s.row0 + i) * a.H + h) * b.Kp + c];
  return {expf(load_gate(a.g_p, at(a.sgp, s.b, t, h), a.gate_dtype)),
          load_gate(a.beta_p, at(a.sbp, s.b, t, h), a.gate_dtype) * kn * kn};
}

/// 2a. The statistics' scan is chunked (SPEC §4): per (chunk, key head, channel), the chunk's decay
/// product and its scan from zero.
__global__ void stats_local_kernel(const BwdArgs b) {
  int n;
  int64_t k;
  slot_chunk(b.a, blockIdx.x, &n, &k);
  if (k < 0) return;
  const int h = blockIdx.y, c = threadIdx.x;
  const Seq s = seq_of(b.a, n);
  float P = 1.f, x = 0.f;
#pragma unroll 8
  for (int64_t i = k * kBwdChunk, i1 = chunk_end(s, k); i < i1; ++i) {
    const float2 st = stats_step(b, s, i, h, c);
    x = fmaf(st.x, x, st.y);
    P *= st.x;
  }
  b.sums[(int64_t(blockIdx.x) * b.a.H + h) * b.Kp + c] = make_float2(P, x);
}

/// 2b. Per (sequence, key head, channel), in order over the chunks: the statistics entering each chunk.
__global__ void stats_carry_kernel(const BwdArgs b) {
  const RecArgs& a = b.a;
  const int h = blockIdx.x, n = blockIdx.y, c = threadIdx.x;
  const Seq s = seq_of(a, n);
  const int64_t base = slot_base(s.row0, n), nch = (s.len + kBwdChunk - 1) / kBwdChunk;
  float X = (a.a0 && c < a.K) ? a.a0[n * a.sa0[0] + h * a.sa0[1] + c] : 0.f;
  const int64_t e0 = (base * a.H + h) * b.Kp + c;
  scan_chunk_sums<false>(b.sums + e0, b.carry + e0, int64_t(a.H) * b.Kp, nch, X);
}

/// 2c. Per (chunk, key head, channel): A_t from the chunk's entry value, and M_t = squash(A_t).
__global__ void stats_apply_kernel(const BwdArgs b) {
  int n;
  int64_t k;
  slot_chunk(b.a, blockIdx.x, &n, &k);
  if (k < 0) return;
  const RecArgs& a = b.a;
  const int h = blockIdx.y, c = threadIdx.x;
  const Seq s = seq_of(a, n);
  const float center = load_gate(a.center, h, a.gate_dtype);
  float A = b.carry[(int64_t(blockIdx.x) * a.H + h) * b.Kp + c];
#pragma unroll 8
  for (int64_t i = k * kBwdChunk, i1 = chunk_end(s, k); i < i1; ++i) {
    const float2 st = stats_step(b, s, i, h, c);
    A = fmaf(st.x, A, st.y);
    const int64_t e = ((s.row0 + i) * a.H + h) * b.Kp + c;
    b.A[e] = A;
    b.M[e] = c < a.K ? squash(A, center, a.log_x, a.eps) : 1.f;
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels
