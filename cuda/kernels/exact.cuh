/// @brief The exact preconditioners' kernels (SPEC §2 ExactATK / ExactATQ, §3.8) and their launcher; the
/// algorithm is described in launch/exact.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/recurrent_bwd_common.cuh"
#include "launch/exact.cuh"

namespace dgps::cuda::kernels {
namespace {

/// Tokens staged in shared memory at a time (divides kExactChunk).
constexpr int kExactStage = 16;
/// Threads of the state kernels: kExactCols columns, 4 threads (a quarter of the key rows each) per column.
constexpr int kExactStateThreads = 4 * kExactCols;

/// First checkpoint slot of sequence n: strictly increasing with room for its ceil(len / kExactChunk) slots.
__device__ __forceinline__ int64_t exact_slot_base(int64_t row0, int n) { return row0 / kExactChunk + n; }

/// Sum over the 4 threads of a row (or of a column): the same bits in all four.
__device__ __forceinline__ double sum4(double x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float sum4(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ double warp_sum_d(double x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

/// Block sums of NV values (every thread gets them, summed in a fixed order). `red` holds NV x 32 doubles; the
/// caller separates two uses of the same `red` by a barrier.
template <int NV>
__device__ __forceinline__ void block_sum(double (&v)[NV], double* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    v[k] = warp_sum_d(v[k]);
    if (lane == 0) red[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    double s = 0;
    for (int w = 0; w < nw; ++w) s += red[k * 32 + w];
    v[k] = s;
  }
}

/// Row of the workspace arrays of (token row, head) with `per` entries per row.
__device__ __forceinline__ int64_t wrow(int64_t row, int H, int h) { return row * H + h; }

// ---------------------------------------------------------------------------------------------
// 1. The inverse Gram, one block per (key head, sequence), 4 KP threads: thread (row i, part p) holds
// P[i][4c + p], c < KP / 4, in registers.

template <class Tin, int KP>
__global__ void __launch_bounds__(4 * KP) exact_precond_kernel(const ExactArgs e) {
  constexpr int CPT = KP / 4, L = kExactStage;
  const RecArgs& a = e.b.a;
  const int h = blockIdx.x, n = blockIdx.y;
  const int tid = threadIdx.x, i = tid >> 2, part = tid & 3, lane = tid & 31, warp = tid >> 5;
  const int nw = blockDim.x >> 5;
  extern __shared__ __align__(16) unsigned char exact_smem[];
  double* sk = reinterpret_cast<double*>(exact_smem);  // [L][KP] normalised k
  double* sq = sk + L * KP;                            // [L][KP] normalised, scaled q
  double* sv = sq + L * KP;                            // [KP] the update's s
  double* sga = sv + KP;                               // [L] a = exp(g_p)
  double* sgb = sga + L;                               // [L] beta_p
  double* red = sgb + L;                               // [2][32]
  const Seq s = seq_of(a, n);
  const int64_t sidx = a.slots ? a.slots[n] : n;
  const bool atk = a.precond == kPrecondExactATK;
  const int K = a.K;
  double P[CPT];
  {
    const float* a0 = a.a0 ? a.a0 + sidx * a.sa0[0] + h * a.sa0[1] : nullptr;
    const double il = 1.0 / double(a.lambda);
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int j = 4 * c + part;
      P[c] = i < K && j < K ? (a0 ? double(a0[i * a.sa0[2] + j]) : (i == j ? il : 0.0)) : 0.0;
    }
  }
  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  for (int64_t t0 = 0; t0 < s.len; t0 += L) {
    const int nl = s.len - t0 < L ? int(s.len - t0) : L;
    __syncthreads();  // the previous group's reads of sk, sq are done
    for (int tok = warp; tok < nl; tok += nw) {  // a warp per token: the L2 norm (SPEC §1)
      const int64_t t = s.t0 + t0 + tok;
      const Tin* qr = q + at(a.sq, s.b, t, h);
      const Tin* kr = k + at(a.sk, s.b, t, h);
      double qv[(KP + 31) / 32], kv[(KP + 31) / 32];
      double ssq = 0, ssk = 0;
#pragma unroll
      for (int m = 0; m < (KP + 31) / 32; ++m) {
        const int c = lane + 32 * m;
        qv[m] = c < K ? double(to_float(qr[c])) : 0.0;
        kv[m] = c < K ? double(to_float(kr[c])) : 0.0;
        ssq += qv[m] * qv[m], ssk += kv[m] * kv[m];
      }
      ssq = warp_sum_d(ssq), ssk = warp_sum_d(ssk);
      const double rq = a.l2norm ? 1.0 / sqrt(ssq + 1e-6) : 1.0, rk = a.l2norm ? 1.0 / sqrt(ssk + 1e-6) : 1.0;
      const double mq = rq * double(a.scale);
#pragma unroll
      for (int m = 0; m < (KP + 31) / 32; ++m) {
        const int c = lane + 32 * m;
        if (c < KP) sq[tok * KP + c] = qv[m] * mq, sk[tok * KP + c] = kv[m] * rk;
      }
    }
    if (tid < nl) {
      const int64_t t = s.t0 + t0 + tid;
      sga[tid] = exp(double(load_gate(a.g_p, at(a.sgp, s.b, t, h), a.gate_dtype)));
      sgb[tid] = double(load_gate(a.beta_p, at(a.sbp, s.b, t, h), a.gate_dtype));
    }
    __syncthreads();
    for (int tok = 0; tok < nl; ++tok) {
      const double* kk = sk + tok * KP;
      const double* qq = sq + tok * KP;
      double yp = 0, wp = 0;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int j = 4 * c + part;
        yp = fma(P[c], kk[j], yp);
        if (!atk) wp = fma(P[c], qq[j], wp);
      }
      const double y = sum4(yp), w = atk ? 0.0 : sum4(wp);
      double dots[2] = {part == 0 ? kk[i] * y : 0.0, part == 0 ? y * qq[i] : 0.0};
      block_sum<2>(dots, red);
      const double kappa = dots[0], yq = dots[1];
      const double at_ = sga[tok], bt = sgb[tok], den = at_ + bt * kappa, f = bt / den, ia = 1.0 / at_;
      const int64_t r = wrow(s.row0 + t0 + tok, a.H, h);
      if (part == 0) {
        const double mapped = atk ? y / den : (w - f * y * yq) * ia;
        float* kr = e.keys + r * 4 * KP;
        kr[i] = float(kk[i]);
        kr[KP + i] = float(qq[i]);
        kr[2 * KP + i] = atk ? float(mapped) : float(kk[i]);
        kr[3 * KP + i] = atk ? float(qq[i]) : float(mapped);
        if (e.save) e.yw[r * 2 * KP + i] = y, e.yw[r * 2 * KP + KP + i] = w;
        sv[i] = sqrt(fabs(f) * ia) * y;
      }
      if (e.save && tid == 0) {
        double* sc = e.scal + r * 8;
        sc[0] = at_, sc[1] = bt, sc[2] = kappa, sc[3] = den, sc[4] = f, sc[5] = yq;
      }
      __syncthreads();
      // P / a - sg s s^T: the products s_i s_j and s_j s_i are the same number, so P stays symmetric.
      const double ns = (f < 0 ? 1.0 : -1.0) * sv[i];
#pragma unroll
      for (int c = 0; c < CPT; ++c) P[c] = __fma_rn(ns, sv[4 * c + part], __dmul_rn(ia, P[c]));
    }
  }
  if (a.aT && i < K) {
    float* aT = a.aT + sidx * a.saT[0] + h * a.saT[1] + i * a.saT[2];
#pragma unroll
    for (int c = 0; c < CPT; ++c)
      if (4 * c + part < K) aT[4 * c + part] = float(P[c]);
  }
  if (e.save) {
    double* pt = e.PT + ((int64_t(n) * a.H + h) * KP + i) * KP;
#pragma unroll
    for (int c = 0; c < CPT; ++c) pt[4 * c + part] = P[c];
  }
}

// ---------------------------------------------------------------------------------------------
// The state side: one block per (32 value columns, value head, sequence); thread (column, part p) holds the rows
// 4r + p, r < KP / 4, of its column.

/// Shared-memory staging of up to kExactStage tokens for the state kernels.
template <int KP>
struct StateStage {
  float* kn;   // [L][KP] read key
  float* kw;   // [L][KP] write key
  float* qr;   // [L][KP] read query
  float* fac;  // [L][KP] decay factors
  float* v;    // [L][32] values of the block's columns
  float* dout; // [L][32] output cotangents (backward)
  float* beta; // [L]
  float* red;  // backward: [4 warps][4][KP] and [4]
  static size_t bytes(bool bwd) {
    const size_t L = kExactStage;
    return sizeof(float) * (4 * L * KP + 2 * L * kExactCols + L + (bwd ? 4 * 4 * KP + 4 : 0));
  }
  __device__ explicit StateStage(float* base) {
    constexpr int L = kExactStage;
    kn = base, kw = kn + L * KP, qr = kw + L * KP, fac = qr + L * KP, v = fac + L * KP, dout = v + L * kExactCols;
    beta = dout + L * kExactCols, red = beta + L;
  }
};

/// Stages tokens [t0, t0 + nl) of sequence s for value head hv (key head h), columns from e0.
template <class Tin, int KP>
__device__ void stage_state(const ExactArgs& e, const StateStage<KP>& st, const Seq& s, int h, int hv, int64_t e0,
                            int64_t t0, int nl, bool with_do) {
  const RecArgs& a = e.b.a;
  const int tid = threadIdx.x;
  for (int idx = tid; idx < nl * KP; idx += kExactStateThreads) {
    const int tok = idx / KP, c = idx % KP;
    const int64_t t = s.t0 + t0 + tok;
    const float* kr = e.keys + wrow(s.row0 + t0 + tok, a.H, h) * 4 * KP;
    st.kn[idx] = kr[c];
    st.kw[idx] = kr[2 * KP + c];
    st.qr[idx] = kr[3 * KP + c];
    float f = 1.f;
    if (a.decay == kDecayDiagonal)
      f = c < a.K ? expf(load_gate(a.g, at(a.sg, s.b, t, hv, c), a.gate_dtype)) : 1.f;
    else if (a.decay == kDecayScalar)
      f = scalar_decay(a, s.b, t, hv);
    st.fac[idx] = f;
  }
  const Tin* v = static_cast<const Tin*>(a.v);
  const Tin* d_o = static_cast<const Tin*>(e.b.d_o);
  for (int idx = tid; idx < nl * kExactCols; idx += kExactStateThreads) {
    const int tok = idx / kExactCols, cc = idx % kExactCols;
    const int64_t t = s.t0 + t0 + tok, col = e0 + cc;
    const bool ok = col < a.V;
    st.v[idx] = ok ? to_float(v[at(a.sv, s.b, t, hv, col)]) : 0.f;
    if (with_do) st.dout[idx] = ok ? to_float(d_o[at(e.b.sdo, s.b, t, hv, col)]) : 0.f;
  }
  if (tid < nl) st.beta[tid] = gain(a, s.b, s.t0 + t0 + tid, hv);
}

/// One token of the state recurrence on this thread's rows of column `col` (SPEC §2): decay, write, and the
/// readout o = S_t^T qr (returned, summed over the column's threads). `keep`: S_{t-1} stored there first.
template <int KP>
__device__ __forceinline__ float state_step(float (&S)[KP / 4], const StateStage<KP>& st, int tok, int col, int part,
                                            bool online, float* keep) {
  constexpr int R = KP / 4;
  const float* kn = st.kn + tok * KP;
  const float* kw = st.kw + tok * KP;
  const float* qr = st.qr + tok * KP;
  const float* fac = st.fac + tok * KP;
  if (keep) {
#pragma unroll
    for (int r = 0; r < R; ++r) keep[r * kExactStateThreads] = S[r];
  }
  float ku = 0.f;
  if (online) {
#pragma unroll
    for (int r = 0; r < R; ++r) ku = fmaf(fac[4 * r + part] * kn[4 * r + part], S[r], ku);
    ku = sum4(ku);
  }
  const float u = st.beta[tok] * (st.v[tok * kExactCols + col] - ku);
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 4 * r + part;
    S[r] = fmaf(fac[c], S[r], kw[c] * u);
    o = fmaf(S[r], qr[c], o);
  }
  return sum4(o);
}

/// The state h0 (or zero) of this thread's rows of column e, or dhT likewise.
template <int KP>
__device__ __forceinline__ void load_rows(float (&S)[KP / 4], const float* base, const int64_t* st, int64_t idx,
                                          int hv, int64_t col, int part, int K, int V) {
#pragma unroll
  for (int r = 0; r < KP / 4; ++r) {
    const int c = 4 * r + part;
    S[r] = base && c < K && col < V ? base[idx * st[0] + hv * st[1] + c * st[2] + col] : 0.f;
  }
}

template <int KP>
__device__ __forceinline__ void store_rows(const float (&S)[KP / 4], float* base, const int64_t* st, int64_t idx,
                                           int hv, int64_t col, int part, int K, int V) {
  if (!base || col >= V) return;
#pragma unroll
  for (int r = 0; r < KP / 4; ++r) {
    const int c = 4 * r + part;
    if (c < K) base[idx * st[0] + hv * st[1] + c * st[2] + col] = S[r];
  }
}

// 2. The forward's state kernel.
template <class Tin, int KP>
__global__ void __launch_bounds__(kExactStateThreads) exact_state_kernel(const ExactArgs e) {
  constexpr int L = kExactStage;
  const RecArgs& a = e.b.a;
  const int cb = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int tid = threadIdx.x, colb = tid >> 2, part = tid & 3;
  const int h = hv / a.group;
  const int64_t e0 = int64_t(cb) * kExactCols, col = e0 + colb;
  extern __shared__ __align__(16) unsigned char exact_smem[];
  const StateStage<KP> st(reinterpret_cast<float*>(exact_smem));
  const Seq s = seq_of(a, n);
  const int64_t sidx = a.slots ? a.slots[n] : n;
  float S[KP / 4];
  load_rows<KP>(S, a.h0, a.sh0, sidx, hv, col, part, a.K, a.V);
  Tin* o = static_cast<Tin*>(a.o);
  for (int64_t t0 = 0; t0 < s.len; t0 += L) {
    const int nl = s.len - t0 < L ? int(s.len - t0) : L;
    __syncthreads();
    stage_state<Tin, KP>(e, st, s, h, hv, e0, t0, nl, false);
    __syncthreads();
    for (int tok = 0; tok < nl; ++tok) {
      const float out = state_step<KP>(S, st, tok, colb, part, a.online, nullptr);
      if (part == 0 && col < a.V) o[at(a.so, s.b, s.t0 + t0 + tok, hv, col)] = from_float<Tin>(out);
    }
  }
  store_rows<KP>(S, a.hT, a.shT, sidx, hv, col, part, a.K, a.V);
}

// ---------------------------------------------------------------------------------------------
// 3. The backward's state side.

template <class Tin, int KP>
__global__ void __launch_bounds__(kExactStateThreads) exact_state_bwd_kernel(const ExactArgs e) {
  constexpr int L = kExactStage, C = kExactChunk, R = KP / 4, NT = kExactStateThreads;
  const BwdArgs& b = e.b;
  const RecArgs& a = b.a;
  const int cb = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int tid = threadIdx.x, colb = tid >> 2, part = tid & 3, lane = tid & 31, warp = tid >> 5;
  const int h = hv / a.group;
  const int64_t e0 = int64_t(cb) * kExactCols, col = e0 + colb;
  extern __shared__ __align__(16) unsigned char exact_smem[];
  const StateStage<KP> st(reinterpret_cast<float*>(exact_smem));
  const Seq s = seq_of(a, n);
  const int64_t slot0 = exact_slot_base(s.row0, n), tile = int64_t(KP) * kExactCols;
  const int64_t blk = (int64_t(n) * a.HV + hv) * e.ncb + cb;
  float* held = e.held + blk * C * tile + tid;
  auto ckpt = [&](int64_t k) { return e.ck + ((slot0 + k) * a.HV + hv) * e.ncb * tile + cb * tile + tid; };
  const int64_t nck = (s.len + C - 1) / C;
  float S[R];
  load_rows<KP>(S, a.h0, a.sh0, n, hv, col, part, a.K, a.V);
  // Forward sweep: the state entering every chunk.
  for (int64_t k = 0; k < nck; ++k) {
    float* ck = ckpt(k);
#pragma unroll
    for (int r = 0; r < R; ++r) ck[r * NT] = S[r];
    const int64_t te = s.len < (k + 1) * C ? s.len : (k + 1) * C;
    for (int64_t t0 = k * C; t0 < te; t0 += L) {
      const int nl = te - t0 < L ? int(te - t0) : L;
      __syncthreads();
      stage_state<Tin, KP>(e, st, s, h, hv, e0, t0, nl, false);
      __syncthreads();
      for (int tok = 0; tok < nl; ++tok) state_step<KP>(S, st, tok, colb, part, a.online, nullptr);
    }
  }
  // Reverse: dS from dhT.
  float dS[R];
  load_rows<KP>(dS, b.dhT, b.sdhT, n, hv, col, part, a.K, a.V);
  Tin* dv = static_cast<Tin*>(b.dv);
  float* red = st.red;  // [4][4][KP], then [4]
  for (int64_t k = nck - 1; k >= 0; --k) {
    const float* ck = ckpt(k);
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] = ck[r * NT];
    const int64_t ta = k * C, te = s.len < (k + 1) * C ? s.len : (k + 1) * C;
    for (int64_t t0 = ta; t0 < te; t0 += L) {  // recompute, holding S_{t-1}
      const int nl = te - t0 < L ? int(te - t0) : L;
      __syncthreads();
      stage_state<Tin, KP>(e, st, s, h, hv, e0, t0, nl, false);
      __syncthreads();
      for (int tok = 0; tok < nl; ++tok)
        state_step<KP>(S, st, tok, colb, part, a.online, held + (t0 - ta + tok) * tile);
    }
    for (int64_t t0 = ta + (te - 1 - ta) / L * L; t0 >= ta; t0 -= L) {  // the chunk's groups in reverse
      const int nl = te - t0 < L ? int(te - t0) : L;
      __syncthreads();
      stage_state<Tin, KP>(e, st, s, h, hv, e0, t0, nl, true);
      __syncthreads();
      for (int tok = nl - 1; tok >= 0; --tok) {
        const float* hp = held + (t0 - ta + tok) * tile;
        float Sp[R];
#pragma unroll
        for (int r = 0; r < R; ++r) Sp[r] = hp[r * NT];
        const float* kn = st.kn + tok * KP;
        const float* kw = st.kw + tok * KP;
        const float* qr = st.qr + tok * KP;
        const float* fac = st.fac + tok * KP;
        const float bet = st.beta[tok], dout = st.dout[tok * kExactCols + colb];
        float ku = 0.f;
        if (a.online) {
#pragma unroll
          for (int r = 0; r < R; ++r) ku = fmaf(fac[4 * r + part] * kn[4 * r + part], Sp[r], ku);
          ku = sum4(ku);
        }
        const float uu = st.v[tok * kExactCols + colb] - ku;  // the residual (v for Offline), before the gain
        float x[R], dvp = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          x[r] = fmaf(qr[4 * r + part], dout, dS[r]);  // dS_t += qr do^T
          dvp = fmaf(kw[4 * r + part], x[r], dvp);
        }
        const float du = bet * sum4(dvp);  // dv = b S-grad^T kw
        if (dv && part == 0 && col < a.V) dv[at(b.sdv, s.b, s.t0 + t0 + tok, hv, col)] = from_float<Tin>(du);
        float dbp = 0.f;
        const float udo = uu * dout;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int c = 4 * r + part;
          const float fs = fac[c] * Sp[r];
          float g0 = fmaf(fs, dout, bet * kw[c] * udo);  // dqr: Sbar do + b kw (u.do)
          float g1 = bet * x[r] * uu;                    // dkw: b dS_t u
          const float dsb = a.online ? x[r] - kn[c] * du : x[r];
          float g2 = a.online ? -fs * du : 0.f;  // dkn: -Sbar du
          float g3 = fs * dsb;                   // dgamma: fac (S_{t-1} . dSbar)
          dbp = fmaf(kw[c], x[r] * uu, dbp);
          dS[r] = fac[c] * dsb;
          // Sum over the warp's 8 columns (lanes of the same part).
#pragma unroll
          for (int m = 4; m < 32; m <<= 1) {
            g0 += __shfl_xor_sync(0xffffffffu, g0, m);
            g1 += __shfl_xor_sync(0xffffffffu, g1, m);
            g2 += __shfl_xor_sync(0xffffffffu, g2, m);
            g3 += __shfl_xor_sync(0xffffffffu, g3, m);
          }
          if (lane < 4) {
            float* rw = red + warp * 4 * KP + c;
            rw[0] = g0, rw[KP] = g1, rw[2 * KP] = g2, rw[3 * KP] = g3;
          }
        }
        dbp = warp_sum(dbp);
        if (lane == 0) red[16 * KP + warp] = dbp;
        __syncthreads();
        const int64_t row = s.row0 + t0 + tok;
        float* pp = e.part + ((row * a.HV + hv) * e.ncb + cb) * 4 * KP;
        for (int idx = tid; idx < 4 * KP; idx += NT)
          pp[idx] = (red[idx] + red[4 * KP + idx]) + (red[8 * KP + idx] + red[12 * KP + idx]);
        if (tid == 0)
          e.pdb[(row * a.HV + hv) * e.ncb + cb] =
              (red[16 * KP] + red[16 * KP + 1]) + (red[16 * KP + 2] + red[16 * KP + 3]);
        __syncthreads();
      }
    }
  }
  store_rows<KP>(dS, b.dh0, b.sdh0, n, hv, col, part, a.K, a.V);
}

// ---------------------------------------------------------------------------------------------
// 4. Sums of the partials: one warp per (token row, key head).

/// (batch row, time index) of token row `row`.
__device__ __forceinline__ void row_bt(const RecArgs& a, int64_t row, int64_t* bb, int64_t* t) {
  if (a.cu_seqlens || a.T == 0) {
    *bb = 0, *t = row;
  } else {
    *bb = row / a.T, *t = row % a.T;
  }
}

template <int KP>
__global__ void __launch_bounds__(32) exact_combine_kernel(const ExactArgs e) {
  const BwdArgs& b = e.b;
  const RecArgs& a = b.a;
  const int64_t row = blockIdx.x;
  const int h = blockIdx.y, lane = threadIdx.x;
  const bool atk = a.precond == kPrecondExactATK;
  int64_t bb, t;
  row_bt(a, row, &bb, &t);
  const int64_t stride_hv = int64_t(e.ncb) * 4 * KP;
  const float* base = e.part + (row * a.HV + int64_t(h) * a.group) * stride_hv;
  float* out = e.dmq + wrow(row, a.H, h) * 3 * KP;
  for (int c = lane; c < KP; c += 32) {
    float dqr = 0.f, dkw = 0.f, dkn = 0.f;
    for (int j = 0; j < a.group; ++j)
      for (int cb = 0; cb < e.ncb; ++cb) {
        const float* p = base + j * stride_hv + cb * 4 * KP;
        dqr += p[c], dkw += p[KP + c], dkn += p[2 * KP + c];
      }
    out[c] = atk ? dkw : dqr;
    out[KP + c] = atk ? dqr : 0.f;
    out[2 * KP + c] = atk ? dkn : dkn + dkw;
  }
  for (int j = 0; j < a.group; ++j) {
    const int hv = h * a.group + j;
    const float* p = base + j * stride_hv;
    if (b.dg) {
      float tot = 0.f;
      for (int c = lane; c < a.K; c += 32) {
        float g = 0.f;
        for (int cb = 0; cb < e.ncb; ++cb) g += p[cb * 4 * KP + 3 * KP + c];
        if (a.decay == kDecayDiagonal) store_gate(b.dg, at(b.sdg, bb, t, hv, c), a.gate_dtype, g);
        tot += g;
      }
      tot = warp_sum(tot);
      if (a.decay == kDecayScalar && lane == 0) store_gate(b.dg, at(b.sdg, bb, t, hv), a.gate_dtype, tot);
    }
    if (b.dbeta && lane == 0) {
      float db = 0.f;
      for (int cb = 0; cb < e.ncb; ++cb) db += e.pdb[(row * a.HV + hv) * e.ncb + cb];
      store_gate(b.dbeta, at(b.sdbeta, bb, t, hv), a.gate_dtype, db);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 5. The preconditioner's reverse sweep: P (registers, as in kernel 1) from P_T back, Pi = dL/dP (shared memory,
// rows of KP + 4 doubles; thread (i, p) updates its own elements, the column sums Pi^T y read across rows).

template <int KP>
struct PiLayout {
  static constexpr int LD = KP + 4;
  static size_t bytes() { return sizeof(double) * (size_t(KP) * LD + 7 * KP + 4 * 32 + 2 * 32); }
};

template <int KP>
__global__ void __launch_bounds__(4 * KP) exact_precond_bwd_kernel(const ExactArgs e) {
  constexpr int CPT = KP / 4, LD = PiLayout<KP>::LD;
  const BwdArgs& b = e.b;
  const RecArgs& a = b.a;
  const int h = blockIdx.x, n = blockIdx.y;
  const int tid = threadIdx.x, i = tid >> 2, part = tid & 3;
  extern __shared__ __align__(16) unsigned char exact_smem[];
  double* Pi = reinterpret_cast<double*>(exact_smem);  // [KP][LD]
  double* vy = Pi + KP * LD;
  double* vdm = vy + KP;
  double* vtg = vdm + KP;
  double* vk = vtg + KP;
  double* vmap = vk + KP;
  double* vdz = vmap + KP;
  double* vx = vdz + KP;
  double* red4 = vx + KP;     // [4][32]
  double* red2 = red4 + 128;  // [2][32]
  const Seq s = seq_of(a, n);
  const bool atk = a.precond == kPrecondExactATK;
  const int K = a.K;
  double P[CPT];
  {
    const double* pt = e.PT + ((int64_t(n) * a.H + h) * KP + i) * KP;
    const float* daT = b.daT ? b.daT + n * b.sdaT[0] + h * b.sdaT[1] + i * b.sdaT[2] : nullptr;
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int j = 4 * c + part;
      P[c] = pt[j];
      Pi[i * LD + j] = daT && i < K && j < K ? double(daT[j]) : 0.0;
    }
  }
  for (int64_t t = s.len - 1; t >= 0; --t) {
    const int64_t r = wrow(s.row0 + t, a.H, h);
    const double* sc = e.scal + r * 8;
    const double at_ = sc[0], bp = sc[1], kappa = sc[2], den = sc[3], f = sc[4], yq = sc[5], ia = 1.0 / at_;
    const float* dm = e.dmq + r * 3 * KP;
    __syncthreads();  // the previous token's step is done (vectors, Pi)
    if (part == 0) {
      const double y = e.yw[r * 2 * KP + i], w = e.yw[r * 2 * KP + KP + i];
      const float* kr = e.keys + r * 4 * KP;
      vy[i] = y;
      vdm[i] = dm[i];
      vk[i] = kr[i];
      vtg[i] = atk ? double(kr[i]) : double(kr[KP + i]);
      vmap[i] = atk ? y / den : (w - f * y * yq) * ia;
    }
    __syncthreads();
    // Reads on P_t, Pi_t: A1 = Pi y, A2 = Pi^T y, pdm = P dm, s1 = <P, Pi>.
    double a1 = 0, a2 = 0, pd = 0, s1 = 0;
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int j = 4 * c + part;
      const double pij = Pi[i * LD + j];
      a1 = fma(pij, vy[j], a1);
      a2 = fma(Pi[j * LD + i], vy[j], a2);
      pd = fma(P[c], vdm[j], pd);
      s1 = fma(P[c], pij, s1);
    }
    double A1 = sum4(a1), A2 = sum4(a2);
    const double pdm = sum4(pd);
    double d4[4] = {s1, part == 0 ? vtg[i] * vy[i] : 0.0, part == 0 ? vdm[i] * vy[i] : 0.0,
                    part == 0 ? vdm[i] * vmap[i] : 0.0};
    block_sum<4>(d4, red4);
    const double ty = d4[1], dmy = d4[2], sG = d4[0] + d4[3];
    A1 = (A1 + vdm[i] * ty) * ia;   // G y / a
    A2 = (A2 + vtg[i] * dmy) * ia;  // G^T y / a
    double d2[2] = {part == 0 ? vy[i] * A1 : 0.0, part == 0 ? vy[i] * A2 : 0.0};
    block_sum<2>(d2, red2);
    const double dc = -d2[0], yA2 = d2[1];
    const double dden = -dc * f / den, db = dc / den + dden * kappa, da = -sG * ia + dden;
    const double dy = -f * A1 + dden * bp * vk[i], dz = -f * A2;
    if (part == 0) vdz[i] = dz, vx[i] = dy + dz;
    __syncthreads();
    // The step: px = P_t x; P_{t-1} = a P_t + f y y^T; Pi_{t-1} = Pi_t / a + (dm / a) tgt^T + dy k^T + k dz^T.
    const double fy = f * vy[i], dma = vdm[i] * ia, ki = vk[i];
    double px = 0;
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int j = 4 * c + part;
      px = fma(P[c], vx[j], px);
      P[c] = fma(fy, vy[j], at_ * P[c]);
      double* pij = Pi + i * LD + j;
      *pij = fma(ki, vdz[j], fma(dy, vk[j], fma(dma, vtg[j], ia * *pij)));
    }
    px = sum4(px);
    if (part == 0 && i < K) {
      // dk += dden b y + P_{t-1} x, P_{t-1} x = a P_t x + f y (y . x); d(target) += P_t^T dm.
      const double yx = f * dc + dden * bp * kappa - f * yA2;
      const double y = vy[i];
      const double dk = double(dm[2 * KP + i]) + dden * bp * y + at_ * px + f * y * yx + (atk ? pdm : 0.0);
      const double dq = double(dm[KP + i]) + (atk ? 0.0 : pdm);
      float* out = e.dqk + r * 2 * KP;
      out[i] = float(dq);
      out[KP + i] = float(dk);
    }
    if (tid == 0) {
      const int64_t tt = s.t0 + t;
      if (b.dgp) store_gate(b.dgp, at(b.sdgp, s.b, tt, h), a.gate_dtype, float(at_ * da));
      if (b.dbp) store_gate(b.dbp, at(b.sdbp, s.b, tt, h), a.gate_dtype, float(db));
    }
  }
  __syncthreads();
  if (b.da0 && i < K) {
    float* da0 = b.da0 + n * b.sda0[0] + h * b.sda0[1] + i * b.sda0[2];
#pragma unroll
    for (int c = 0; c < CPT; ++c)
      if (4 * c + part < K) da0[4 * c + part] = float(Pi[i * LD + 4 * c + part]);
  }
}

// ---------------------------------------------------------------------------------------------
// 6. The L2 norm's and scale's backward (SPEC §1): one warp per (token row, key head).

template <class Tin, int KP>
__global__ void __launch_bounds__(32) exact_norm_kernel(const ExactArgs e) {
  const BwdArgs& b = e.b;
  const RecArgs& a = b.a;
  const int64_t row = blockIdx.x;
  const int h = blockIdx.y, lane = threadIdx.x;
  int64_t bb, t;
  row_bt(a, row, &bb, &t);
  const float* g = e.dqk + wrow(row, a.H, h) * 2 * KP;
  for (int which = 0; which < 2; ++which) {
    Tin* dst = static_cast<Tin*>(which == 0 ? b.dq : b.dk);
    if (!dst) continue;
    const Tin* x = static_cast<const Tin*>(which == 0 ? a.q : a.k);
    const int64_t xo = at(which == 0 ? a.sq : a.sk, bb, t, h), go = at(which == 0 ? b.sdq : b.sdk, bb, t, h);
    const double mul = which == 0 ? double(a.scale) : 1.0;
    double xv[(KP + 31) / 32], dy[(KP + 31) / 32], ss = 0, xd = 0;
#pragma unroll
    for (int m = 0; m < (KP + 31) / 32; ++m) {
      const int c = lane + 32 * m;
      xv[m] = c < a.K ? double(to_float(x[xo + c])) : 0.0;
      dy[m] = c < a.K ? double(g[which * KP + c]) : 0.0;
      ss += xv[m] * xv[m], xd += xv[m] * dy[m];
    }
    ss = warp_sum_d(ss), xd = warp_sum_d(xd);
    const double rstd = a.l2norm ? 1.0 / sqrt(ss + 1e-6) : 1.0;
#pragma unroll
    for (int m = 0; m < (KP + 31) / 32; ++m) {
      const int c = lane + 32 * m;
      const double dx = a.l2norm ? mul * rstd * (dy[m] - xv[m] * rstd * rstd * xd) : mul * dy[m];
      if (c < a.K) dst[go + c] = from_float<Tin>(float(dx));
    }
  }
}

template <class Kern>
cudaError_t set_smem(Kern kernel, size_t bytes) {
  return bytes > 48 * 1024 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes))
                           : cudaSuccess;
}

template <class Tin, int KP>
cudaError_t launch_exact_kp(const ExactArgs& e, bool backward, cudaStream_t stream) {
  const RecArgs& a = e.b.a;
  const size_t pre_smem = sizeof(double) * (2 * kExactStage * KP + KP + 2 * kExactStage + 2 * 32);
  cudaError_t err = set_smem(exact_precond_kernel<Tin, KP>, pre_smem);
  if (err != cudaSuccess) return err;
  exact_precond_kernel<Tin, KP><<<dim3(a.H, a.N), 4 * KP, pre_smem, stream>>>(e);
  const dim3 sgrid(e.ncb, a.HV, a.N);
  if (!backward) {
    const size_t sm = StateStage<KP>::bytes(false);
    if ((err = set_smem(exact_state_kernel<Tin, KP>, sm)) != cudaSuccess) return err;
    exact_state_kernel<Tin, KP><<<sgrid, kExactStateThreads, sm, stream>>>(e);
    return cudaGetLastError();
  }
  const size_t sm = StateStage<KP>::bytes(true);
  if ((err = set_smem(exact_state_bwd_kernel<Tin, KP>, sm)) != cudaSuccess) return err;
  exact_state_bwd_kernel<Tin, KP><<<sgrid, kExactStateThreads, sm, stream>>>(e);
  if (e.rows > 0) exact_combine_kernel<KP><<<dim3(unsigned(e.rows), a.H), 32, 0, stream>>>(e);
  const size_t pb = PiLayout<KP>::bytes();
  if ((err = set_smem(exact_precond_bwd_kernel<KP>, pb)) != cudaSuccess) return err;
  exact_precond_bwd_kernel<KP><<<dim3(a.H, a.N), 4 * KP, pb, stream>>>(e);
  if (e.rows > 0 && (e.b.dq || e.b.dk))
    exact_norm_kernel<Tin, KP><<<dim3(unsigned(e.rows), a.H), 32, 0, stream>>>(e);
  return cudaGetLastError();
}

}  // namespace

template <class Tin>
cudaError_t launch_exact(const ExactArgs& e, const Plan& plan, cudaStream_t stream) {
  const bool backward = plan.kernel == Plan::Kernel::exact_backward;
  switch (plan.exact_keys) {
    case 16:
      return launch_exact_kp<Tin, 16>(e, backward, stream);
    case 32:
      return launch_exact_kp<Tin, 32>(e, backward, stream);
    case 64:
      return launch_exact_kp<Tin, 64>(e, backward, stream);
    default:
      break;
  }
  return launch_exact_kp<Tin, 128>(e, backward, stream);
}

}  // namespace dgps::cuda::kernels
