/// @brief The chunkwise backward's key gradients (step 4 of launch/chunk_backward_launch.cuh): statistics, preconditioner, norm.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/backward.cuh"
#include "launch/chunk.cuh"
#include "kernels/chunk_bwd_tiles.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// The squash M (SPEC §2) and its slopes dM/dA, dM/dcenter at A, with the approximate instructions
/// (one log, one exp, two reciprocals, no branch); M = x and both slopes 0 where A + eps is not positive.
/// `k` holds the per-head constants (log x, log2 x, center, eps).
struct SquashConsts {
  float log_x, log2_x, center, eps;
};
__device__ __forceinline__ float squash_grad_fast(float A, const SquashConsts& k, float* dmda, float* dmdc) {
  constexpr float kLn2 = 0.69314718056f;
  const float ae = A + k.eps;
  const bool pos = ae > 0.f;
  const float r = fmaf(lg2_ftz(pos ? ae : 1.f), kLn2, -k.center), inv = rcp_ftz(1.f + fabsf(r));
  const float M = ex2_ftz(pos ? -k.log2_x * r * inv : k.log2_x);
  const float c = pos ? M * k.log_x * inv * inv : 0.f;
  *dmdc = c;
  *dmda = -c * rcp_ftz(pos ? ae : 1.f);
  return M;
}

/// Rows of a sub-chunk of the key-gradient kernels (their per-row values live in registers and
/// shared memory one sub-chunk at a time).
constexpr int kKeySub = 8;

/// Shared per-row inputs of the key-gradient kernels: e^{g_p}, beta_p, and the inverse norms of q, k.
struct KeyRows {
  float gp[C], bp[C], rq[C], rk[C];
};

/// Loads the chunk's per-row inputs (rows past L: e^{g_p} = 1, beta_p = 0) with threads 0 .. C - 1.
__device__ __forceinline__ void load_key_rows(KeyRows& s, const ChunkArgs& ca, const BwdArgs& bw, const ChunkPos& p,
                                              int h, int64_t row0) {
  const RecArgs& a = ca.a;
  const int i = threadIdx.x;
  if (i >= C) return;
  const bool ok = i < p.L, has_p = a.precond != kPrecondIdentity;
  const int64_t t = p.t0 + i;
  s.gp[i] = ok && has_p ? expf(load_gate(a.g_p, at3(a.sgp, p.b, t, h), a.gate_dtype)) : 1.f;
  s.bp[i] = ok && has_p ? load_gate(a.beta_p, at3(a.sbp, p.b, t, h), a.gate_dtype) : 0.f;
  s.rq[i] = ok ? bw.rq[(row0 + i) * a.H + h] : 0.f;
  s.rk[i] = ok ? bw.rk[(row0 + i) * a.H + h] : 0.f;
}

/// The per-head constants of the squash (center of key head h).
__device__ __forceinline__ SquashConsts squash_consts(const RecArgs& a, int h) {
  const float center = a.precond != kPrecondIdentity ? load_gate(a.center, h, a.gate_dtype) : 0.f;
  return {a.log_x, a.log_x * 1.44269504089f, center, a.eps};
}

/// Thread c's view of one chunk (channel c, key head h): the normalised keys and queries and the
/// sums over the group's value heads of the key-side gradients, a sub-chunk of rows at a time, and the
/// statistics A at the sub-chunks' starts. FULL: the chunk has C rows and c < K, so no load is masked.
/// Rows are reached by pointer steps (no per-load index arithmetic).
template <class Tin, bool FULL>
struct KeyChannel {
  const KeyRows& s;
  int L;
  bool ok;                      ///< c < K
  int group;                    ///< value heads per key head
  int Kp;                       ///< value-head stride of the gradient arrays
  const Tin *kp, *qp;           ///< channel c of the chunk's first row of k, q
  const float *gq, *gkn, *gkw;  ///< element (first row, first value head of the group, c) of dQ, dKn, dKW
  int64_t ks, qs, gs;           ///< row strides of k, q and the gradient arrays

  __device__ KeyChannel(const RecArgs& a, const BwdArgs& bw, const KeyRows& s_, const ChunkPos& p, int h, int c,
                        int64_t row0)
      : s(s_), L(p.L), ok(c < a.K), group(a.group), Kp(bw.Kp) {
    kp = static_cast<const Tin*>(a.k) + at3(a.sk, p.b, p.t0, h) + c;
    qp = static_cast<const Tin*>(a.q) + at3(a.sq, p.b, p.t0, h) + c;
    ks = a.sk[1], qs = a.sq[1], gs = int64_t(a.HV) * bw.Kp;
    const int64_t goff = (row0 * a.HV + int64_t(h) * a.group) * bw.Kp + c;
    gq = bw.dQ ? bw.dQ + goff : nullptr;
    gkn = bw.dKn ? bw.dKn + goff : nullptr;
    gkw = bw.dKW ? bw.dKW + goff : nullptr;
  }
  __device__ __forceinline__ bool live(int i) const { return FULL || (ok && i < L); }
  /// Rows i0 .. i0 + kKeySub - 1 of channel c of a 16-bit or float input (0 where not live).
  __device__ __forceinline__ void rows(const Tin* base, int64_t stride, int i0, float* x) const {
    const Tin* ptr = base + i0 * stride;
#pragma unroll
    for (int u = 0; u < kKeySub; ++u, ptr += stride) x[u] = live(i0 + u) ? to_float(*ptr) : 0.f;
  }
  /// Normalised keys (queries times scale) of the sub-chunk's rows i0 .. i0 + kKeySub - 1 (0 past L),
  /// all loads issued before any is used.
  __device__ __forceinline__ void keys(int i0, float* x) const {
    rows(kp, ks, i0, x);
#pragma unroll
    for (int u = 0; u < kKeySub; ++u) x[u] *= s.rk[i0 + u];  // 0 past L
  }
  __device__ __forceinline__ void queries(int i0, float scale, float* x) const {
    rows(qp, qs, i0, x);
#pragma unroll
    for (int u = 0; u < kKeySub; ++u) x[u] *= s.rq[i0 + u] * scale;
  }
  /// Sums over the group's value heads (fixed order) of a [rows, HV, Kp] gradient for the sub-chunk.
  __device__ __forceinline__ void group_sums(const float* base, int i0, float* x) const {
    const float* ptr = base + i0 * gs;
#pragma unroll
    for (int u = 0; u < kKeySub; ++u) x[u] = live(i0 + u) ? ptr[u * gs] : 0.f;
    for (int g = 1; g < group; ++g)
#pragma unroll
      for (int u = 0; u < kKeySub; ++u) x[u] += live(i0 + u) ? ptr[u * gs + g * Kp] : 0.f;
  }
  /// The statistics before each sub-chunk, from the chunk's entry value (SPEC §2).
  __device__ __forceinline__ void stats_starts(float A, float* start) const {
#pragma unroll
    for (int sb = 0; sb < C / kKeySub; ++sb) {
      start[sb] = A;
      float k[kKeySub];
      keys(sb * kKeySub, k);
#pragma unroll
      for (int u = 0; u < kKeySub; ++u) A = fmaf(s.gp[sb * kKeySub + u], A, s.bp[sb * kKeySub + u] * k[u] * k[u]);
    }
  }
};

/// Whether rows at p (row stride `stride` elements) allow 4-channel vector accesses (null: no rows).
template <class Tin>
__device__ __forceinline__ bool vec4_ok(const void* p, int64_t stride) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(Tin)) == 0 && stride % 4 == 0);
}

/// Calls f(full) with full a compile-time constant (std::bool_constant): true when the chunk has C
/// rows, every thread's channel is below K and the rows of q, k, dq, dk allow 4-channel vector
/// accesses (no masked loads).
template <class Tin, class F>
__device__ __forceinline__ void with_key_chunk(const BwdArgs& bw, const ChunkPos& p, int h, F&& f) {
  const RecArgs& a = bw.a;
  const bool full =
      p.L == C && a.K == KP && vec4_ok<Tin>(static_cast<const Tin*>(a.q) + at3(a.sq, p.b, p.t0, h), a.sq[1]) &&
      vec4_ok<Tin>(static_cast<const Tin*>(a.k) + at3(a.sk, p.b, p.t0, h), a.sk[1]) &&
      vec4_ok<Tin>(bw.dq ? static_cast<const Tin*>(bw.dq) + at3(bw.sdq, p.b, p.t0, h) : nullptr, bw.sdq[1]) &&
      vec4_ok<Tin>(bw.dk ? static_cast<const Tin*>(bw.dk) + at3(bw.sdk, p.b, p.t0, h) : nullptr, bw.sdk[1]);
  if (full)
    f(std::true_type{});
  else
    f(std::false_type{});
}

/// 4 consecutive elements of a row to float and back (16-bit: one 8-byte access; float: 16 bytes),
/// through bit operations so the values stay in registers.
__device__ __forceinline__ float lo16_to_float(uint32_t w, __nv_bfloat16*) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi16_to_float(uint32_t w, __nv_bfloat16*) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float lo16_to_float(uint32_t w, __half*) {
  return __half2float(__ushort_as_half(w & 0xffffu));
}
__device__ __forceinline__ float hi16_to_float(uint32_t w, __half*) { return __half2float(__ushort_as_half(w >> 16)); }
__device__ __forceinline__ uint32_t bits16(float x, __nv_bfloat16*) {
  return __bfloat16_as_ushort(__float2bfloat16(x));
}
__device__ __forceinline__ uint32_t bits16(float x, __half*) { return __half_as_ushort(__float2half(x)); }
__device__ __forceinline__ void load4(const float* p, float* x) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
template <class T>
__device__ __forceinline__ void load4(const T* p, float* x) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = lo16_to_float(v.x, static_cast<T*>(nullptr)), x[1] = hi16_to_float(v.x, static_cast<T*>(nullptr));
  x[2] = lo16_to_float(v.y, static_cast<T*>(nullptr)), x[3] = hi16_to_float(v.y, static_cast<T*>(nullptr));
}
__device__ __forceinline__ void store4(float* p, const float* x) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
template <class T>
__device__ __forceinline__ void store4(T* p, const float* x) {
  constexpr T* tag = nullptr;
  *reinterpret_cast<uint2*>(p) =
      make_uint2(bits16(x[0], tag) | bits16(x[1], tag) << 16, bits16(x[2], tag) | bits16(x[3], tag) << 16);
}

/// Key gradients with a diagonal preconditioner, 1 of 3 (per chunk, key head; thread = channel): the
/// chunk's reverse scan of dA (through A_t = e^{g_p,t} A_{t-1} + beta_p,t kn_t^2) from a zero carry,
/// as (decay product, value at the chunk's start).
template <class Tin, bool ATK>
__global__ void __launch_bounds__(kThreads) key_local_kernel(const ChunkArgs ca, const BwdArgs bw) {
  const RecArgs& a = ca.a;
  __shared__ KeyRows s;
  const int64_t gc = blockIdx.x;
  const int h = blockIdx.y, c = threadIdx.x;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) return;
  const int64_t row0 = a.cu_seqlens ? p.t0 : p.b * a.T + p.t0;
  load_key_rows(s, ca, bw, p, h, row0);
  __syncthreads();
  const SquashConsts sq = squash_consts(a, h);
  const float Ain = c < a.K ? ca.Ain[(gc * a.H + h) * KP + c] : 0.f;
  float P = 1.f, carry = 0.f;
  with_key_chunk<Tin>(bw, p, h, [&](auto full) {
    const KeyChannel<Tin, decltype(full)::value> kc(a, bw, s, p, h, c, row0);
    float start[C / kKeySub];
    kc.stats_starts(Ain, start);
#pragma unroll 1
    for (int sb = C / kKeySub - 1; sb >= 0; --sb) {
      const int i0 = sb * kKeySub;
      float k[kKeySub], x[kKeySub], dl[kKeySub];
      kc.keys(i0, k);
      if constexpr (ATK) {
        kc.group_sums(kc.gkw, i0, x);  // dM = dkw kn
#pragma unroll
        for (int u = 0; u < kKeySub; ++u) x[u] *= k[u];
      } else {
        float q[kKeySub];
        kc.group_sums(kc.gq, i0, x);  // dM = dqr qn
        kc.queries(i0, a.scale, q);
#pragma unroll
        for (int u = 0; u < kKeySub; ++u) x[u] *= q[u];
      }
      float A = start[sb];
#pragma unroll
      for (int u = 0; u < kKeySub; ++u) {
        const int i = i0 + u;
        A = fmaf(s.gp[i], A, s.bp[i] * k[u] * k[u]);
        float dmda, dmdc;
        squash_grad_fast(A, sq, &dmda, &dmdc);
        dl[u] = x[u] * dmda;  // x = 0 where not live
      }
#pragma unroll
      for (int u = kKeySub - 1; u >= 0; --u) {
        const float gp = s.gp[i0 + u];  // 1 past L
        carry = gp * (dl[u] + carry);
        P *= gp;
      }
    }
  });
  if (c < bw.Kp) bw.sums[(gc * a.H + h) * bw.Kp + c] = make_float2(P, carry);
}

/// Key gradients, 2 of 3 (per sequence, key head; thread = channel): the carry of dA entering each
/// chunk from its future (daT at the end), in reverse chunk order, and da0.
__global__ void key_carry_kernel(const ChunkArgs ca, const BwdArgs bw) {
  const int h = blockIdx.x, n = blockIdx.y;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  stats_reverse_carry(bw, n, h, threadIdx.x, first, count);
}

/// Warp sums of N values held by every lane, by recursive halving: N - 1 + log2(32 / N) shuffles
/// instead of 5 N. On return, lane l holds the sum of value (l / (32 / N)) in x[0].
template <int N>
__device__ __forceinline__ void warp_sums_scatter(float* x, int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two up to 32");
#pragma unroll
  for (int half = N / 2, bit = 16; half >= 1; half /= 2, bit /= 2) {
    // Lanes with `bit` clear keep values 0 .. half - 1, the others half .. 2 half - 1.
    const bool upper = lane & bit;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float send = upper ? x[j] : x[j + half];
      const float keep = upper ? x[j + half] : x[j];
      x[j] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
  }
  // Each lane now holds one value, summed over the lanes that share its high log2(N) bits.
#pragma unroll
  for (int bit = 16 / N; bit >= 1; bit /= 2) x[0] += __shfl_xor_sync(0xffffffffu, x[0], bit);
}

/// One sub-chunk's per-channel values of key_apply, handed from the channel phase to the row phase.
struct KeyApplyRows {
  static constexpr int LD = KP + 4;  // rows 16-byte aligned for 4-channel reads, conflict-free writes
  alignas(16) float dk[kKeySub][LD], dq[kKeySub][LD], tg[kKeySub][LD], tb[kKeySub][LD];
};

/// Key gradients, 3 of 3 (per chunk, key head): the group's key-side gradients summed, chained
/// through the preconditioner's M (dkn += dkw M for ATK, dqn = dqr M for ATQ), the scanned dA with
/// the carry from the chunk's future, its terms of dk, dg_p, dbeta_p and dcenter, and the L2 norm's
/// backward to dq, dk. Also runs without a preconditioner (GVA: the group sums and the norm).
/// Sub-chunk by sub-chunk from the last: threads own channels for the scan, then warps own rows for
/// the row sums (fixed order) and the norm. This is the body for one chunk; FULL: no masked rows or
/// channels (with_key_chunk), PK: the preconditioner.
template <class Tin, bool FULL, int PK>
__device__ __forceinline__ void key_apply_chunk(const ChunkArgs& ca, const BwdArgs& bw, const KeyRows& s,
                                                KeyApplyRows& sr, const ChunkPos& p, int h, int64_t row0,
                                                float* s_part) {
  const RecArgs& a = ca.a;
  auto& sDk = sr.dk;
  auto& sDq = sr.dq;
  auto& sTg = sr.tg;
  auto& sTb = sr.tb;
  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;
  const KeyChannel<Tin, FULL> kc(a, bw, s, p, h, c, row0);
  constexpr bool has_p = PK != kPrecondIdentity, atk = PK == kPrecondATK;
  const SquashConsts sq = squash_consts(a, h);
  const int64_t gc = blockIdx.x;
  float start[C / kKeySub];
  if (has_p) kc.stats_starts(kc.ok ? ca.Ain[(gc * a.H + h) * KP + c] : 0.f, start);
  float carry = has_p && c < bw.Kp ? bw.carry[(gc * a.H + h) * bw.Kp + c] : 0.f, dcen = 0.f;
  // Rows of the norm phase: warp w owns rows 2w, 2w + 1 of each sub-chunk; lane owns channels
  // 4 lane .. 4 lane + 3 (FULL: one vector access each) or lane + 32 j.
  constexpr int RPW = kKeySub / 4;
  auto ch = [&](int j) { return FULL ? 4 * lane + j : lane + 32 * j; };
  const int cl = FULL ? 4 * lane : lane;
  const Tin* qrow = static_cast<const Tin*>(a.q) + at3(a.sq, p.b, p.t0, h) + cl;
  const Tin* krow = static_cast<const Tin*>(a.k) + at3(a.sk, p.b, p.t0, h) + cl;
  Tin* dqrow = bw.dq ? static_cast<Tin*>(bw.dq) + at3(bw.sdq, p.b, p.t0, h) + cl : nullptr;
  Tin* dkrow = bw.dk ? static_cast<Tin*>(bw.dk) + at3(bw.sdk, p.b, p.t0, h) + cl : nullptr;
#pragma unroll 1
  for (int sb = C / kKeySub - 1; sb >= 0; --sb) {
    const int i0 = sb * kKeySub;
    // Channel c, forward over the sub-chunk: the group sums, A_i, M_i and the local dA.
    float k[kKeySub], dkw[kKeySub], dkn[kKeySub], dq[kKeySub], dl[kKeySub], Ai[kKeySub];
    kc.group_sums(kc.gkw, i0, dkw);
    kc.group_sums(kc.gkn, i0, dkn);
    kc.group_sums(kc.gq, i0, dq);
    if constexpr (has_p) kc.keys(i0, k);
    float q[kKeySub];
    if constexpr (has_p && !atk) kc.queries(i0, a.scale, q);
    float A = has_p ? start[sb] : 0.f;
#pragma unroll
    for (int u = 0; u < kKeySub; ++u) {
      const int i = i0 + u;
      dl[u] = Ai[u] = 0.f;
      if constexpr (has_p) {
        A = fmaf(s.gp[i], A, s.bp[i] * k[u] * k[u]);
        float dmda, dmdc;
        const float M = squash_grad_fast(A, sq, &dmda, &dmdc);
        const float dM = atk ? dkw[u] * k[u] : dq[u] * q[u];  // 0 where not live
        if constexpr (atk)
          dkn[u] = fmaf(dkw[u], M, dkn[u]);
        else
          dkn[u] += dkw[u], dq[u] *= M;
        dl[u] = dM * dmda;
        dcen = fmaf(dM, dmdc, dcen);
        Ai[u] = A;
      } else {
        dkn[u] += dkw[u];
      }
    }
    // Channel c, backward over the sub-chunk: the scanned dA and its terms.
#pragma unroll
    for (int w = 0; w < kKeySub; ++w) {
      const int u = kKeySub - 1 - w, i = i0 + u;
      float tg = 0.f, tb = 0.f;
      if (has_p && (FULL || i < p.L)) {
        const float abar = dl[u] + carry, Aprev = u > 0 ? Ai[u - 1] : start[sb];
        tg = s.gp[i] * abar * Aprev;
        tb = abar * k[u] * k[u];
        dkn[u] = fmaf(2.f * s.bp[i] * k[u], abar, dkn[u]);
        carry = s.gp[i] * abar;
      }
      sDk[u][c] = dkn[u];
      sDq[u][c] = dq[u];
      sTg[u][c] = tg;
      sTb[u][c] = tb;
    }
    __syncthreads();
    // Warp w, rows 2w, 2w + 1 of the sub-chunk: dg_p, dbeta_p, then the norm's backward to dq, dk.
    float qr[RPW][4], kr[RPW][4];
    float sums[4 * RPW];  // per row v: tg, tb, x̂q·dqn, x̂k·dkn
#pragma unroll
    for (int v = 0; v < RPW; ++v) {  // raw q, k rows: every load first
      const int i = i0 + warp * RPW + v;
      if constexpr (FULL) {
        load4(qrow + i * a.sq[1], qr[v]);
        load4(krow + i * a.sk[1], kr[v]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const bool live = ch(j) < a.K && i < p.L;
          qr[v][j] = live ? to_float(qrow[i * a.sq[1] + 32 * j]) : 0.f;
          kr[v][j] = live ? to_float(krow[i * a.sk[1] + 32 * j]) : 0.f;
        }
      }
    }
#pragma unroll
    for (int v = 0; v < RPW; ++v) {
      const int u = warp * RPW + v, i = i0 + u;
      float dqn[4], dknr[4], tg[4], tb[4];
      if constexpr (FULL) {
        load4(&sDq[u][cl], dqn);
        load4(&sDk[u][cl], dknr);
        load4(&sTg[u][cl], tg);
        load4(&sTb[u][cl], tb);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          dqn[j] = sDq[u][ch(j)], dknr[j] = sDk[u][ch(j)], tg[j] = sTg[u][ch(j)], tb[j] = sTb[u][ch(j)];
      }
      float dotq = 0.f, dotk = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dotq = fmaf(qr[v][j] * s.rq[i], dqn[j], dotq);
        dotk = fmaf(kr[v][j] * s.rk[i], dknr[j], dotk);
      }
      sums[4 * v] = (tg[0] + tg[1]) + (tg[2] + tg[3]), sums[4 * v + 1] = (tb[0] + tb[1]) + (tb[2] + tb[3]);
      sums[4 * v + 2] = dotq, sums[4 * v + 3] = dotk;
    }
    // One reduction for the 4 RPW sums: lane l ends with sum l / (32 / (4 RPW)).
    warp_sums_scatter<4 * RPW>(sums, lane);
    constexpr int LPV = 32 / (4 * RPW);  // lanes holding each sum
#pragma unroll
    for (int v = 0; v < RPW; ++v) {
      const int u = warp * RPW + v, i = i0 + u;
      if (!FULL && i >= p.L) continue;
      const int64_t t = p.t0 + i;
      if (has_p && lane == (4 * v) * LPV && bw.dgp) store_gate(bw.dgp, at3(bw.sdgp, p.b, t, h), a.gate_dtype, sums[0]);
      if (has_p && lane == (4 * v + 1) * LPV && bw.dbp)
        store_gate(bw.dbp, at3(bw.sdbp, p.b, t, h), a.gate_dtype, sums[0]);
      const float dotq = a.l2norm ? __shfl_sync(0xffffffffu, sums[0], (4 * v + 2) * LPV) : 0.f;
      const float dotk = a.l2norm ? __shfl_sync(0xffffffffu, sums[0], (4 * v + 3) * LPV) : 0.f;
      const float rq = s.rq[i], rk = s.rk[i];
      float dqn[4], dknr[4], dqo[4], dko[4];  // read again: fewer registers live across the reduction
      if constexpr (FULL) {
        load4(&sDq[u][cl], dqn);
        load4(&sDk[u][cl], dknr);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) dqn[j] = sDq[u][ch(j)], dknr[j] = sDk[u][ch(j)];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // x̂ = x rstd, y = mul x̂: dx = mul rstd (dy - x̂ (x̂·dy)), or mul dy without the norm.
        dqo[j] = a.l2norm ? a.scale * rq * (dqn[j] - qr[v][j] * rq * dotq) : a.scale * dqn[j];
        dko[j] = a.l2norm ? rk * (dknr[j] - kr[v][j] * rk * dotk) : dknr[j];
      }
      if constexpr (FULL) {
        if (dqrow) store4(dqrow + i * bw.sdq[1], dqo);
        if (dkrow) store4(dkrow + i * bw.sdk[1], dko);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (ch(j) >= a.K) continue;
          if (dqrow) dqrow[i * bw.sdq[1] + 32 * j] = from_float<Tin>(dqo[j]);
          if (dkrow) dkrow[i * bw.sdk[1] + 32 * j] = from_float<Tin>(dko[j]);
        }
      }
    }
    __syncthreads();
  }
  s_part[c] = dcen;
}

/// Blocks of key_apply_kernel per SM the compiler budgets registers for (96 registers each; 6 blocks
/// leave 80, and the kernel spills).
constexpr int kKeyApplyBlocks = 5;

/// Key gradients, 3 of 3: one block per (chunk, key head), thread = channel (key_apply_chunk), and
/// the chunk's part of dcenter.
template <class Tin, int PK>
__global__ void __launch_bounds__(kThreads, kKeyApplyBlocks) key_apply_kernel(const ChunkArgs ca, const BwdArgs bw) {
  const RecArgs& a = ca.a;
  __shared__ KeyRows s;
  __shared__ KeyApplyRows sr;
  __shared__ float s_red[kThreads];
  const int64_t gc = blockIdx.x;
  const int h = blockIdx.y, c = threadIdx.x;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) {  // a slot past the packed batch: a zero part of dcenter
    if (c == 0 && bw.dcen) bw.dcen[gc * a.H + h] = 0.f;
    return;
  }
  const int64_t row0 = a.cu_seqlens ? p.t0 : p.b * a.T + p.t0;
  load_key_rows(s, ca, bw, p, h, row0);
  __syncthreads();
  with_key_chunk<Tin>(
      bw, p, h, [&](auto full) { key_apply_chunk<Tin, decltype(full)::value, PK>(ca, bw, s, sr, p, h, row0, s_red); });
  if (PK != kPrecondIdentity) {  // this chunk's part of dcenter (center_grad_kernel sums the chunks' parts)
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
      if (c < w) s_red[c] += s_red[c + w];
      __syncthreads();
    }
    if (c == 0) bw.dcen[gc * a.H + h] = s_red[0];
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
