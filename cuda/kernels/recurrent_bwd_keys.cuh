/// @brief The float32 backward's key-side gradients (launch/backward.cuh, steps 6 to 8) and the sums of dcenter.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/backward.cuh"
#include "launch/recurrent.cuh"
#include "kernels/recurrent_bwd_common.cuh"
#include "kernels/recurrent_warp.cuh"

// Internal linkage: each input type's translation unit has its own copy of the non-template kernels.
namespace dgps::cuda::kernels {
namespace {

/// 6. Per (token row, key head), one warp: the group's key-side gradients summed in order, chained
/// through the preconditioner's M (written over the group's first value head: dQ <- dqn, dKn <- dkn).
__global__ void __launch_bounds__(128) key_grad_kernel(const BwdArgs b) {
  const RecArgs& a = b.a;
  const int64_t w = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (w >= b.rows * a.H) return;
  const int lane = threadIdx.x % 32, h = int(w % a.H);
  const int64_t row = w / a.H;
  const bool atk = a.precond == kPrecondATK, atq = a.precond == kPrecondATQ, has_p = atk || atq;
  const float center = has_p ? load_gate(a.center, h, a.gate_dtype) : 0.f;
  float dcen = 0.f;
  for (int c = lane; c < b.Kp; c += 32) {
    const int64_t g0 = (row * a.HV + int64_t(h) * a.group) * b.Kp + c;
    float dqr = 0.f, dkn = 0.f, dkw = 0.f;
    for (int g = 0; g < a.group; ++g) {
      dqr += b.dQ[g0 + g * b.Kp];
      dkn += b.dKn[g0 + g * b.Kp];
      dkw += b.dKW[g0 + g * b.Kp];
    }
    const int64_t e = w * b.Kp + c;
    float dM = 0.f;
    if (atk) {
      const float M = b.M[e];
      dM = dkw * b.kn[e];
      dkw *= M;
    } else if (atq) {
      const float M = b.M[e];
      dM = dqr * b.qn[e];
      dqr *= M;
    }
    b.dQ[g0] = dqr;
    b.dKn[g0] = dkn + dkw;
    if (has_p) {
      float dmda = 0.f, dmdc = 0.f;
      if (c < a.K) squash_slopes(b.A[e], b.M[e], center, a.log_x, a.eps, &dmda, &dmdc);
      b.dA[e] = dM * dmda;
      dcen = fmaf(dM, dmdc, dcen);
    }
  }
  if (has_p) {
    dcen = warp_sum(dcen);
    if (lane == 0) b.dcen[w] = dcen;
  }
}

/// 7a. The reverse scan of the statistics' gradient, chunked like the forward one: per (chunk, key
/// head, channel), dA_t = dA_t(local) + e^{g_p,t+1} dA_{t+1} from a zero carry, and the chunk's
/// decay product.
__global__ void stats_rev_local_kernel(const BwdArgs b) {
  int n;
  int64_t k;
  slot_chunk(b.a, blockIdx.x, &n, &k);
  if (k < 0) return;
  const RecArgs& a = b.a;
  const int h = blockIdx.y, c = threadIdx.x;
  const Seq s = seq_of(a, n);
  float P = 1.f, carry = 0.f;
#pragma unroll 8
  for (int64_t i = chunk_end(s, k) - 1; i >= k * kBwdChunk; --i) {
    const float gp = expf(load_gate(a.g_p, at(a.sgp, s.b, s.t0 + i, h), a.gate_dtype));
    carry = gp * (b.dA[((s.row0 + i) * a.H + h) * b.Kp + c] + carry);
    P *= gp;
  }
  b.sums[(int64_t(blockIdx.x) * a.H + h) * b.Kp + c] = make_float2(P, carry);
}

/// 7b. Per (sequence, key head, channel), from the last chunk back: the carry entering each chunk
/// from its future (daT at the end) and da0.
__global__ void stats_rev_carry_kernel(const BwdArgs b) {
  const int h = blockIdx.x, n = blockIdx.y;
  const Seq s = seq_of(b.a, n);
  stats_reverse_carry(b, n, h, threadIdx.x, slot_base(s.row0, n), (s.len + kBwdChunk - 1) / kBwdChunk);
}

/// 7c. Per (chunk, key head, channel): the scanned dA_t (over the local one) and each token's dg_p
/// term e^{g_p,t} dA_t A_{t-1} (over M, no longer needed).
__global__ void stats_rev_apply_kernel(const BwdArgs b) {
  int n;
  int64_t k;
  slot_chunk(b.a, blockIdx.x, &n, &k);
  if (k < 0) return;
  const RecArgs& a = b.a;
  const int h = blockIdx.y, c = threadIdx.x;
  const Seq s = seq_of(a, n);
  const float a0 = (a.a0 && c < a.K) ? a.a0[n * a.sa0[0] + h * a.sa0[1] + c] : 0.f;
  float carry = b.carry[(int64_t(blockIdx.x) * a.H + h) * b.Kp + c];
#pragma unroll 8
  for (int64_t i = chunk_end(s, k) - 1; i >= k * kBwdChunk; --i) {
    const int64_t e = ((s.row0 + i) * a.H + h) * b.Kp + c;
    const float gp = expf(load_gate(a.g_p, at(a.sgp, s.b, s.t0 + i, h), a.gate_dtype));
    const float abar = b.dA[e] + carry;
    b.dA[e] = abar;
    b.M[e] = gp * abar * (i > 0 ? b.A[e - int64_t(a.H) * b.Kp] : a0);
    carry = gp * abar;
  }
}

/// 8. Per (token row, key head), one warp: dg_p, dbeta_p, the statistics' term of dk, then dq and dk.
template <class Tin>
__global__ void __launch_bounds__(128) input_grad_kernel(const BwdArgs b) {
  const RecArgs& a = b.a;
  const int64_t w = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (w >= b.rows * a.H) return;
  const int lane = threadIdx.x % 32, h = int(w % a.H);
  const int64_t row = w / a.H, bb = row / a.T, t = row % a.T;
  const bool has_p = a.precond != kPrecondIdentity;
  const float bp = has_p ? load_gate(a.beta_p, at(a.sbp, bb, t, h), a.gate_dtype) : 0.f;
  const int64_t g0 = (row * a.HV + int64_t(h) * a.group) * b.Kp;
  float q[4], k[4], dqn[4], dkn[4], dgp = 0.f, dbp = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane + 32 * j;
    const bool ok = c < a.K;
    q[j] = ok ? to_float(static_cast<const Tin*>(a.q)[at(a.sq, bb, t, h, c)]) : 0.f;
    k[j] = ok ? to_float(static_cast<const Tin*>(a.k)[at(a.sk, bb, t, h, c)]) : 0.f;
    dqn[j] = ok ? b.dQ[g0 + c] : 0.f;
    dkn[j] = ok ? b.dKn[g0 + c] : 0.f;
    if (has_p && ok) {
      const int64_t e = w * b.Kp + c;
      const float abar = b.dA[e], kn = b.kn[e];
      dgp += b.M[e];
      dbp = fmaf(abar * kn, kn, dbp);
      dkn[j] = fmaf(2.f * bp * kn, abar, dkn[j]);
    }
  }
  if (has_p) {
    dgp = warp_sum(dgp);
    dbp = warp_sum(dbp);
    if (lane == 0 && b.dgp) store_gate(b.dgp, at(b.sdgp, bb, t, h), a.gate_dtype, dgp);
    if (lane == 0 && b.dbp) store_gate(b.dbp, at(b.sdbp, bb, t, h), a.gate_dtype, dbp);
  }
  float dq[4], dk[4];
  norm_grad(q, b.rq[w], dqn, a.scale, a.l2norm, dq);
  norm_grad(k, b.rk[w], dkn, 1.f, a.l2norm, dk);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane + 32 * j;
    if (c >= a.K) continue;
    if (b.dq) static_cast<Tin*>(b.dq)[at(b.sdq, bb, t, h, c)] = from_float<Tin>(dq[j]);
    if (b.dk) static_cast<Tin*>(b.dk)[at(b.sdk, bb, t, h, c)] = from_float<Tin>(dk[j]);
  }
}

/// dcenter[h]: the `count` per-token (or, chunkwise, per-chunk) terms summed in a fixed order
/// (strided per thread, then a tree).
__global__ void __launch_bounds__(256) center_grad_kernel(const BwdArgs b, int64_t count) {
  __shared__ float part[256];
  const int h = blockIdx.x, tid = threadIdx.x;
  float acc = 0.f;
  for (int64_t r = tid; r < count; r += 256) acc += b.dcen[r * b.a.H + h];
  part[tid] = acc;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (tid < w) part[tid] += part[tid + w];
    __syncthreads();
  }
  if (tid == 0) store_gate(b.dcenter, h, b.a.gate_dtype, part[0]);
}

}  // namespace
}  // namespace dgps::cuda::kernels
