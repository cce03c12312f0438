/// @brief The chunkwise backward's gradient kernel (launch/chunk_backward_launch.cuh, step 3): key-side gradients per chunk.
#pragma once

#include <cstdint>

#include "launch/backward.cuh"
#include "launch/chunk.cuh"
#include "kernels/chunk_bwd_tiles.cuh"
#include "kernels/diag_decay.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Sum over the 4 lanes of a quad (the lanes holding one accumulator row), in a fixed order.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// beta kw rounded to Op as scale_rows rounds the Diag(beta) KW tile (bitwise the same value).
template <class Op>
__device__ __forceinline__ float rounded_kwb(float beta, Op kw) {
  return to_float(from_float<Op>(to_float(kw) * beta));
}

/// Warps of the gradient kernel: 4 row blocks of 16 rows times kGradGroups column groups.
constexpr int kGradWarps = 16, kGradGroups = kGradWarps / 4, kGradThreads = 32 * kGradWarps;

/// Sum of x[0 .. kGradThreads) in shared memory by a fixed tree (all threads; x is overwritten).
__device__ __forceinline__ float block_sum(float* x) {
  for (int w = kGradThreads / 2; w > 0; w >>= 1) {
    __syncthreads();
    if (int(threadIdx.x) < w) x[threadIdx.x] += x[threadIdx.x + w];
  }
  __syncthreads();
  return x[0];
}

/// Diagonal decay, gradient kernel: the chunk's per-channel gamma [C][LDG] (thread = (16-row block,
/// channel); g = 0 past L and past K, so row C - 1 holds gamma_C). Ends with a barrier.
__device__ __forceinline__ void diag_grad_gamma(const ChunkArgs& ca, const ChunkPos& p, int hv, float* sG) {
  const RecArgs& a = ca.a;
  const int c = threadIdx.x % KP, q = threadIdx.x / KP;
  const int64_t g0 = p.b * a.sg[0] + (p.t0 + 16 * q) * a.sg[1] + hv * a.sg[2] + c;
  float gv[16];
#pragma unroll
  for (int u = 0; u < 16; ++u)
    gv[u] = (c < a.K && 16 * q + u < p.L) ? load_gate(a.g, g0 + u * a.sg[1], a.gate_dtype) : 0.f;
  float run = 0.f;
#pragma unroll
  for (int u = 0; u < 16; ++u) sG[(16 * q + u) * LDG + c] = run += gv[u];
  __syncthreads();
  float off = 0.f;
  for (int b = 0; b < q; ++b) off += sG[(16 * b + 15) * LDG + c];
  __syncthreads();
  if (q > 0)
#pragma unroll
    for (int u = 0; u < 16; ++u) sG[(16 * q + u) * LDG + c] += off;
  __syncthreads();
}

/// Diagonal decay, gradient kernel: the B operands of phase 2 with their outer factors (each <= 1; a
/// the row's 16-row block): qr, kn ⊙ e^(gamma - gamma_16a) into sQs, sKs and beta kw ⊙ e^(gamma_16a+15
/// - gamma) into sKWb, 8 channels per thread and step.
template <class Op>
__device__ __forceinline__ void diag_grad_scaled_tiles(const float* sG, const Op* sQr, const Op* sKn, const Op* sKW,
                                                       const float* s_beta, Op* sQs, Op* sKs, Op* sKWb) {
  for (int e = threadIdx.x; e < C * KP / 8; e += blockDim.x) {
    const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8, r0 = r & ~15;
    const float* gr = sG + r * LDG + c8;
    const float* gs = sG + r0 * LDG + c8;
    const float* ge = sG + (r0 + 15) * LDG + c8;
    alignas(16) Op q8[8], k8[8], w8[8];
    *reinterpret_cast<uint4*>(q8) = *reinterpret_cast<const uint4*>(sQr + r * LDK + c8);
    *reinterpret_cast<uint4*>(k8) = *reinterpret_cast<const uint4*>(sKn + r * LDK + c8);
    *reinterpret_cast<uint4*>(w8) = *reinterpret_cast<const uint4*>(sKW + r * LDK + c8);
    const float br = s_beta[r];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float fa = __expf(gr[j] - gs[j]), fz = br * __expf(ge[j] - gr[j]);
      q8[j] = from_float<Op>(to_float(q8[j]) * fa);
      k8[j] = from_float<Op>(to_float(k8[j]) * fa);
      w8[j] = from_float<Op>(to_float(w8[j]) * fz);
    }
    *reinterpret_cast<uint4*>(sQs + r * LDK + c8) = *reinterpret_cast<const uint4*>(q8);
    *reinterpret_cast<uint4*>(sKs + r * LDK + c8) = *reinterpret_cast<const uint4*>(k8);
    *reinterpret_cast<uint4*>(sKWb + r * LDK + c8) = *reinterpret_cast<const uint4*>(w8);
  }
}

/// 3. Per (chunk, value head), 16 warps: the key-side gradients (see the file comment). Warp w owns
/// rows 16 (w % 4) .. + 15 and, of a C-column product, columns 16 (w / 4) ..; of a 128-column one,
/// channels 32 (w / 4) ... The elementwise terms (dgamma, dbeta) use the 16-bit key tiles.
template <class Tin, class Op, bool DIAG>
__global__ void __launch_bounds__(kGradThreads, 1) bwd_grad_kernel(const ChunkArgs ca, const BwdArgs bw) {
  constexpr int G = kGradGroups, NA = C / 8 / G, NK = KP / 8 / G;  // n-tiles per warp: C columns, channels
  const RecArgs& a = ca.a;
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sDO = reinterpret_cast<Op*>(smem);  // [C][LDK]
  Op* sR = sDO + C * LDK;                 // [C][LDK]
  Op* sDX = sR + C * LDK;                 // [C][LDK]
  Op* sS0 = sDX + C * LDK;                // [KP][LDK]
  Op* sHc = sS0 + KP * LDK;               // [KP][LDK]
  Op* sQr = sHc + KP * LDK;               // [C][LDK] read queries
  Op* sKn = sQr + C * LDK;                // [C][LDK] read keys
  Op* sKW = sKn + C * LDK;                // [C][LDK] write keys
  Op* sKWb = sKW + C * LDK;               // [C][LDK] Diag(beta) KW
  Op* sMq = sKWb + C * LDK;               // [C][LDC] masked, decayed Aq
  Op* sMr = sMq + C * LDC;                // [C][LDC] minus the masked, decayed Ar
  float* s_gam = reinterpret_cast<float*>(sMr + C * LDC);
  float* s_beta = s_gam + C;
  float* s_diag = s_beta + C;          // dO_i . r_i
  float* s_rho = s_diag + C;           // [C][G] row sums of (beta kw) ⊙ Ed (H r), rows < L - 1
  float* s_db = s_rho + G * C;         // [C][G]
  float* s_dg = s_db + G * C;          // [C][G]
  float* s_last = s_dg + G * C;        // [KP] H r of the last row
  float* s_red = s_last + KP;          // [kGradThreads]
  float* s_hs = s_red + kGradThreads;  // [KP] Diagonal decay: sum over v of H ⊙ S_0 per channel
  float* s_bnd = s_hs + KP;            // [4][KP] Diagonal decay: per row block, sum of beta kw ⊙ X3 (rows < L - 1)
  // Diagonal decay, in phase 1's region once it is done: gamma, the scaled keys, then dgamma.
  float* sG = reinterpret_cast<float*>(smem);     // [C][LDG] per-channel gamma
  Op* sQs = reinterpret_cast<Op*>(sG + C * LDG);  // [C][LDK] qr ⊙ e^(gamma - gamma_16a), a the row's block
  Op* sKs = sQs + C * LDK;                        // [C][LDK] kn ⊙ e^(gamma - gamma_16a)
  float* sDG = reinterpret_cast<float*>(sQs);     // [C][LDG] dgamma, after phase 2
  __shared__ int s_fast[4];                       // Diagonal decay: block a's diagonal block on tensor cores

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = 16 * (warp & 3), hf = warp >> 2;  // row block, column group
  const int64_t gc = blockIdx.x;
  const int hv = blockIdx.y;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) return;
  const int L = p.L;
  const int64_t head = gc * a.HV + hv, Vp = ca.Vpad;
  const int64_t row0 = a.cu_seqlens ? p.t0 : p.b * a.T + p.t0;  // token row of the chunk's first token
  const bool online = a.online;
  if (tid < C) {
    s_gam[tid] = ca.gam[head * C + tid];
    s_beta[tid] = gain_of(a, p, tid, hv);
  }
  load_tile_async<kGradThreads>(sDO, LDK, static_cast<const Op*>(ca.dO) + head * C * Vp, Vp, C, int(Vp));
  load_tile_async<kGradThreads>(sR, LDK, static_cast<const Op*>(ca.Rr) + head * C * Vp, Vp, C, int(Vp));
  if (online) load_tile_async<kGradThreads>(sDX, LDK, static_cast<const Op*>(ca.dX) + head * C * Vp, Vp, C, int(Vp));
  load_tile_async<kGradThreads>(sS0, LDK, static_cast<const Op*>(ca.S0) + head * KP * Vp, Vp, KP, int(Vp));
  load_tile_async<kGradThreads>(sHc, LDK, static_cast<const Op*>(ca.Hc) + head * KP * Vp, Vp, KP, int(Vp));
  cp_commit();  // phase 1's tiles; the key tiles load during phase 1
  load_tile_async<kGradThreads>(sQr, LDK, static_cast<const Op*>(DIAG ? ca.Qu : ca.Qn) + head * C * KP, KP, C, KP);
  load_tile_async<kGradThreads>(sKn, LDK, static_cast<const Op*>(DIAG ? ca.Ku : ca.Kn) + head * C * KP, KP, C, KP);
  load_tile_async<kGradThreads>(sKW, LDK, static_cast<const Op*>(DIAG ? ca.KWu : ca.KWn) + head * C * KP, KP, C, KP);
  cp_commit();
  cp_wait<1>();
  __syncthreads();

  // Phase 1: Aq = dO r^T, Ar = dX r^T (columns ca0 ..), X1 = dO S0^T, X2 = dX S0^T, X3 = r H^T
  // (channels ck0 ..), contracted over the value columns.
  float aq[NA][4], ar[NA][4], x1[NK][4], x2[NK][4], x3[NK][4];
#pragma unroll
  for (int t = 0; t < NA; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) aq[t][e] = ar[t][e] = 0.f;
#pragma unroll
  for (int t = 0; t < NK; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) x1[t][e] = x2[t][e] = x3[t][e] = 0.f;
  const int ca0 = 8 * NA * hf, ck0 = 8 * NK * hf;
  // f(hr, i, nt, e, c) for each of this thread's elements e of the X1 .. X3 accumulator tiles nt:
  // row i (hr: its upper or lower half of the 16 rows), key channel c.
  auto each_x = [&](auto&& f) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nt = 0; nt < NK; ++nt)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int e = 2 * hr + u;
          f(hr, acc_row(m0, e), nt, e, acc_col(ck0 + 8 * nt, e));
        }
  };
#pragma unroll 1
  for (int k0 = 0; k0 < Vp; k0 += 16) {
    uint32_t fo[4], fx[4], fr[4];
    load_a(fo, sDO, LDK, m0, k0);
    load_a(fr, sR, LDK, m0, k0);
    if (online) load_a(fx, sDX, LDK, m0, k0);
#pragma unroll
    for (int nt = 0; nt < NA; nt += 2) {
      uint32_t fb[4];
      load_b(fb, sR, LDK, ca0 + nt * 8, k0);
      mma<Op>(aq[nt], fo, fb);
      mma<Op>(aq[nt + 1], fo, fb + 2);
      if (online) {
        mma<Op>(ar[nt], fx, fb);
        mma<Op>(ar[nt + 1], fx, fb + 2);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NK; nt += 2) {
      uint32_t fs[4], fh[4];
      load_b(fs, sS0, LDK, ck0 + nt * 8, k0);
      mma<Op>(x1[nt], fo, fs);
      mma<Op>(x1[nt + 1], fo, fs + 2);
      if (online) {
        mma<Op>(x2[nt], fx, fs);
        mma<Op>(x2[nt + 1], fx, fs + 2);
      }
      load_b(fh, sHc, LDK, ck0 + nt * 8, k0);
      mma<Op>(x3[nt], fr, fh);
      mma<Op>(x3[nt + 1], fr, fh + 2);
    }
  }
  // Σ H ⊙ S_0 (the state-entry part of the last row's dgamma boundary term), fixed order.
  {
    float acc = 0.f;
    if (a.decay == kDecayScalar) {
      const int shift = Vp == 64 ? 3 : 4;  // 8-element groups per row: 8 or 16
      for (int e = tid; e < (KP << shift); e += kGradThreads) {
        const int r = e >> shift, c8 = (e & ((1 << shift) - 1)) * 8;
        alignas(16) Op x[8], y[8];
        *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(sHc + r * LDK + c8);
        *reinterpret_cast<uint4*>(y) = *reinterpret_cast<const uint4*>(sS0 + r * LDK + c8);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(to_float(x[j]), to_float(y[j]), acc);
      }
    }
    s_red[tid] = acc;
  }
  if constexpr (DIAG) {  // per channel (state row r = tid / 4, a quarter of the columns per thread)
    const int r = tid >> 2, q = tid & 3, n8 = int(Vp) / 32;
    float acc = 0.f;
    for (int u = 0; u < n8; ++u) {
      const int c8 = (q * n8 + u) * 8;
      alignas(16) Op x[8], y[8];
      *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(sHc + r * LDK + c8);
      *reinterpret_cast<uint4*>(y) = *reinterpret_cast<const uint4*>(sS0 + r * LDK + c8);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = fmaf(to_float(x[j]), to_float(y[j]), acc);
    }
    acc = quad_sum(acc);
    if (q == 0) s_hs[r] = acc;
  }
  const float gL = s_gam[L - 1];
  cp_wait<0>();
  __syncthreads();  // the key tiles; phase 1's region is free
  if constexpr (DIAG) {
    diag_grad_gamma(ca, p, hv, sG);
    diag_grad_scaled_tiles<Op>(sG, sQr, sKn, sKW, s_beta, sQs, sKs, sKWb);
    if (warp < 4) {  // block w's diagonal block joins the tensor cores when gamma spreads over it by <= kDiagSpread
      float spread = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u)
        spread = fmaxf(spread, sG[16 * warp * LDG + 4 * lane + u] - sG[(16 * warp + 15) * LDG + 4 * lane + u]);
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) spread = fmaxf(spread, __shfl_xor_sync(0xffffffffu, spread, d));
      if (lane == 0) s_fast[warp] = spread <= kDiagSpread<Op>;
    }
    __syncthreads();  // the scaled tiles: the boundary term below reads Diag(beta) KW's
  } else {
    scale_rows<KP>(sKWb, sKW, LDK, C, [&](int r) { return s_beta[r]; });  // Diag(beta) KW
  }
  // Masked, decayed Aq and -Ar (j < i) to shared memory, the diagonal of Aq apart (Diagonal decay:
  // undecayed, the decays go with the tiles and the middle factors below).
#pragma unroll
  for (int nt = 0; nt < NA; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = acc_row(m0, e), j = acc_col(ca0 + 8 * nt, e);
      const float d0 = j < i ? (DIAG ? 1.f : __expf(s_gam[i] - s_gam[j])) : 0.f;
      const float d1 = j + 1 < i ? (DIAG ? 1.f : __expf(s_gam[i] - s_gam[j + 1])) : 0.f;
      if (j == i) s_diag[i] = aq[nt][e];
      if (j + 1 == i) s_diag[i] = aq[nt][e + 1];
      store2(sMq + i * LDC + j, aq[nt][e] * d0, aq[nt][e + 1] * d1);
      store2(sMr + i * LDC + j, -ar[nt][e] * d0, -ar[nt][e + 1] * d1);
    }
  if constexpr (DIAG) {
    // Per channel c of row i in block a: X1 times e^gamma_16a, X2 times -e^gamma_16a, X3 times
    // e^(gamma_C - gamma_16a+15) (each <= 1; the row factors e^(gamma_i - gamma_16a), e^(gamma_16a+15 -
    // gamma_i) follow phase 2). The last row's H r leaves X3 (gate-free); beta_i kw_i ⊙ Ed_i ⊙ (r H^T)_i
    // (rows < L - 1) summed over the block's rows feeds the boundary term of dg per channel, formed as
    // dgamma's minus half forms it: the scaled tile Diag(beta) KW ⊙ e^(gamma_16a+15 - gamma) times X3.
    float bs[NK][2];
#pragma unroll
    for (int nt = 0; nt < NK; ++nt) bs[nt][0] = bs[nt][1] = 0.f;
    each_x([&](int, int i, int nt, int e, int c) {
      const float gC = sG[(C - 1) * LDG + c], es = __expf(sG[m0 * LDG + c]);
      x1[nt][e] *= es;
      x2[nt][e] *= -es;
      if (i == L - 1) s_last[c] = x3[nt][e];
      if (i < L - 1) {
        x3[nt][e] *= __expf(gC - sG[(m0 + 15) * LDG + c]);
        bs[nt][e & 1] = fmaf(to_float(sKWb[i * LDK + c]), x3[nt][e], bs[nt][e & 1]);
      } else {
        x3[nt][e] = 0.f;
      }
    });
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float x = bs[nt][u];
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
        if (lane < 4) s_bnd[(m0 / 16) * KP + acc_col(ck0 + 8 * nt, u)] = x;
      }
  } else {
    // X1 rows times E, X2 rows times -E (X2 becomes dkn), X3 rows times Ed. The last row's H r leaves
    // X3 (gate-free: kept out of dgamma); rho_i = (beta_i kw_i) . X3_i (rows < L - 1) feeds the boundary
    // term, beta_i kw_i rounded as in the Diag(beta) KW tile: the factor dgamma takes below, so that the
    // boundary and the suffix sums of dgamma cancel to float32 rounding.
    float rho[2] = {0.f, 0.f}, eg[2], ed[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int i = acc_row(m0, 2 * hr);
      eg[hr] = __expf(s_gam[i]), ed[hr] = i < L ? __expf(gL - s_gam[i]) : 0.f;
    }
    each_x([&](int hr, int i, int nt, int e, int c) {
      x1[nt][e] *= eg[hr];
      x2[nt][e] *= -eg[hr];
      x3[nt][e] *= ed[hr];
      if (i == L - 1) {
        s_last[c] = x3[nt][e];
        x3[nt][e] = 0.f;
      } else {
        rho[hr] = fmaf(rounded_kwb<Op>(s_beta[i], sKW[i * LDK + c]), x3[nt][e], rho[hr]);
      }
    });
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float x = quad_sum(rho[hr]);
      if ((lane & 3) == 0) s_rho[acc_row(m0, 2 * hr) * G + hf] = x;
    }
  }
  const float hs = !DIAG && a.decay == kDecayScalar ? block_sum(s_red) : 0.f;  // Σ H ⊙ S_0
  // Mq, -Mr and the diagonal complete.
  __syncthreads();

  // X1 += Mq Diag(beta) KW, X2 += (-Mr) Diag(beta) KW, X3 += Mq^T Qr + (-Mr)^T Kn, over the 16-column
  // blocks kb where Mq is not zero: kb <= a for X1, X2 (rows of block a), kb >= a for X3. Diagonal
  // decay: e^(gamma_i - gamma_j) = e^(gamma_i - gamma_16a) e^(gamma_16a - gamma_16b+15) e^(gamma_16b+15 -
  // gamma_j) (i in block a, j in block b): the outer factors are in the scaled tiles or follow, the
  // middle one, per channel, scales each block's product in float32 (the diagonal block b = a, up to
  // e^spread, only when it spreads by <= kDiagSpread, else it is summed elementwise below). So a pair's
  // two halves of dgamma are the same product Mq Qs KWb e^(middle), rounded alike (see the outputs).
  const int ab = m0 / 16;
  const bool dfast = !DIAG || s_fast[ab];
  const Op* sB3k = DIAG ? sKs : sKn;
  const Op* sB3q = DIAG ? sQs : sQr;
  // Diagonal decay: the middle factors e^(gamma_{s_row,c} - gamma_{e_row,c}) of this thread's accumulator
  // columns c in n-tiles nt, nt + 1 (m[2 * (n - nt) + u]: n-tile n, column acc_col(., u)).
  [[maybe_unused]] auto middle = [&](float* m, int nt, int s_row, int e_row) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int c = acc_col(ck0 + 8 * (nt + n), u);
        m[2 * n + u] = __expf(sG[s_row * LDG + c] - sG[e_row * LDG + c]);
      }
  };
  // acc += m t for one n-tile's accumulator (m: its two columns' factors), t zeroed after.
  [[maybe_unused]] auto add_scaled = [](float* acc, float* t, const float* m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[e] = fmaf(m[e & 1], t[e], acc[e]);
      t[e] = 0.f;
    }
  };
#pragma unroll 1
  for (int kb = 0; kb < 4; ++kb) {
    const int k0 = 16 * kb;
    if (kb < ab || (kb == ab && dfast)) {
      uint32_t fq[4], fr[4];
      load_a(fq, sMq, LDC, m0, k0);
      if (online) load_a(fr, sMr, LDC, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NK; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sKWb, LDK, k0, ck0 + nt * 8);
        if constexpr (DIAG) {  // the products apart, then times the middle factors in float32
          float m[4], t[4] = {0.f, 0.f, 0.f, 0.f};
          middle(m, nt, m0, k0 + 15);
          mma<Op>(t, fq, fb);
          add_scaled(x1[nt], t, m);
          mma<Op>(t, fq, fb + 2);
          add_scaled(x1[nt + 1], t, m + 2);
          if (online) {
            mma<Op>(t, fr, fb);
            add_scaled(x2[nt], t, m);
            mma<Op>(t, fr, fb + 2);
            add_scaled(x2[nt + 1], t, m + 2);
          }
          continue;
        }
        mma<Op>(x1[nt], fq, fb);
        mma<Op>(x1[nt + 1], fq, fb + 2);
        if (online) {
          mma<Op>(x2[nt], fr, fb);
          mma<Op>(x2[nt + 1], fr, fb + 2);
        }
      }
    }
    if (kb > ab || (kb == ab && dfast)) {
      uint32_t fqt[4], frt[4];
      load_a_t(fqt, sMq, LDC, m0, k0);
      if (online) load_a_t(frt, sMr, LDC, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NK; nt += 2) {
        uint32_t fb[4];
        if constexpr (DIAG) {  // both products of an n-tile summed apart, then times the middle factors
          float m[4], t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f};
          middle(m, nt, k0, m0 + 15);
          if (online) {
            load_b_t(fb, sB3k, LDK, k0, ck0 + nt * 8);
            mma<Op>(t0, frt, fb);
            mma<Op>(t1, frt, fb + 2);
          }
          load_b_t(fb, sB3q, LDK, k0, ck0 + nt * 8);
          mma<Op>(t0, fqt, fb);
          mma<Op>(t1, fqt, fb + 2);
          add_scaled(x3[nt], t0, m);
          add_scaled(x3[nt + 1], t1, m + 2);
          continue;
        }
        if (online) {
          load_b_t(fb, sB3k, LDK, k0, ck0 + nt * 8);
          mma<Op>(x3[nt], frt, fb);
          mma<Op>(x3[nt + 1], frt, fb + 2);
        }
        load_b_t(fb, sB3q, LDK, k0, ck0 + nt * 8);
        mma<Op>(x3[nt], fqt, fb);
        mma<Op>(x3[nt + 1], fqt, fb + 2);
      }
    }
  }
  // Diagonal decay: dgamma per element, from the scaled tiles the products took (Qs, Ks on the rows'
  // side, Diag(beta) KW on the columns' side), so that each pair cancels in the reverse sums of dg.
  float dgd[NK][4];
  if constexpr (DIAG) {
    // dgamma's tensor-core part, then the row factors, then (strong decay) the diagonal block
    // elementwise from the undecayed tiles, into X1 .. X3 and dgamma alike.
    each_x([&](int, int i, int nt, int e, int c) {
      dgd[nt][e] = to_float(sQs[i * LDK + c]) * x1[nt][e] + to_float(sKs[i * LDK + c]) * x2[nt][e] -
                   to_float(sKWb[i * LDK + c]) * x3[nt][e];
      const float gi = sG[i * LDG + c];
      const float us = __expf(gi - sG[m0 * LDG + c]);
      x1[nt][e] *= us;
      x2[nt][e] *= us;
      x3[nt][e] *= __expf(sG[(m0 + 15) * LDG + c] - gi);
      if (dfast) return;
      float e1 = 0.f, e2 = 0.f, e3 = 0.f;
      for (int j = m0; j < i; ++j) {
        const float f = __expf(gi - sG[j * LDG + c]) * s_beta[j] * to_float(sKW[j * LDK + c]);
        e1 = fmaf(to_float(sMq[i * LDC + j]), f, e1);
        if (online) e2 = fmaf(to_float(sMr[i * LDC + j]), f, e2);
      }
      for (int l = i + 1; l < m0 + 16; ++l) {
        float y = to_float(sMq[l * LDC + i]) * to_float(sQr[l * LDK + c]);
        if (online) y = fmaf(to_float(sMr[l * LDC + i]), to_float(sKn[l * LDK + c]), y);
        e3 = fmaf(y, __expf(sG[l * LDG + c] - gi), e3);
      }
      x1[nt][e] += e1;
      x2[nt][e] += e2;
      x3[nt][e] += e3;
      dgd[nt][e] += to_float(sQr[i * LDK + c]) * e1 + to_float(sKn[i * LDK + c]) * e2 -
                    s_beta[i] * to_float(sKW[i * LDK + c]) * e3;
    });
    __syncthreads();  // phase 2's reads of the scaled tiles are done: dgamma takes their place
  }
  // Outputs: dqr, dkn, dkw = beta Pr with the gate-free terms added; dbeta and dgamma row sums.
  // Fused (Identity preconditioner, one value head per key head): dqn = dqr and dkn + dkw go straight
  // through the L2 norm's backward to dq and dk (X1 <- dqn, X2 <- dkn + dkw), with the row dots
  // qhat . dqn, khat . dkn summed below.
  const bool fused = fused_key_grads(bw);
  float dbr[2] = {0.f, 0.f}, dgr[2] = {0.f, 0.f}, dotq[2] = {0.f, 0.f}, dotk[2] = {0.f, 0.f};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = acc_row(m0, 2 * hr);
    const bool ok = i < L;
    const float bi = s_beta[i], di = ok ? s_diag[i] : 0.f;
    const int64_t row = row0 + i;
#pragma unroll
    for (int nt = 0; nt < NK; ++nt) {
      float out_q[2] = {}, out_kn[2] = {}, out_kw[2] = {};  // columns c, c + 1: one 8-byte store each
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int e = 2 * hr + u, c = acc_col(ck0 + 8 * nt, e);
        const float qr = to_float(sQr[i * LDK + c]), kn = to_float(sKn[i * LDK + c]), kw = to_float(sKW[i * LDK + c]);
        const float dkn = online ? x2[nt][e] : 0.f;
        // Scalar decay: beta kw from the Diag(beta) KW tile, the operand of X1 and X2's in-chunk products, so
        // that each pair (j < i) enters dgamma_i and -dgamma_j as the same product and the reverse sum over
        // the chunk cancels it to float32 rounding (beta kw rounded once more here would leave a 16-bit
        // residual per pair, which the sums over tokens of dg, the gate parameters' gradients, accumulate).
        if constexpr (DIAG)
          sDG[i * LDG + c] = ok ? dgd[nt][e] : 0.f;
        else
          dgr[hr] += qr * x1[nt][e] + kn * dkn - to_float(sKWb[i * LDK + c]) * x3[nt][e];
        const float dqr = fmaf(di * bi, kw, x1[nt][e]);
        const float P = fmaf(di, qr, x3[nt][e]) + (i == L - 1 ? s_last[c] : 0.f);
        dbr[hr] = fmaf(kw, P, dbr[hr]);
        if (fused) {
          x1[nt][e] = dqr;
          x2[nt][e] = fmaf(bi, P, dkn);
          dotq[hr] = fmaf(qr, dqr, dotq[hr]);
          dotk[hr] = fmaf(kn, x2[nt][e], dotk[hr]);
        } else {
          out_q[u] = dqr, out_kn[u] = dkn, out_kw[u] = bi * P;
        }
      }
      const int c = acc_col(ck0 + 8 * nt, 2 * hr);  // even; Kp is a multiple of 64
      if (!fused && ok && c < bw.Kp) {
        const int64_t o = (row * a.HV + hv) * bw.Kp + c;
        *reinterpret_cast<float2*>(bw.dQ + o) = make_float2(out_q[0], out_q[1]);
        *reinterpret_cast<float2*>(bw.dKn + o) = make_float2(out_kn[0], out_kn[1]);
        *reinterpret_cast<float2*>(bw.dKW + o) = make_float2(out_kw[0], out_kw[1]);
      }
    }
  }
  float* s_dot = s_red;  // [C][G][2] (q, k) row dots per column group
  if (fused) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float x = quad_sum(dotq[hr]), y = quad_sum(dotk[hr]);
      if ((lane & 3) == 0) {
        const int i = acc_row(m0, 2 * hr);
        s_dot[(i * G + hf) * 2] = x;
        s_dot[(i * G + hf) * 2 + 1] = y;
      }
    }
    __syncthreads();
    Tin* dq = static_cast<Tin*>(bw.dq);
    Tin* dk = static_cast<Tin*>(bw.dk);
    const float* rq = bw.rq;
    const float* rk = bw.rk;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int i = acc_row(m0, 2 * hr);
      if (i >= L) continue;
      const int64_t row = row0 + i, t = p.t0 + i;
      // Qn holds qhat * scale: qhat . dqn = (Qn . dqn) / scale.
      const float sq = a.l2norm ? rq[row * a.H + hv] : 1.f, sk = a.l2norm ? rk[row * a.H + hv] : 1.f;
      const float inv_scale = 1.f / a.scale;
      float dq_dot = 0.f, dk_dot = 0.f;
#pragma unroll
      for (int q = 0; q < G; ++q) dq_dot += s_dot[(i * G + q) * 2], dk_dot += s_dot[(i * G + q) * 2 + 1];
      dq_dot = a.l2norm ? dq_dot * inv_scale : 0.f;
      dk_dot = a.l2norm ? dk_dot : 0.f;
      Tin* dq_row = dq ? dq + at3(bw.sdq, p.b, t, hv) : nullptr;
      Tin* dk_row = dk ? dk + at3(bw.sdk, p.b, t, hv) : nullptr;
#pragma unroll
      for (int nt = 0; nt < NK; ++nt) {
        const int e = 2 * hr, c = acc_col(ck0 + 8 * nt, e);  // columns c, c + 1
        float gq[2], gk[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float qh = to_float(sQr[i * LDK + c + u]) * inv_scale, kh = to_float(sKn[i * LDK + c + u]);
          gq[u] = a.scale * sq * (x1[nt][e + u] - qh * dq_dot);
          gk[u] = sk * (x2[nt][e + u] - kh * dk_dot);
        }
        if (dq_row) write_pair(dq_row + c, gq[0], gq[1], bw.pair_dq, c < a.K, c + 1 < a.K);
        if (dk_row) write_pair(dk_row + c, gk[0], gk[1], bw.pair_dk, c < a.K, c + 1 < a.K);
      }
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float x = quad_sum(dbr[hr]), y = quad_sum(dgr[hr]);
    if ((lane & 3) == 0) {
      const int i = acc_row(m0, 2 * hr);
      s_db[i * G + hf] = x;
      s_dg[i * G + hf] = y;
    }
  }
  __syncthreads();
  auto row_sum = [&](const float* x, int r) {
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < G; ++q) v += x[r * G + q];
    return v;
  };
  if (tid < L && bw.dbeta) store_gate(bw.dbeta, at3(bw.sdbeta, p.b, p.t0 + tid, hv), a.gate_dtype, row_sum(s_db, tid));
  if (warp == 0 && a.decay == kDecayScalar && bw.dg) {
    // Lane l owns rows 2l, 2l + 1: the boundary term (e^{gamma_L} Σ H ⊙ S_0 + Σ_{i < L-1} rho_i)
    // by a fixed shuffle tree, then dg_i = boundary + Σ_{j >= i} dgamma_j by a reverse lane scan.
    const int i0 = 2 * lane, i1 = i0 + 1;
    float b = (i0 < L - 1 ? row_sum(s_rho, i0) : 0.f) + (i1 < L - 1 ? row_sum(s_rho, i1) : 0.f);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) b += __shfl_xor_sync(0xffffffffu, b, d);
    const float bnd = fmaf(__expf(gL), hs, b);
    const float r0 = i0 < L ? row_sum(s_dg, i0) : 0.f, r1 = i1 < L ? row_sum(s_dg, i1) : 0.f;
    float suf = r0 + r1;  // inclusive suffix over lanes
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float up = __shfl_down_sync(0xffffffffu, suf, d);
      if (lane + d < 32) suf += up;
    }
    const float a1 = bnd + suf - r0, a0 = bnd + suf;  // rows i1 and i0
    if (i1 < L) store_gate(bw.dg, at3(bw.sdg, p.b, p.t0 + i1, hv), a.gate_dtype, a1);
    if (i0 < L) store_gate(bw.dg, at3(bw.sdg, p.b, p.t0 + i0, hv), a.gate_dtype, a0);
  }
  if (DIAG && bw.dg) {
    // Per channel c (thread = (row block q, c)): dg_ic = boundary_c + Σ_{j >= i} dgamma_jc, with the
    // boundary e^gamma_C Σ_v H ⊙ S_0 + Σ_{i < L-1} beta_i kw_i ⊙ Ed_i ⊙ (r H^T)_i, in a fixed order.
    const int c = tid & (KP - 1), q = tid / KP;
    float* s_part = s_red;  // [4][KP] row-block sums of dgamma
    float part = 0.f;
#pragma unroll
    for (int u = 0; u < 16; ++u) part += sDG[(16 * q + u) * LDG + c];
    s_part[q * KP + c] = part;
    __syncthreads();
    float acc = __expf(sG[(C - 1) * LDG + c]) * s_hs[c];
#pragma unroll
    for (int b = 0; b < 4; ++b) acc += s_bnd[b * KP + c];
    for (int b = 3; b > q; --b) acc += s_part[b * KP + c];
#pragma unroll
    for (int u = 15; u >= 0; --u) {
      const int i = 16 * q + u;
      acc += sDG[i * LDG + c];
      if (i < L && c < a.K) store_gate(bw.dg, at3(bw.sdg, p.b, p.t0 + i, hv) + c, a.gate_dtype, acc);
    }
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
