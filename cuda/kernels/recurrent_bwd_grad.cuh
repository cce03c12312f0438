/// @brief The float32 backward's chunk-gradient kernel (launch/backward.cuh, step 5): the key-side gradients per chunk.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/backward.cuh"
#include "launch/recurrent.cuh"
#include "kernels/recurrent_bwd_common.cuh"
#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels {
namespace {

/// Shared-memory layout of the chunk-gradient kernel (floats): the persistent part (Adq, Adr, gains,
/// scalar gammas, the boundary term, the last row's H r, per-row and per-row-group partial sums) and a region reused by
/// its two phases: the value-tile products (dO, R, dR, S_0, H tiles) and the key-side tiles of one 64-channel half.
template <int KT>
struct GradLayout {
  static constexpr int C = kBwdChunk, LC = C + 1;
  static constexpr int VTILE = 32, LV = VTILE + 1;
  static constexpr int kAq = 0, kAr = kAq + C * LC, kB = kAr + C * LC, kGam = kB + C, kBnd = kGam + C;
  static constexpr int kLastH = kBnd + KT, kBndPart = kLastH + KT, kRowDb = kBndPart + 16 * 64;
  static constexpr int kRowDg = kRowDb + C * 16, kRegion = kRowDg + C * 16;
  static constexpr int kPhaseA = 3 * C * LV + 2 * KT * LV, kPhaseC = 5 * C * LC;
  static constexpr size_t bytes() { return sizeof(float) * size_t(kRegion + (kPhaseA > kPhaseC ? kPhaseA : kPhaseC)); }
};

/// 5. Key-side gradients of one (chunk, value head): the formulas of launch/backward.cuh, 256 threads, each
/// owning rows 4 ty.. 4 ty + 3 and channels tx + 16 j (j < KT / 16).
template <class Tin, int KT, bool DIAG>
__global__ void __launch_bounds__(256, 1) chunk_grad_kernel(const BwdArgs b) {
  using L = GradLayout<KT>;
  constexpr int C = L::C, LC = L::LC, LV = L::LV, VTILE = L::VTILE, KPT = KT / 16;
  extern __shared__ __align__(16) float sm[];
  float *sAq = sm + L::kAq, *sAr = sm + L::kAr, *sB = sm + L::kB, *sGam = sm + L::kGam, *sBnd = sm + L::kBnd;
  float *sLastH = sm + L::kLastH, *sBndPart = sm + L::kBndPart;
  float *sRowDb = sm + L::kRowDb, *sRowDg = sm + L::kRowDg, *reg = sm + L::kRegion;
  const RecArgs& a = b.a;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y, h = hv / a.group;
  int n;
  int64_t ck;
  slot_chunk(a, slot, &n, &ck);
  if (ck < 0) return;
  const Seq s = seq_of(a, n);
  const int64_t i0 = ck * C;
  const int Lc = int(s.len - i0 < C ? s.len - i0 : C);
  const bool atk = a.precond == kPrecondATK, atq = a.precond == kPrecondATQ, has_p = atk || atq;
  const Tin* d_o = static_cast<const Tin*>(b.d_o);

  // Gains and (Scalar decay) chunk-local cumulative gates; rows past the chunk repeat the last gate.
  if (tid < C) sB[tid] = tid < Lc ? gain(a, s.b, s.t0 + i0 + tid, hv) : 0.f;
  if (tid < KT) sBnd[tid] = 0.f;
  if (tid == 0) {
    float gsum = 0.f;
    for (int i = 0; i < C; ++i) {
      if (i < Lc && a.decay == kDecayScalar) gsum += load_gate(a.g, at(a.sg, s.b, s.t0 + i0 + i, hv), a.gate_dtype);
      sGam[i] = gsum;
    }
  }

  // Phase A: products over the value dimension, 32 columns at a time.
  float X1[4][KPT], X2[4][KPT], X3[4][KPT], aq[4][4], ar[4][4];
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
    for (int j = 0; j < KPT; ++j) X1[ii][j] = X2[ii][j] = X3[ii][j] = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m) aq[ii][m] = ar[ii][m] = 0.f;
  }
  float bnd = 0.f;
  float *sDO = reg, *sR = sDO + C * LV, *sDR = sR + C * LV, *sS0 = sDR + C * LV, *sH = sS0 + KT * LV;
  const int64_t ckpt = (slot * a.HV + hv) * KT;  // row 0 of this chunk's checkpoints
#pragma unroll 1
  for (int v0 = 0; v0 < a.V; v0 += VTILE) {
    __syncthreads();
    for (int e = tid; e < C * VTILE; e += 256) {  // (unrolling these loads costs registers: spills)
      const int i = e / VTILE, vv = e % VTILE, vc = v0 + vv;
      const bool ok = i < Lc && vc < a.V;
      const int64_t row = s.row0 + i0 + i, t = s.t0 + i0 + i;
      sDO[i * LV + vv] = ok ? to_float(d_o[at(b.sdo, s.b, t, hv, vc)]) : 0.f;
      sR[i * LV + vv] = ok ? b.R[(row * a.HV + hv) * a.V + vc] : 0.f;
      sDR[i * LV + vv] = ok && a.online ? b.dR[(row * a.HV + hv) * a.V + vc] : 0.f;
    }
    for (int e = tid; e < KT * VTILE; e += 256) {
      const int c = e / VTILE, vv = e % VTILE, vc = v0 + vv;
      const bool ok = vc < a.V;
      sS0[c * LV + vv] = ok ? b.S[(ckpt + c) * a.V + vc] : 0.f;
      sH[c * LV + vv] = ok ? b.G[(ckpt + c) * a.V + vc] : 0.f;
    }
    __syncthreads();
#pragma unroll 2
    for (int vv = 0; vv < VTILE; ++vv) {
      float o_[4], r_[4], d_[4], rj[4];
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        o_[ii] = sDO[(4 * ty + ii) * LV + vv];
        r_[ii] = sR[(4 * ty + ii) * LV + vv];
        d_[ii] = sDR[(4 * ty + ii) * LV + vv];
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) rj[m] = sR[(tx + 16 * m) * LV + vv];
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const float s0 = sS0[(tx + 16 * j) * LV + vv], hh = sH[(tx + 16 * j) * LV + vv];
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) {
          X1[ii][j] = fmaf(o_[ii], s0, X1[ii][j]);
          X2[ii][j] = fmaf(d_[ii], s0, X2[ii][j]);
          X3[ii][j] = fmaf(r_[ii], hh, X3[ii][j]);
        }
      }
#pragma unroll
      for (int ii = 0; ii < 4; ++ii)
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          aq[ii][m] = fmaf(o_[ii], rj[m], aq[ii][m]);
          ar[ii][m] = fmaf(d_[ii], rj[m], ar[ii][m]);
        }
    }
    if (a.decay != kDecayNone && tid < KT)  // Σ_v H ⊙ S_0, the state-entry part of dγ's boundary term
      for (int vv = 0; vv < VTILE; ++vv) bnd = fmaf(sH[tid * LV + vv], sS0[tid * LV + vv], bnd);
  }
#pragma unroll
  for (int ii = 0; ii < 4; ++ii)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      sAq[(4 * ty + ii) * LC + tx + 16 * m] = aq[ii][m];
      sAr[(4 * ty + ii) * LC + tx + 16 * m] = ar[ii][m];
    }
  if (tid < KT) sBnd[tid] = bnd;

  // Phase C, per half of 64 channels: decays of the boundary products, the intra-chunk sums, outputs.
  float *sKW = reg, *sQR = sKW + C * LC, *sKN = sQR + C * LC, *sG = sKN + C * LC, *sDG = sG + C * LC;
  float dbrow[4] = {0.f, 0.f, 0.f, 0.f}, dgrow[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int hf = 0; hf < KT / 64; ++hf) {
    __syncthreads();
    for (int e = tid; e < C * 64; e += 256) {
      const int i = e / 64, cl = e % 64;
      const bool ok = i < Lc;
      const int64_t ek = ((s.row0 + i0 + i) * a.H + h) * KT + 64 * hf + cl;
      const float kn = ok ? b.kn[ek] : 0.f, qn = ok ? b.qn[ek] : 0.f, m = ok && has_p ? b.M[ek] : 1.f;
      sKW[i * LC + cl] = atk ? kn * m : kn;
      sQR[i * LC + cl] = atq ? qn * m : qn;
      sKN[i * LC + cl] = kn;
    }
    if (DIAG && tid < 64) {
      const int c = 64 * hf + tid;
      float gsum = 0.f;
#pragma unroll 16
      for (int i = 0; i < C; ++i) {
        if (i < Lc && c < a.K) gsum += load_gate(a.g, at(a.sg, s.b, s.t0 + i0 + i, hv, c), a.gate_dtype);
        sG[i * LC + tid] = gsum;
      }
    }
    __syncthreads();
    // γ of this thread's rows and channels, and of the chunk's last row.
    float gi[4][4], gl[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int cl = tx + 16 * jj;
      gl[jj] = DIAG ? sG[(Lc - 1) * LC + cl] : sGam[Lc - 1];
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) gi[ii][jj] = DIAG ? sG[(4 * ty + ii) * LC + cl] : sGam[4 * ty + ii];
    }
    // Terms with a gate factor e^0 (a token's own write read back by its own output; H r of the
    // last row) do not depend on the gates: they are kept out of dγ, where they would cancel only to
    // rounding, and added to the outputs at the end. The last row's dγ boundary term is
    // Σ_v H ⊙ Sbar_C = e^{γ_C} Σ_v H ⊙ S_0 + Σ_{i<C} b_i kw_i ⊙ (e^{γ_C-γ_i} H r_i).
    float bpart[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      const int i = 4 * ty + ii;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * hf + jj, cl = tx + 16 * jj;
        const float e = __expf(gi[ii][jj]);
        X1[ii][j] *= e;
        X2[ii][j] *= e;
        X3[ii][j] *= __expf(gl[jj] - gi[ii][jj]);
        if (i == Lc - 1) {
          sLastH[64 * hf + cl] = X3[ii][j];
          X3[ii][j] = 0.f;
        }
        bpart[jj] = fmaf(sB[i] * sKW[i * LC + cl], X3[ii][j], bpart[jj]);
      }
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) sBndPart[ty * 64 + tx + 16 * jj] = bpart[jj];
    __syncthreads();
    if (tid < 64 && a.decay != kDecayNone) {
      float acc = 0.f;
      for (int y = 0; y < 16; ++y) acc += sBndPart[y * 64 + tid];
      const float eL = __expf(DIAG ? sG[(Lc - 1) * LC + tid] : sGam[Lc - 1]);
      sBnd[64 * hf + tid] = fmaf(eL, sBnd[64 * hf + tid], acc);
    }
#pragma unroll 1
    for (int jr = 0; jr < Lc; ++jr) {
      const float bj = sB[jr];
      float kwj[4], qrj[4], knj[4], gj[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int cl = tx + 16 * jj;
        kwj[jj] = sKW[jr * LC + cl] * bj;
        qrj[jj] = sQR[jr * LC + cl];
        knj[jj] = sKN[jr * LC + cl];
        gj[jj] = DIAG ? sG[jr * LC + cl] : sGam[jr];
      }
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        const int i = 4 * ty + ii;
        // Masks as zero weights: (do_i·r_j), (dr_i·r_j) for j < i; (do_j·r_i), (dr_j·r_i) for j > i
        // (the diagonal j = i is added to the outputs below).
        const float wq = jr < i ? sAq[i * LC + jr] : 0.f, wr = jr < i ? sAr[i * LC + jr] : 0.f;
        const float wqt = jr > i ? sAq[jr * LC + i] : 0.f, wrt = jr > i ? sAr[jr * LC + i] : 0.f;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * hf + jj;
          // e^{γ_later - γ_earlier} <= 1 for non-positive gates.
          const float e = __expf(jr <= i ? gi[ii][jj] - gj[jj] : gj[jj] - gi[ii][jj]);
          X1[ii][j] = fmaf(wq * e, kwj[jj], X1[ii][j]);
          X2[ii][j] = fmaf(wr * e, kwj[jj], X2[ii][j]);
          X3[ii][j] = fmaf(wqt * e, qrj[jj], X3[ii][j]);
          X3[ii][j] = fmaf(-wrt * e, knj[jj], X3[ii][j]);
        }
      }
    }
    __syncthreads();  // sBnd, sLastH complete
                      // Outputs: dqr, dkn = -X2, dkw = b P with the gate-free terms added; db and dγ partial sums.
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      const int i = 4 * ty + ii;
      const bool ok = i < Lc;
      const int64_t row = s.row0 + i0 + i;
      const float bi = sB[i], dii = sAq[i * LC + i];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * hf + jj, cl = tx + 16 * jj, c = 64 * hf + cl;
        const float kw = sKW[i * LC + cl], qr = sQR[i * LC + cl], kn = sKN[i * LC + cl];
        const float dkn = a.online ? -X2[ii][j] : 0.f;
        float dgam = qr * X1[ii][j] + kn * dkn - kw * bi * X3[ii][j];
        if (i == Lc - 1) dgam += sBnd[c];
        const float dqr = fmaf(dii * bi, kw, X1[ii][j]);
        const float P = fmaf(dii, qr, X3[ii][j]) + (i == Lc - 1 ? sLastH[c] : 0.f), dkw = bi * P;
        dbrow[ii] = fmaf(kw, P, dbrow[ii]);
        if (ok) {
          const int64_t o = (row * a.HV + hv) * KT + c;
          b.dQ[o] = dqr;
          b.dKn[o] = dkn;
          b.dKW[o] = dkw;
        }
        if (DIAG)
          sDG[i * LC + cl] = ok ? dgam : 0.f;
        else
          dgrow[ii] += ok ? dgam : 0.f;
      }
    }
    if (DIAG) {  // dg = suffix sums of dγ over the chunk's rows, per channel
      __syncthreads();
      const int c = 64 * hf + tid;
      if (tid < 64 && c < a.K && b.dg) {
        float acc = 0.f;
        for (int i = Lc - 1; i >= 0; --i) {
          acc += sDG[i * LC + tid];
          store_gate(b.dg, at(b.sdg, s.b, s.t0 + i0 + i, hv, c), a.gate_dtype, acc);
        }
      }
    }
  }
  // Row sums over the 16 threads of a row (fixed order): dbeta, and dg for Scalar decay.
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
    sRowDb[(4 * ty + ii) * 16 + tx] = dbrow[ii];
    sRowDg[(4 * ty + ii) * 16 + tx] = dgrow[ii];
  }
  __syncthreads();
  if (tid < C) {
    float db = 0.f, dg = 0.f;
    for (int x = 0; x < 16; ++x) db += sRowDb[tid * 16 + x], dg += sRowDg[tid * 16 + x];
    sRowDb[tid * 16] = db;
    sRowDg[tid * 16] = dg;
  }
  __syncthreads();
  if (tid < Lc && b.dbeta) store_gate(b.dbeta, at(b.sdbeta, s.b, s.t0 + i0 + tid, hv), a.gate_dtype, sRowDb[tid * 16]);
  if (tid == 0 && !DIAG && a.decay == kDecayScalar && b.dg) {
    float acc = 0.f;
    for (int i = Lc - 1; i >= 0; --i) {
      acc += sRowDg[i * 16];
      store_gate(b.dg, at(b.sdg, s.b, s.t0 + i0 + i, hv), a.gate_dtype, acc);
    }
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels
