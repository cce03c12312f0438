/// @brief The intra-chunk kernel's Diagonal decay (SPEC §4): gamma's rows, outer factors, Akk and P per 16-row block.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/chunk.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Loads 16 channels (8 at c0, 8 at c0 + 64) of a row of 16-bit operands as floats.
template <class Op>
__device__ __forceinline__ void load16(float* x, const Op* row, int c0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    alignas(16) Op v[8];
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(row + c0 + 64 * h);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[8 * h + j] = to_float(v[j]);
  }
}
__device__ __forceinline__ void load16(float* x, const float* row, int c0) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 8; j += 4)
      *reinterpret_cast<float4*>(x + 8 * h + j) = *reinterpret_cast<const float4*>(row + c0 + 64 * h + j);
}

/// Largest spread of gamma over a 16-row block for which the diagonal block also runs on tensor
/// cores: its products then carry a factor up to e^spread (bf16 reaches e^88, f16 e^11).
template <class Op>
constexpr float kDiagSpread = std::is_same_v<Op, __half> ? 9.f : 60.f;

/// The lean Diagonal-decay layout (intra_kernel with raw_v): the chunk's per-channel gamma kept only at
/// each 16-row block's first and last rows (`Gb` [8][KP]: rows 16a, 16a + 15 as rows 2a, 2a + 1); the
/// rows between are summed again from the chunk's gates, in the scan's order (so bit for bit the same).
struct GateRows {
  const void* g = nullptr;  ///< the gate of the chunk's first token, channel 0, this value head
  int64_t rs = 0;           ///< token stride of the gates
  int dtype = 0, L = 0, K = 0;
  /// Gate of row r (in the chunk), channel c; 0 past L rows and past K channels (as in the scan).
  __device__ __forceinline__ float at(int r, int c) const {
    return r < L && c < K ? load_gate(g, r * rs + c, dtype) : 0.f;
  }
};

/// Row of the lean layout's gamma (`Gb` [8][KP]) that holds chunk row r, r % 16 in {0, 15}.
__device__ __forceinline__ int gamma_block_row(int r) { return r / 16 * 2 + (r % 16 != 0); }

/// Row r's per-channel gamma: G's row, or in the lean layout (LEAN) its copy in Gb, r % 16 in {0, 15}.
/// (The layout is a compile-time choice: testing a shared pointer for null at run time makes every
/// read of it a generic load.)
template <bool LEAN>
__device__ __forceinline__ const float* gamma_row(const float* G, const float* Gb, int r) {
  if constexpr (LEAN) return Gb + gamma_block_row(r) * KP;
  return G + r * LDG;
}

/// The outer factors of one row's N (4 or 8) channels at element offset `at` of the key tiles (packed
/// multiplies): K's and Q's by e^(g - ga), KW's by e^(gz - g) into KWh; g the row's gamma of those
/// channels, ga and gz its block's first and last rows'.
template <class Op, int N>
__device__ __forceinline__ void scale_outer(Op* sK, Op* sQ, const Op* sKW, Op* sKWh, int at, const float* g,
                                            const float* ga, const float* gz) {
  using V = std::conditional_t<N == 8, uint4, uint2>;
  V xk = *reinterpret_cast<const V*>(sK + at);
  V xq = *reinterpret_cast<const V*>(sQ + at);
  V xw = *reinterpret_cast<const V*>(sKW + at);
  uint32_t* pk = reinterpret_cast<uint32_t*>(&xk);
  uint32_t* pq = reinterpret_cast<uint32_t*>(&xq);
  uint32_t* pw = reinterpret_cast<uint32_t*>(&xw);
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const float g0 = g[j], g1 = g[j + 1];
    const uint32_t fa = pack2<Op>(__expf(g0 - ga[j]), __expf(g1 - ga[j + 1]));
    const uint32_t fz = pack2<Op>(__expf(gz[j] - g0), __expf(gz[j + 1] - g1));
    pk[j / 2] = mul2<Op>(pk[j / 2], fa);
    pq[j / 2] = mul2<Op>(pq[j / 2], fa);
    pw[j / 2] = mul2<Op>(pw[j / 2], fz);
  }
  *reinterpret_cast<V*>(sK + at) = xk;
  *reinterpret_cast<V*>(sQ + at) = xq;
  *reinterpret_cast<V*>(sKWh + at) = xw;
}

/// Diagonal decay (SPEC §4), warp w owns the 16-row block a = w (rows m0 = 16w ..): rows m0 .. m0 + 15
/// of Akk = Diag(beta) Bm (Bm Diag(beta) in backward mode) and of P, with e^(gamma_i - gamma_j) per
/// channel formed from differences in the exponent so that strong decays stay finite:
///   e^(gamma_i - gamma_j) = e^(gamma_i - gamma_16a) e^(gamma_16a - gamma_16b+15) e^(gamma_16b+15 - gamma_j)
/// for row i in block a and column j in block b. The outer factors go into the tiles once, in place
/// (K and Q rows of block a: e^(gamma_i - gamma_16a) <= 1; KW rows into `sKWh`: e^(gamma_16b+15 -
/// gamma_j) <= 1); the middle one, per channel, scales the A fragments on the way to the tensor cores
/// (<= 1 for b < a). The diagonal block (b = a, middle factor up to e^spread) joins them when gamma
/// spreads over it by at most kDiagSpread; otherwise it is summed elementwise from the raw tiles first
/// (lanes: 4 row groups x 8 channel groups of 16 channels). Writes P's rows to `sPst` (staging,
/// [C][LDC]), Akk's diagonal block to sAd and the blocks left of it to sAh, zeros above the diagonal.
/// Leaves the block's K, Q rows scaled as above (the caller rescales them by e^gamma_16a). Contains a
/// __syncthreads: every thread of the block calls it. Lean layout (LEAN, `Gb`, see GateRows): gamma's
/// rows between the blocks' first and last come from `gr`, and P goes straight from the accumulators to
/// the workspace tile `Pg` (blocked layout) instead of `sPst`.
template <class Op, bool LEAN>
__device__ __forceinline__ void diag_decay_akk_p(Op* sQ, Op* sK, const Op* sKW, Op* sKWh, const float* G,
                                                 const float* s_beta, bool online, bool bwd, int m0, Op* sPst,
                                                 float* sAd, __half* sAh, const float* Gb, const GateRows& gr,
                                                 Op* Pg) {
  const int lane = threadIdx.x & 31, w = m0 / 16;
  constexpr bool lean = LEAN;
  auto p_at = [&](int i, int j) { return lean ? Pg + blocked_at(i, j & ~7) + (j & 7) : sPst + i * LDC + j; };
  const float* gA = gamma_row<LEAN>(G, Gb, m0);  // gamma_16a
  const float* gZ = gamma_row<LEAN>(G, Gb, m0 + 15);  // gamma_16a+15
  float spread = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) spread = fmaxf(spread, gA[4 * lane + u] - gZ[4 * lane + u]);
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) spread = fmaxf(spread, __shfl_xor_sync(0xffffffffu, spread, d));
  const bool fast = spread <= kDiagSpread<Op>;
  if (!fast) {  // the diagonal block elementwise: lane = (row group rg, channel group cg); rows rg, rg + 4, ...
    const int rg = lane >> 3, cg = lane & 7, c0 = cg * 8;
    const unsigned mask = 0xffu << (8 * rg);
    // Lean layout: gamma of row m0 + n from row m0's by adding the gates of rows m0 + 1 .. m0 + n.
    auto add_rows = [&](float* x, int from, int to) {
      for (int t = from; t <= to; ++t)
#pragma unroll
        for (int c = 0; c < 16; ++c) x[c] += gr.at(t, c0 + c % 8 + (c / 8) * 64);
    };
    for (int ii = rg; ii < 16; ii += 4) {
      const int i = m0 + ii;
      float qi[16], ki[16], gi[16], gj[16];
      load16(qi, sQ + i * LDK, c0);
      load16(ki, sK + i * LDK, c0);
      if (lean) {
        load16(gi, gA, c0);
        add_rows(gi, m0 + 1, i);
        load16(gj, gA, c0);
      } else {
        load16(gi, G + i * LDG, c0);
      }
      for (int jj = 0; jj <= ii; ++jj) {
        const int j = m0 + jj;
        float kw[16];
        load16(kw, sKW + j * LDK, c0);
        if (!lean)
          load16(gj, G + j * LDG, c0);
        else if (jj > 0)
          add_rows(gj, j, j);
        float sa = 0.f, sp = 0.f;
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float x = kw[c] * __expf(gi[c] - gj[c]);
          sa += ki[c] * x, sp += qi[c] * x;
        }
#pragma unroll
        for (int d = 1; d < 8; d <<= 1) {
          sa += __shfl_xor_sync(mask, sa, d);
          sp += __shfl_xor_sync(mask, sp, d);
        }
        if (cg == 0) {
          *p_at(i, j) = from_float<Op>(sp);
          if (online) sAd[w * 272 + ii * 17 + jj] = jj < ii ? s_beta[bwd ? j : i] * sa : 0.f;
        }
      }
    }
    for (int e = lane; e < 256; e += 32) {  // zeros above the diagonal
      const int ii = e / 16, jj = e % 16;
      if (jj <= ii) continue;
      *p_at(m0 + ii, m0 + jj) = from_float<Op>(0.f);
      if (online) sAd[w * 272 + ii * 17 + jj] = 0.f;
    }
    __syncwarp();
  }
  // The outer factors into this block's rows: lane l scales channels 8 (l % 16) .. + 7 of rows
  // m0 + l / 16, + 2, ... (packed multiplies). Lean layout: lane l scales channels 4 l .. + 3 of every
  // row of the block in order, summing gamma from row m0's as it goes.
  // The gates of the block's 15 later rows are all loaded before the first is added (one memory round
  // trip instead of one per few rows: they come from L2, and the warp has nothing else to do meanwhile).
  auto lean_outer = [&](auto type) {  // the gate's element type chosen once, as in the scan
    using GT = decltype(type);
    const GT* gp = static_cast<const GT*>(gr.g);
    const int c4 = 4 * lane;
    GT d[15][4];
#pragma unroll
    for (int u = 0; u < 15; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = m0 + 1 + u;
        d[u][j] = r < gr.L && c4 + j < gr.K ? gp[r * gr.rs + c4 + j] : GT(0.f);
      }
    float ga[4], gz[4], g[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) ga[j] = gA[c4 + j], gz[j] = gZ[c4 + j], g[j] = ga[j];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      if (u > 0)
#pragma unroll
        for (int j = 0; j < 4; ++j) g[j] += to_float(d[u - 1][j]);
      scale_outer<Op, 4>(sK, sQ, sKW, sKWh, (m0 + u) * LDK + c4, g, ga, gz);
    }
  };
  if (lean) {
    if (gr.dtype == 1)
      lean_outer(__nv_bfloat16{});
    else if (gr.dtype == 2)
      lean_outer(__half{});
    else
      lean_outer(float{});
  }
  const int c8 = (lane % 16) * 8;
  float ga[8], gz[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) ga[j] = gA[c8 + j], gz[j] = gZ[c8 + j];
#pragma unroll 2
  for (int r = m0 + lane / 16; r < (lean ? m0 : m0 + 16); r += 2) {
    scale_outer<Op, 8>(sK, sQ, sKW, sKWh, r * LDK + c8, G + r * LDG + c8, ga, gz);
  }
  __syncthreads();  // every block's KW rows are scaled
  float accA[8][4], accP[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) accA[i][e] = accP[i][e] = 0.f;
  const int nb = fast ? w + 1 : w;  // column blocks on tensor cores
#pragma unroll 1
  for (int k0 = 0; k0 < KP; k0 += 16) {
    uint32_t fk[4], fq[4];
    load_a(fk, sK, LDK, m0, k0);
    load_a(fq, sQ, LDK, m0, k0);
    const int c0 = k0 + 2 * (lane & 3);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b >= nb) break;
      const float* gB = gamma_row<LEAN>(G, Gb, 16 * b + 15);  // gamma_16b+15
      const uint32_t f0 = pack2<Op>(__expf(gA[c0] - gB[c0]), __expf(gA[c0 + 1] - gB[c0 + 1]));
      const uint32_t f1 = pack2<Op>(__expf(gA[c0 + 8] - gB[c0 + 8]), __expf(gA[c0 + 9] - gB[c0 + 9]));
      // A fragment registers 0, 1 hold columns c0, c0 + 1; registers 2, 3 columns c0 + 8, c0 + 9.
      const uint32_t sk[4] = {mul2<Op>(fk[0], f0), mul2<Op>(fk[1], f0), mul2<Op>(fk[2], f1), mul2<Op>(fk[3], f1)};
      const uint32_t sq[4] = {mul2<Op>(fq[0], f0), mul2<Op>(fq[1], f0), mul2<Op>(fq[2], f1), mul2<Op>(fq[3], f1)};
      uint32_t fb[4];
      load_b(fb, sKWh, LDK, 16 * b, k0);
      if (online) {
        mma<Op>(accA[2 * b], sk, fb);
        mma<Op>(accA[2 * b + 1], sk, fb + 2);
      }
      mma<Op>(accP[2 * b], sq, fb);
      mma<Op>(accP[2 * b + 1], sq, fb + 2);
    }
  }
  // Column block nt / 2 against this warp's row block w (uniform over the warp): left of it no mask,
  // the diagonal block masked (or summed elementwise above), right of it zero.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int bj = nt / 2;
    if (bj == w && !fast) continue;  // summed elementwise above
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = acc_row(m0, e), j = acc_col(nt * 8, e);
      if (bj > w) {
        store2(p_at(i, j), 0.f, 0.f);
        continue;
      }
      const bool dblock = bj == w;
      store2(p_at(i, j), !dblock || j <= i ? accP[nt][e] : 0.f, !dblock || j + 1 <= i ? accP[nt][e + 1] : 0.f);
      if (!online) continue;
      float x0 = s_beta[bwd ? j : i] * accA[nt][e], x1 = s_beta[bwd ? j + 1 : i] * accA[nt][e + 1];
      if (dblock) {
        x0 = j < i ? x0 : 0.f, x1 = j + 1 < i ? x1 : 0.f;
        sAd[w * 272 + (i % 16) * 17 + j % 16] = x0;
        sAd[w * 272 + (i % 16) * 17 + j % 16 + 1] = x1;
      } else {
        *reinterpret_cast<__half2*>(sAh + i * LDC + j) = __floats2half2_rn(x0, x1);
      }
    }
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
