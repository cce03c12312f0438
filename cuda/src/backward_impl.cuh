/// @brief The CUDA backward's kernels (see backward.cuh for the algorithm), compiled once per input type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backward.cuh"
#include "recurrent_impl.cuh"

namespace dgps::cuda::kernels {
namespace {

/// One sequence of the call: its batch row, first time index, length and first token row (b * T + t).
struct Seq {
  int64_t b, t0, len, row0;
};

__device__ __forceinline__ Seq seq_of(const RecArgs& a, int n) {
  if (a.cu_seqlens) {
    const int64_t t0 = a.cu_seqlens[n];
    return {0, t0, a.cu_seqlens[n + 1] - t0, t0};
  }
  return {n, 0, a.T, int64_t(n) * a.T};
}

/// First checkpoint slot of sequence n: strictly increasing in n with room for its ceil(len / 64) + 1
/// slots (floor((r + l) / 64) >= floor(r / 64) + floor(l / 64)).
__device__ __forceinline__ int64_t slot_base(int64_t row0, int n) { return row0 / kBwdChunk + 2 * int64_t(n); }

/// Element offset of (batch b, time t, head, channel c) in a tensor with strides s.
__device__ __forceinline__ int64_t at(const int64_t* s, int64_t b, int64_t t, int64_t head, int64_t c = 0) {
  return b * s[0] + t * s[1] + head * s[2] + c;
}

/// e^g of a scalar decay (1 without decay; Diagonal decay is applied per channel by the caller).
__device__ __forceinline__ float scalar_decay(const RecArgs& a, int64_t b, int64_t t, int hv) {
  return a.decay == kDecayScalar ? expf(load_gate(a.g, at(a.sg, b, t, hv), a.gate_dtype)) : 1.f;
}

__device__ __forceinline__ float gain(const RecArgs& a, int64_t b, int64_t t, int hv) {
  return a.beta ? load_gate(a.beta, at(a.sbeta, b, t, hv), a.gate_dtype) : 1.f;
}

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

/// The (sequence n, chunk k) whose checkpoints live in `slot`; k = -1 for a slot no chunk uses.
__device__ __forceinline__ void slot_chunk(const RecArgs& a, int64_t slot, int* n, int64_t* k) {
  int lo = 0, hi = a.N - 1;  // the largest n whose first slot is <= slot
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (slot_base(seq_of(a, mid).row0, mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const Seq s = seq_of(a, lo);
  const int64_t ck = slot - slot_base(s.row0, lo);
  *n = lo;
  *k = ck < (s.len + kBwdChunk - 1) / kBwdChunk ? ck : -1;
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

/// End (exclusive) of the token range of chunk k of sequence s.
__device__ __forceinline__ int64_t chunk_end(const Seq& s, int64_t k) {
  return s.len < (k + 1) * kBwdChunk ? s.len : (k + 1) * kBwdChunk;
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

/// Writes rows part*R.. of column vcol of a [slots, HV, KT, V] checkpoint.
template <int KT, int R>
__device__ __forceinline__ void store_state(float* buf, int64_t slot, int hv, const RecArgs& a, int part, int vcol,
                                            const float* S) {
#pragma unroll
  for (int i = 0; i < R; ++i) buf[((slot * a.HV + hv) * KT + part * R + i) * a.V + vcol] = S[i];
}

/// Warps per block of the state kernels (they share the staged token vectors of one value head).
constexpr int kStateWarps = 4;
/// Tokens staged in shared memory at a time by the state kernels.
constexpr int kStateStage = 8;

/// Shared-memory layout of the state kernels: kStateStage tokens of up to three KT-vectors (padded
/// so that the PARTS row segments of a float4 read fall in different banks), the diagonal decays,
/// per-token scalars (decay, gain) and the block's value columns of v or do.
template <int KT, int COLS>
struct StateLayout {
  static constexpr int PARTS = 32 / COLS, R = KT / PARTS, RP = R + 4, KP = PARTS * RP, L = kStateStage;
  static constexpr int NCOL = kStateWarps * COLS;
  static constexpr int kVec = 0, kDiag = kVec + 3 * L * KP, kDec = kDiag + L * KP, kGain = kDec + L;
  static constexpr int kCol = kGain + L, kTotal = kCol + L * NCOL;
  static constexpr size_t bytes() { return sizeof(float) * size_t(kTotal); }
  /// Padded position of channel c.
  static __device__ __forceinline__ int pos(int c) { return c + 4 * (c / R); }
};

/// One staging of kStateStage tokens for the state kernels, held in registers between its global
/// loads and its shared-memory stores, so that the next tile's loads are in flight while the current
/// tile is computed: each token's read key kn, M (preconditioners), qn (with WANT_Q), the gates (g
/// per channel for Diagonal decay, scalar g, gain) and the block's columns of v or do.
template <class Tin, int KT, int COLS, bool WANT_Q>
struct TokenTile {
  using SL = StateLayout<KT, COLS>;
  static constexpr int NT = kStateWarps * 32, L = SL::L, NE = L * KT / NT, NC = (L * SL::NCOL + NT - 1) / NT;
  static_assert(L * KT % NT == 0, "whole staging rounds");
  float kn[NE], m[NE], q[WANT_Q ? NE : 1], g[NE], col[NC], dec = 0.f, gn = 0.f;

  /// The global reads of tokens t0 .. t0 + L - 1 of sequence s (zeros past its end).
  __device__ __forceinline__ void load(const BwdArgs& b, const Seq& s, int64_t t0, int h, int hv, int col0,
                                       const Tin* cols, const int64_t* scols) {
    const RecArgs& a = b.a;
    const int tid = threadIdx.x;
    const bool has_m = a.precond != kPrecondIdentity, diag = a.decay == kDecayDiagonal;
#pragma unroll
    for (int u = 0; u < NE; ++u) {
      const int e = tid + u * NT, i = e / KT, c = e % KT;
      const bool ok = t0 + i < s.len;
      const int64_t w = ((s.row0 + t0 + i) * a.H + h) * KT + c;
      kn[u] = ok ? b.kn[w] : 0.f;
      m[u] = ok && has_m ? b.M[w] : 1.f;
      if (WANT_Q) q[u] = ok ? b.qn[w] : 0.f;
      g[u] = ok && diag && c < a.K ? load_gate(a.g, at(a.sg, s.b, s.t0 + t0 + i, hv, c), a.gate_dtype) : 0.f;
    }
    if (tid < L) {
      const bool ok = t0 + tid < s.len;
      const int64_t t = s.t0 + t0 + tid;
      dec = ok && a.decay == kDecayScalar ? load_gate(a.g, at(a.sg, s.b, t, hv), a.gate_dtype) : 0.f;
      gn = ok ? gain(a, s.b, t, hv) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < NC; ++u) {
      const int e = tid + u * NT, i = e / SL::NCOL, vc = col0 + e % SL::NCOL;
      col[u] =
          e < L * SL::NCOL && t0 + i < s.len && vc < a.V ? to_float(cols[at(scols, s.b, s.t0 + t0 + i, hv, vc)]) : 0.f;
    }
  }

  /// Writes the tile to shared memory: kn, the write key kw, the read query qr, e^g, e^{scalar g}, gain, columns.
  __device__ __forceinline__ void store(const RecArgs& a, float* sm) const {
    const int tid = threadIdx.x;
    const bool atk = a.precond == kPrecondATK, atq = a.precond == kPrecondATQ;
#pragma unroll
    for (int u = 0; u < NE; ++u) {
      const int e = tid + u * NT, p = (e / KT) * SL::KP + SL::pos(e % KT);
      sm[SL::kVec + p] = kn[u];
      sm[SL::kVec + L * SL::KP + p] = atk ? kn[u] * m[u] : kn[u];
      if (WANT_Q) sm[SL::kVec + 2 * L * SL::KP + p] = atq ? q[u] * m[u] : q[u];
      if (a.decay == kDecayDiagonal) sm[SL::kDiag + p] = __expf(g[u]);
    }
    if (tid < L) {
      sm[SL::kDec + tid] = __expf(dec);
      sm[SL::kGain + tid] = gn;
    }
#pragma unroll
    for (int u = 0; u < NC; ++u)
      if (tid + u * NT < L * SL::NCOL) sm[SL::kCol + tid + u * NT] = col[u];
  }
};

/// x . y over this thread's R rows of a staged vector (float4 reads from shared memory).
template <int R>
__device__ __forceinline__ float dot_rows(const float* S, const float* v) {
  float d0 = 0.f, d1 = 0.f;
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(v)[i];
    d0 = fmaf(S[4 * i], f.x, fmaf(S[4 * i + 1], f.y, d0));
    d1 = fmaf(S[4 * i + 2], f.z, fmaf(S[4 * i + 3], f.w, d1));
  }
  return d0 + d1;
}

/// S += x * v over this thread's R rows of a staged vector.
template <int R>
__device__ __forceinline__ void axpy_rows(float* S, float x, const float* v) {
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(v)[i];
    S[4 * i] = fmaf(f.x, x, S[4 * i]);
    S[4 * i + 1] = fmaf(f.y, x, S[4 * i + 1]);
    S[4 * i + 2] = fmaf(f.z, x, S[4 * i + 2]);
    S[4 * i + 3] = fmaf(f.w, x, S[4 * i + 3]);
  }
}

/// Multiplies this thread's R state rows by a staged token's decay (per channel, or scalar).
template <int R>
__device__ __forceinline__ void decay_rows(float* S, bool diag, const float* dg, float d) {
  if (diag) {
#pragma unroll
    for (int i = 0; i < R / 4; ++i) {
      const float4 f = reinterpret_cast<const float4*>(dg)[i];
      S[4 * i] *= f.x, S[4 * i + 1] *= f.y, S[4 * i + 2] *= f.z, S[4 * i + 3] *= f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) S[i] *= d;
  }
}

/// 3. The forward recurrence per (sequence n, value head, 4 COLS value columns; 4 warps, one per COLS
/// columns): residuals and chunk-entry states; the token vectors go through shared memory 8 at a time (TokenTile).
template <class Tin, int KT, int COLS>
__global__ void __launch_bounds__(kStateWarps * 32) state_fwd_kernel(const BwdArgs b) {
  using SL = StateLayout<KT, COLS>;
  constexpr int PARTS = SL::PARTS, R = SL::R, L = SL::L, KP = SL::KP;
  extern __shared__ __align__(16) float sm[];
  const RecArgs& a = b.a;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, part = lane / COLS, col = lane % COLS;
  const int n = blockIdx.z, hv = blockIdx.y, h = hv / a.group;
  const int col0 = blockIdx.x * SL::NCOL, j = warp * COLS + col, vcol = col0 + j;
  const bool vok = vcol < a.V, diag = a.decay == kDecayDiagonal;
  const Seq s = seq_of(a, n);
  const int64_t base = slot_base(s.row0, n);
  float S[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int c = part * R + i;
    S[i] = (a.h0 && vok && c < a.K) ? a.h0[n * a.sh0[0] + hv * a.sh0[1] + c * a.sh0[2] + vcol] : 0.f;
  }
  const int off = SL::pos(part * R);
  TokenTile<Tin, KT, COLS, false> tile;
  const Tin* v = static_cast<const Tin*>(a.v);
  if (s.len > 0) tile.load(b, s, 0, h, hv, col0, v, a.sv);
#pragma unroll 1
  for (int64_t t0 = 0; t0 < s.len; t0 += L) {
    __syncthreads();
    tile.store(a, sm);
    __syncthreads();
    if (t0 + L < s.len) tile.load(b, s, t0 + L, h, hv, col0, v, a.sv);  // in flight during this tile
    const int nt = int(s.len - t0 < L ? s.len - t0 : L);
#pragma unroll 1
    for (int i = 0; i < nt; ++i) {
      const int64_t ti = t0 + i;
      if (ti % kBwdChunk == 0 && vok) store_state<KT, R>(b.S, base + ti / kBwdChunk, hv, a, part, vcol, S);
      decay_rows<R>(S, diag, sm + SL::kDiag + i * KP + off, sm[SL::kDec + i]);
      float r = sm[SL::kCol + i * SL::NCOL + j];
      if (a.online) r -= reduce_parts<PARTS>(dot_rows<R>(S, sm + SL::kVec + i * KP + off));
      if (part == 0 && vok) b.R[((s.row0 + ti) * a.HV + hv) * a.V + vcol] = r;
      axpy_rows<R>(S, sm[SL::kGain + i] * r, sm + SL::kVec + (L + i) * KP + off);
    }
  }
  if (vok) store_state<KT, R>(b.S, base + (s.len + kBwdChunk - 1) / kBwdChunk, hv, a, part, vcol, S);
}

/// 4. The reverse recurrence of the state gradient per (sequence, value head, 4 COLS value columns).
template <class Tin, int KT, int COLS>
__global__ void __launch_bounds__(kStateWarps * 32) state_rev_kernel(const BwdArgs b) {
  using SL = StateLayout<KT, COLS>;
  constexpr int PARTS = SL::PARTS, R = SL::R, L = SL::L, KP = SL::KP;
  extern __shared__ __align__(16) float sm[];
  const RecArgs& a = b.a;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, part = lane / COLS, col = lane % COLS;
  const int n = blockIdx.z, hv = blockIdx.y, h = hv / a.group;
  const int col0 = blockIdx.x * SL::NCOL, j = warp * COLS + col, vcol = col0 + j;
  const bool vok = vcol < a.V, diag = a.decay == kDecayDiagonal;
  const Seq s = seq_of(a, n);
  const int64_t base = slot_base(s.row0, n);
  Tin* dv = static_cast<Tin*>(b.dv);
  float G[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int c = part * R + i;
    G[i] = (b.dhT && vok && c < a.K) ? b.dhT[n * b.sdhT[0] + hv * b.sdhT[1] + c * b.sdhT[2] + vcol] : 0.f;
  }
  const int off = SL::pos(part * R);
  const int64_t ntiles = (s.len + L - 1) / L;
  TokenTile<Tin, KT, COLS, true> tile;
  const Tin* d_o = static_cast<const Tin*>(b.d_o);
  if (ntiles > 0) tile.load(b, s, (ntiles - 1) * L, h, hv, col0, d_o, b.sdo);
#pragma unroll 1
  for (int64_t k = ntiles - 1; k >= 0; --k) {
    const int64_t t0 = k * L;
    __syncthreads();
    tile.store(a, sm);
    __syncthreads();
    if (k > 0) tile.load(b, s, t0 - L, h, hv, col0, d_o, b.sdo);  // in flight during this tile
    const int nt = int(s.len - t0 < L ? s.len - t0 : L);
#pragma unroll 1
    for (int i = nt - 1; i >= 0; --i) {
      const int64_t ti = t0 + i, t = s.t0 + ti;
      if ((ti == s.len - 1 || ti % kBwdChunk == kBwdChunk - 1) && vok)
        store_state<KT, R>(b.G, base + ti / kBwdChunk, hv, a, part, vcol, G);
      axpy_rows<R>(G, sm[SL::kCol + i * SL::NCOL + j], sm + SL::kVec + (2 * L + i) * KP + off);
      const float dr = sm[SL::kGain + i] * reduce_parts<PARTS>(dot_rows<R>(G, sm + SL::kVec + (L + i) * KP + off));
      if (part == 0 && vok) {
        b.dR[((s.row0 + ti) * a.HV + hv) * a.V + vcol] = dr;
        if (dv) dv[at(b.sdv, s.b, t, hv, vcol)] = from_float<Tin>(dr);
      }
      if (a.online) axpy_rows<R>(G, -dr, sm + SL::kVec + i * KP + off);
      decay_rows<R>(G, diag, sm + SL::kDiag + i * KP + off, sm[SL::kDec + i]);
    }
  }
  if (b.dh0 && vok) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int c = part * R + i;
      if (c < a.K) b.dh0[n * b.sdh0[0] + hv * b.sdh0[1] + c * b.sdh0[2] + vcol] = G[i];
    }
  }
}

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

/// 5. Key-side gradients of one (chunk, value head): the formulas of backward.cuh, 256 threads, each
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
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
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
