/// @brief The float32 backward's state recurrences (launch/backward.cuh, steps 3 and 4): forward with checkpoints, reverse.
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

}  // namespace
}  // namespace dgps::cuda::kernels
