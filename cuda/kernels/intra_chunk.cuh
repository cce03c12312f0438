/// @brief The chunkwise forward's intra-chunk kernel (SPEC §4): each chunk's state-independent part on tensor cores.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/chunk.cuh"
#include "kernels/diag_decay.cuh"
#include "kernels/precond_stats.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Backward mode: one warp scales column j of its 16 staged rows of P (row stride LDC) by beta_j, so
/// that the workspace holds P Diag(beta) (the state pass's o = ... + P Diag(beta) r, the prep kernel's
/// Diag(beta) P^T do).
template <class Op>
__device__ __forceinline__ void times_beta_cols(Op* rows, const float* s_beta) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 16 * C / 2; e += 32) {
    const int r = e / (C / 2), j = (e % (C / 2)) * 2;
    Op* x = rows + r * LDC + j;
    store2(x, to_float(x[0]) * s_beta[j], to_float(x[1]) * s_beta[j + 1]);
  }
  __syncwarp();
}

/// Per (chunk, value head): the state-independent part of SPEC §4 (see launch/chunk.cuh). 4 warps; warp w
/// owns rows 16w .. 16w + 15 of every C-row product (but Akk and P with scalar or no decay: their lower
/// block triangle balanced over the warps). LEAN: the lean Diagonal-decay layout below, its
/// own instantiation (the launch picks it for Diagonal decay with raw v rows), so that its registers
/// do not change the other models' code. QUAD (kQuadIdentity, kQuadATK): the quad layout below (four
/// blocks per SM), launched for the forward with scalar or no decay, raw q rows and raw v rows, of the
/// Identity or the DiagonalATK preconditioner (intra_quad).
template <class Tin, class Op, bool LEAN = false, int QUAD = 0>
__global__ void __launch_bounds__(kThreads, QUAD ? 4 : 3) intra_kernel(const ChunkArgs ca) {
  static_assert(!(LEAN && QUAD), "one layout");
  const RecArgs& a = ca.a;
  const bool online = QUAD || a.online, bwd = !QUAD && ca.bwd;  // (QUAD: raw v rows, an Online solve)
  const int LDV = ca.Vpad + 8;
  const bool has_p = QUAD ? QUAD == kQuadATK : a.precond != kPrecondIdentity;
  const bool atk = QUAD ? QUAD == kQuadATK : a.precond == kPrecondATK;
  const bool diag = LEAN || (!QUAD && a.decay == kDecayDiagonal);  // (LEAN: Diagonal decay always)
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sQ = reinterpret_cast<Op*>(smem);  // [C][LDK] normalised, scaled q (qr for DiagonalATQ)
  Op* sK = sQ + C * LDK;                 // [C][LDK] read key k, later k ⊙ e^gamma
  Op* sKWb = sK + C * LDK;               // [C][LDK] write key kw (DiagonalATK; Diagonal decay: kw scaled)
  Op* sEnd = sKWb + (atk || diag ? C * LDK : 0);
  // Scalar or no decay: Tm [C][LDC], then the solve region (the v tile reuses it once Tm is formed).
  // Diagonal decay (intra_smem_bytes(atk, true)): the solve region without its scratch, then the
  // per-channel gamma [C][LDG]; P is staged in Tinv's place, gamma's region holds the solve's scratch
  // once the decayed tiles are out and then the v tile, and Tm takes Akk's place after the solve.
  // DiagonalATK with scalar or no decay (`atk_nd`, a third key tile: intra_smem_bytes(true, false)
  // keeps three blocks per SM): the solve region without its scratch; the tiles go out before the
  // solve, so the scratch lives in the q tile and the v tile in kw's; P is staged in Tinv's place and
  // Tm is formed in place of Tinv.
  // Diagonal decay with raw v rows (`lean`, intra_lean_smem_bytes(): three blocks per SM): gamma only at
  // each 16-row block's first and last rows ([8][KP] after Akk; GateRows), P straight to the workspace,
  // and once the decayed tiles are out, Tinv and the solve's scratch in the q tile. It has no v tile
  // (sV null) and no P staging (sPst would alias the q tile): both are used only without raw_v, and the
  // kernel returns after Tm with raw_v.
  // The quad layout (QUAD, intra_quad_smem_bytes(): four blocks per SM): the q and k tiles (and kw's with
  // DiagonalATK), nothing else. P goes from the accumulators straight to the workspace (blocked layout);
  // each warp writes its rows of Akk into its own (already read) rows of the q tile: the blocks left of
  // the diagonal in their first C columns (sAh, row stride LDK), the diagonal block in float32 in the
  // rows' tails (row stride LDK / 2 floats). After the products Tinv and the solve's scratch take the k
  // tile (kw's tile is out by then), Tm is formed in Tinv's place, and the kernel returns after Tm (no
  // v tile, no tiles out but gamma and kw).
  const bool atk_nd = atk && !diag, lean = LEAN;  // (LEAN is launched for diag && ca.raw_v only)
  const bool no_tm = diag || atk_nd || QUAD;  // (no Tm tile of its own)
  Op* sTm = no_tm ? nullptr : sEnd;                                      // [C][LDC]
  float* sAd = reinterpret_cast<float*>(no_tm ? sEnd : sEnd + C * LDC);  // [4][16][17] Akk's diagonal blocks
  // [C][LDH] Akk below the diagonal blocks; LDH its row stride, LDD the diagonal blocks' (in floats)
  __half* sAh = QUAD ? reinterpret_cast<__half*>(sQ) : reinterpret_cast<__half*>(sAd + 4 * 16 * 17);
  const int LDH = QUAD ? LDK : LDC, LDD = QUAD ? LDK / 2 : 17;
  float* sGb = lean ? reinterpret_cast<float*>(sAh + C * LDC) : nullptr;  // [8][KP] lean: gamma's block rows
  // [C][LDC] Tinv (lower block triangle), then [C][LDG] the per-channel gamma (Diagonal decay)
  __half* sTh = lean ? reinterpret_cast<__half*>(sQ) : QUAD ? reinterpret_cast<__half*>(sK) : sAh + C * LDC;
  float* sG = lean || QUAD ? nullptr : reinterpret_cast<float*>(sTh + C * LDC);
  __half* sXh = lean || QUAD ? sTh + C * LDC
                : diag ? reinterpret_cast<__half*>(sG) : atk_nd ? reinterpret_cast<__half*>(sQ) : sTh + C * LDC;
  Op* sV = QUAD ? nullptr : diag ? reinterpret_cast<Op*>(sG) : atk_nd ? sKWb : reinterpret_cast<Op*>(sAd);  // [C][LDV]
  Op* sPst = QUAD ? nullptr : diag || atk_nd ? reinterpret_cast<Op*>(sTh) : sTm;  // P's staging (QUAD: none)
  if (diag) sTm = reinterpret_cast<Op*>(sAh);
  if (atk_nd || QUAD) sTm = reinterpret_cast<Op*>(sTh);  // Tm = Tinv Diag(beta), formed element by element in place
  __shared__ __align__(16) float s_gam[C], s_gp[C], s_bp[C], s_eg[C];
  __shared__ __align__(16) float s_beta[C];  // read 16 bytes at a time when Tm is formed
  __shared__ __align__(16) float s_lbw[C + 4];  // the look-back's weights and product (lookback_weights)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t gc = blockIdx.x;
  int hv = blockIdx.y;
  if (ca.lookback) lookback_item(ca, &gc, &hv);
  const int h = hv / a.group;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) return;
  const int L = p.L;
  Op* sKW = atk ? sKWb : sK;
  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  const Tin* v = static_cast<const Tin*>(a.v);

  // The v rows are staged only after the solve: start bringing them into L2 now (one 128-byte line
  // per thread and step) so that the late stage_rows finds them there. (With raw_v the state pass
  // reads them instead.)
  if (!QUAD && !ca.raw_v) {
    const char* v0 = reinterpret_cast<const char*>(v + p.b * a.sv[0] + p.t0 * a.sv[1] + hv * a.sv[2]);
    const int lines = (a.V * int(sizeof(Tin)) + 127) / 128;
    const int64_t row_bytes = a.sv[1] * int64_t(sizeof(Tin));
    for (int e = tid; e < L * lines; e += kThreads)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(v0 + (e / lines) * row_bytes + (e % lines) * 128));
  }
  // Diagonal preconditioner: the head's center now, and channel tid's statistics entering the chunk
  // (load_ain) once the q and k rows' loads are in flight, so that their latency overlaps the staging
  // instead of stalling the statistics' scan below. The statistics come from precond_scan_kernel, of
  // which this kernel is a programmatic dependent launch on Hopper: it waits for it only there. (The
  // forward's look-back, ChunkArgs::lookback, forms them after the rows are normalised: lookback_ain.)
  float A_in = 0.f, center = 0.f;
  if (has_p && tid < a.K) center = load_gate(a.center, h, a.gate_dtype);
  auto load_ain = [&] {
    if (!has_p || ca.lookback) return;  // (the look-back forms A_in below)
    grid_dependency_wait();
    if (tid < a.K) A_in = ca.Ain[(gc * a.H + h) * KP + tid];
  };
  // Gates of the chunk's tokens; rows past L: g = 0, beta = 0 (they write nothing).
  if (tid < C) {
    float g = 0.f, be = 0.f, gp = 1.f, bp = 0.f;  // gp holds exp(g_p)
    if (tid < L) {
      const int64_t t = p.t0 + tid;
      if (a.decay == kDecayScalar) g = load_gate(a.g, p.b * a.sg[0] + t * a.sg[1] + hv * a.sg[2], a.gate_dtype);
      be = a.beta ? load_gate(a.beta, p.b * a.sbeta[0] + t * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype) : 1.f;
      if (has_p) {
        gp = expf(load_gate(a.g_p, p.b * a.sgp[0] + t * a.sgp[1] + h * a.sgp[2], a.gate_dtype));
        bp = load_gate(a.beta_p, p.b * a.sbp[0] + t * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
      }
    }
    s_gam[tid] = g, s_beta[tid] = be, s_gp[tid] = gp, s_bp[tid] = bp;
    if (ca.pg) {  // the warpgroup state pass forms the write keys (ChunkArgs::kw_state)
      float* pg = ca.pg + (gc * a.HV + hv) * 2 * C;
      pg[tid] = gp, pg[C + tid] = bp;
    }
  }
  // Diagonal decay: thread c scans channel c's gamma over the chunk (g = 0 past L and past K, so
  // row C - 1 holds gamma_C); s_gam stays 0 and the scalar factors below are 1.
  if (diag) {
    const int c = tid, rows = c < a.K ? L : 0;
    const int64_t g0 = p.b * a.sg[0] + p.t0 * a.sg[1] + hv * a.sg[2] + c;
    auto scan = [&](auto type) {  // the gate's element type chosen once, not per load
      using G = decltype(type);
      const G* gp = static_cast<const G*>(a.g) + g0;
      float gs = 0.f;
#pragma unroll 1
      for (int r0 = 0; r0 < C; r0 += 32) {  // 32 loads in flight per thread
        float gv[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) gv[u] = r0 + u < rows ? to_float(gp[(r0 + u) * a.sg[1]]) : 0.f;
#pragma unroll
        for (int u = 0; u < 32; ++u) {
          gs += gv[u];
          const int r = r0 + u;
          if (!lean)
            sG[r * LDG + c] = gs;
          else if (r % 16 == 0 || r % 16 == 15)
            sGb[gamma_block_row(r) * KP + c] = gs;
        }
      }
    };
    if (a.gate_dtype == 1)
      scan(__nv_bfloat16{});
    else if (a.gate_dtype == 2)
      scan(__half{});
    else
      scan(float{});
  }
  // Raw q, k, v rows, then q and k normalised in place (q also scaled).
  {
    const int64_t t0 = p.t0;
    const Tin* q0 = q + p.b * a.sq[0] + t0 * a.sq[1] + h * a.sq[2];
    const Tin* k0 = k + p.b * a.sk[0] + t0 * a.sk[1] + h * a.sk[2];
    if (sizeof(Tin) == 2 && ca.vec_qk) {  // both tiles' loads in flight at once (32 registers each)
      RowLoads<Tin, KP> rq, rk;
      load_rows(rq, q0, a.sq[1], L, a.K);
      load_rows(rk, k0, a.sk[1], L, a.K);
      load_ain();
      store_rows<Tin, Op, KP>(sQ, LDK, rq);
      store_rows<Tin, Op, KP>(sK, LDK, rk);
    } else {
      stage_rows<Tin, Op, KP>(sQ, LDK, q0, a.sq[1], L, a.K, ca.vec_qk);
      stage_rows<Tin, Op, KP>(sK, LDK, k0, a.sk[1], L, a.K, ca.vec_qk);
      load_ain();
    }
  }
  __syncthreads();
  {
    // Backward mode with `rq`: the inverse norms of the chunk's rows (one value head per key head writes).
    // Raw rows for the state pass (ca.rn): every row's inverse norm (rows past L are zero rows there).
    const bool inv = !QUAD && ca.rq && hv % a.group == 0;
    const int64_t row0 = a.cu_seqlens ? p.t0 : p.b * a.T + p.t0;
    float* rn = ca.rn ? ca.rn + (gc * a.HV + hv) * 2 * C : nullptr;
    normalise_rows(sQ, a.l2norm, a.scale, inv ? ca.rq + row0 * a.H + h : rn, inv ? a.H : 1, inv ? L : C);
    normalise_rows(sK, a.l2norm, 1.f, inv ? ca.rk + row0 * a.H + h : rn ? rn + C : nullptr, inv ? a.H : 1,
                   inv ? L : C);
  }
  if (warp == 0) {  // gamma: cumulative log decay within the chunk (warp scan, two tokens per lane)
    float g0 = s_gam[2 * lane], g1 = s_gam[2 * lane + 1];
    warp_scan_pairs(g0, g1, lane);
    s_gam[2 * lane] = g0, s_gam[2 * lane + 1] = g1;
  }
  if (has_p && ca.lookback && warp == 1) lookback_weights(s_gp, s_bp, s_lbw, lane);
  __syncthreads();
  if (tid < C) s_eg[tid] = __expf(s_gam[tid]);
  if (has_p && ca.lookback) A_in = lookback_ain(ca, gc, hv, h, p, sK, s_lbw);
  // Diagonal preconditioner: thread c scans channel c's statistics from the chunk's entry value.
  if (has_p) {
    const int c = tid;
    Op* out = (atk ? sKWb : sQ) + c;  // column c of kw (DiagonalATK) or qr (DiagonalATQ)
    if (c < a.K) {
      float A = A_in;
      const float log2_x = a.log_x * 1.44269504089f;
      // 8 rows at a time: the statistics' chain first, then 8 independent squashes. Rows past L keep A
      // (g_p = 0, beta_p = 0 there) and have k = q = 0, so their kw (qr) is 0.
#pragma unroll 1
      for (int r0 = 0; r0 < C; r0 += 8) {
        float kn[8], Ar[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) kn[u] = to_float(sK[(r0 + u) * LDK + c]);
        const Float8 e8(s_gp + r0), b8(s_bp + r0);  // the 8 rows' e^g_p and beta_p (broadcast loads)
#pragma unroll
        for (int u = 0; u < 8; ++u) Ar[u] = A = stat_step(A, e8[u], b8[u], kn[u]);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float M = squash_fast(Ar[u], center, log2_x, a.eps);
          Op* o = out + (r0 + u) * LDK;
          *o = from_float<Op>((atk ? kn[u] : to_float(*o)) * M);
        }
      }
    }
    if (atk && c >= a.K)  // columns past K of kw are zero (q's already are)
      for (int r = 0; r < C; ++r) out[r * LDK] = from_float<Op>(0.f);
  }
  __syncthreads();

  // Q (or qr) and KW to the workspace with the chunk's gamma (the state pass applies the decays to
  // its accumulator rows), then K ⊙ e^gamma in place for W. Diagonal decay: the decays are applied
  // here per channel, Q ⊙ e^gamma and KW ⊙ e^(gamma_C - gamma), from the tiles diag_decay_akk_p left
  // (Q, K scaled by e^(gamma - gamma_16a), KW by e^(gamma_16a+15 - gamma) in sKWb).
  const int64_t tile = (gc * a.HV + hv) * C * KP;
  auto tiles_out = [&] {
    Op* Qn = static_cast<Op*>(ca.Qn) + tile;
    Op* KWn = ca.KWn ? static_cast<Op*>(ca.KWn) + tile : nullptr;  // (none: raw_kw, kw_state)
    static_assert(kThreads == 128 && KP == 128, "each thread keeps its 8 channels");
    if (diag) {
      // Thread tid keeps channels c8 = 8 (tid % 16) .. + 7 and rows tid / 16 + 8 h of every 16-row
      // block: the block's factors e^gamma_16a and e^(gamma_C - gamma_16a+15) once, then its two rows
      // together (their loads in flight at once, their stores from different registers).
      const int c8 = (tid % 16) * 8;
#pragma unroll 1
      for (int a16 = 0; a16 < C; a16 += 16) {
        float fea[8], fez[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          fea[j] = __expf(gamma_row<LEAN>(sG, sGb, a16)[c8 + j]);
          fez[j] = __expf(gamma_row<LEAN>(sG, sGb, C - 1)[c8 + j] - gamma_row<LEAN>(sG, sGb, a16 + 15)[c8 + j]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = a16 + tid / 16 + 8 * h, at = ca.blocked ? blocked_at(r, c8) : r * KP + c8;
          uint4 xq = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
          uint4 xw = *reinterpret_cast<const uint4*>(sKWb + r * LDK + c8);
          uint4 xk = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
          uint32_t* pq = reinterpret_cast<uint32_t*>(&xq);
          uint32_t* pw = reinterpret_cast<uint32_t*>(&xw);
          uint32_t* pk = reinterpret_cast<uint32_t*>(&xk);
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            const uint32_t fa = pack2<Op>(fea[j], fea[j + 1]), fz = pack2<Op>(fez[j], fez[j + 1]);
            pq[j / 2] = mul2<Op>(pq[j / 2], fa);
            pk[j / 2] = mul2<Op>(pk[j / 2], fa);
            pw[j / 2] = mul2<Op>(pw[j / 2], fz);
          }
          *reinterpret_cast<uint4*>(Qn + at) = xq;
          *reinterpret_cast<uint4*>(KWn + at) = xw;
          *reinterpret_cast<uint4*>(sK + r * LDK + c8) = xk;
          if (ca.bwd) *reinterpret_cast<uint4*>(static_cast<Op*>(ca.Kn) + tile + r * KP + c8) = xk;
          if (ca.raw_v)  // K ⊙ e^gamma in W's place
            *reinterpret_cast<uint4*>(static_cast<Op*>(ca.W) + tile + at) = xk;
        }
      }
    }
#pragma unroll
    for (int e = tid; e < (diag || QUAD == kQuadIdentity ? 0 : C * KP / 8); e += kThreads) {  // (raw rows: none)
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8, at = ca.blocked ? blocked_at(r, c8) : r * KP + c8;
      if (!ca.raw_q) *reinterpret_cast<uint4*>(Qn + at) = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
      if (KWn) *reinterpret_cast<uint4*>(KWn + at) = *reinterpret_cast<const uint4*>(sKW + r * LDK + c8);
      if (bwd)  // the read keys
        *reinterpret_cast<uint4*>(static_cast<Op*>(ca.Kn) + tile + r * KP + c8) =
            *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
    }
    if (tid < C) ca.gam[(gc * a.HV + hv) * C + tid] = s_gam[tid];
    if (diag) {
      ca.egC[(gc * a.HV + hv) * KP + tid] = __expf(gamma_row<LEAN>(sG, sGb, C - 1)[tid]);
      return;
    }
    // No W: the state pass scales its own raw k rows (chunk_workspace allocates W by the same test).
    if (QUAD || (ca.raw_v && (ca.raw_q || ca.raw_kw))) return;
    __syncthreads();  // KW may be K itself
    for (int e = tid; e < C * KP / 8; e += kThreads) {
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8;
      alignas(16) Op xk[8];
      *reinterpret_cast<uint4*>(xk) = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
#pragma unroll
      for (int j = 0; j < 8; ++j) xk[j] = from_float<Op>(to_float(xk[j]) * s_eg[r]);
      *reinterpret_cast<uint4*>(sK + r * LDK + c8) = *reinterpret_cast<const uint4*>(xk);
      // raw_v without raw rows: K ⊙ e^gamma itself in W's place (blocked), for the state pass's K S
      if (ca.raw_v)
        *reinterpret_cast<uint4*>(static_cast<Op*>(ca.W) + tile + blocked_at(r, c8)) = *reinterpret_cast<const uint4*>(xk);
    }
  };

  // Akk = beta_i (K KW^T)_ij e^(gamma_i - gamma_j) (j < i) and P = (Q KW^T)_ij e^(gamma_i - gamma_j) (j <= i).
  const int m0 = warp * 16;
  // This warp's diagonal block of Akk (row stride LDD floats).
  auto diag_block = [&] { return QUAD ? reinterpret_cast<float*>(sQ + m0 * LDK + C) : sAd + warp * 272; };
  if (diag && ca.bwd) {  // backward mode: the undecayed rows for the gradient kernel
    Op* Qu = static_cast<Op*>(ca.Qu) + tile;
    Op* Ku = static_cast<Op*>(ca.Ku) + tile;
    Op* KWu = static_cast<Op*>(ca.KWu) + tile;
    for (int e = tid; e < C * KP / 8; e += kThreads) {
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8;
      *reinterpret_cast<uint4*>(Qu + r * KP + c8) = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
      *reinterpret_cast<uint4*>(Ku + r * KP + c8) = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
      if (atk) *reinterpret_cast<uint4*>(KWu + r * KP + c8) = *reinterpret_cast<const uint4*>(sKW + r * LDK + c8);
    }
    __syncthreads();  // diag_decay_akk_p scales the rows in place
  }
  if (diag) {
    GateRows gr;
    if (lean) {
      gr.g = static_cast<const char*>(a.g) +
             (p.b * a.sg[0] + p.t0 * a.sg[1] + hv * a.sg[2]) * (a.gate_dtype == 0 ? 4 : 2);
      gr.rs = a.sg[1], gr.dtype = a.gate_dtype, gr.L = L, gr.K = a.K;
    }
    Op* Pg = static_cast<Op*>(ca.P) + (gc * a.HV + hv) * C * C;
    diag_decay_akk_p<Op, LEAN>(sQ, sK, sKW, sKWb, sG, s_beta, a.online, ca.bwd, m0, sPst, sAd, sAh, sGb, gr, Pg);
    if (!lean) {  // (lean: P went straight to the workspace)
      __syncwarp();
      if (ca.bwd) times_beta_cols(sPst + m0 * LDC, s_beta);
      store_rows16(Pg, m0, C, sPst + m0 * LDC, LDC, C, ca.blocked);
    }
  } else {
    // The lower block triangle's ten 16 x 16 blocks, balanced over the warps (row block w alone would
    // give warp w w + 1 of them, and warp 3 four): block slot bs (< nbs) of warp w is block (row_of(bs),
    // col_of(bs)): warp 0 (0, 0), (3, 0), (3, 1); warp 1 (1, 0), (1, 1); warp 2 (2, 0), (2, 1), (2, 2);
    // warp 3 (3, 2), (3, 3). Each warp keeps its own diagonal block and writes the zeros right of it.
    const int nbs = warp == 0 || warp == 2 ? 3 : 2;
    auto row_of = [&](int bs) { return warp == 0 && bs > 0 ? 3 : warp; };
    auto col_of = [&](int bs) { return warp == 3 ? bs + 2 : warp == 0 ? (bs > 0 ? bs - 1 : 0) : bs; };
    float accA[6][4], accP[6][4];
#pragma unroll
    for (int i = 0; i < 6; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) accA[i][e] = accP[i][e] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t fk[4], fq[4], fk3[4], fq3[4];  // this warp's row block's fragments; warp 0: also row block 3's
      load_a(fk, sK, LDK, m0, k0);
      load_a(fq, sQ, LDK, m0, k0);
      if (warp == 0) {
        load_a(fk3, sK, LDK, 48, k0);
        load_a(fq3, sQ, LDK, 48, k0);
      }
#pragma unroll
      for (int bs = 0; bs < 3; ++bs) {
        if (bs >= nbs) break;
        const bool r3 = warp == 0 && bs > 0;
        uint32_t ak[4], aq[4], fb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) ak[u] = r3 ? fk3[u] : fk[u], aq[u] = r3 ? fq3[u] : fq[u];
        load_b(fb, sKW, LDK, 16 * col_of(bs), k0);
        if (online) {
          mma<Op>(accA[2 * bs], ak, fb);
          mma<Op>(accA[2 * bs + 1], ak, fb + 2);
        }
        mma<Op>(accP[2 * bs], aq, fb);
        mma<Op>(accP[2 * bs + 1], aq, fb + 2);
      }
    }
    Op* P = static_cast<Op*>(ca.P) + (gc * a.HV + hv) * C * C;
    // QUAD: P's pairs straight to the workspace (blocked: an n-tile's 16 rows are 256 contiguous bytes).
    auto p_at = [&](int i, int j) { return QUAD ? P + blocked_at(i, j & ~7) + (j & 7) : sPst + i * LDC + j; };
    // QUAD: every warp's q fragments are read (row block 3's by warps 0 and 3) before Akk's rows take their place.
    if (QUAD) __syncthreads();
    for (int nt = 2 * warp + 2; nt < 8; ++nt) {  // P's blocks right of this warp's diagonal block are zero
      const int j = acc_col(nt * 8, 0);
      store2(p_at(acc_row(m0, 0), j), 0.f, 0.f);
      store2(p_at(acc_row(m0, 2), j), 0.f, 0.f);
    }
    // The blocks left of the diagonal need no mask, the diagonal block (col_of = row_of) does.
#pragma unroll
    for (int bs = 0; bs < 3; ++bs) {
      if (bs >= nbs) break;
      const int ra = row_of(bs), bj = col_of(bs), r0 = 16 * ra;
      const float gi[2] = {s_gam[acc_row(r0, 0)], s_gam[acc_row(r0, 2)]};
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int nt = 2 * bs + t, j = acc_col(16 * bj + 8 * t, 0);
        const float gj0 = s_gam[j], gj1 = s_gam[j + 1];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = acc_row(r0, e);
          float d0 = __expf(gi[e / 2] - gj0), d1 = __expf(gi[e / 2] - gj1);
          if (bj == ra) d0 = j <= i ? d0 : 0.f, d1 = j + 1 <= i ? d1 : 0.f;
          store2(p_at(i, j), accP[nt][e] * d0, accP[nt][e + 1] * d1);  // (staged: copied below)
          if (!online) continue;
          // Diag(beta) Bm, or Bm Diag(beta) in backward mode (T2)
          float x0 = s_beta[bwd ? j : i] * accA[nt][e] * d0;
          float x1 = s_beta[bwd ? j + 1 : i] * accA[nt][e + 1] * d1;
          if (bj == ra) {  // (this warp's own diagonal block)
            float* sAdw = diag_block();
            x0 = j < i ? x0 : 0.f, x1 = j + 1 < i ? x1 : 0.f;
            sAdw[(i % 16) * LDD + j % 16] = x0;
            sAdw[(i % 16) * LDD + j % 16 + 1] = x1;
          } else {
            *reinterpret_cast<__half2*>(sAh + i * LDH + j) = __floats2half2_rn(x0, x1);
          }
        }
      }
    }
    if (!QUAD) {  // the staged rows of P out (row block 3's came from two warps)
      __syncthreads();
      if (bwd) times_beta_cols(sPst + m0 * LDC, s_beta);
      store_rows16(P, m0, C, sPst + m0 * LDC, LDC, C, ca.blocked);
    }
  }
  __syncthreads();
  if (diag || atk_nd) {  // the tiles out now: gamma's region (or the q tile) is the solve's scratch from here on
    tiles_out();
    __syncthreads();
  }

  // Tinv = (I + Akk)^{-1} (unit lower triangular): the 16 x 16 diagonal blocks by substitution in
  // float32 (warp w, lane = column), then, one row of blocks at a time, the blocks below them on
  // tensor cores (f16 operands, float32 accumulation; warp bj computes block (bi, bj)):
  // T[bi][bj] = -T[bi][bi] sum_{l=bj}^{bi-1} A[bi][l] T[l][bj].
  if (online) {
    if (lane < 16) {
      const float* Ad = diag_block();
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float s = i == lane ? 1.f : 0.f;
#pragma unroll
        for (int l = 0; l < i; ++l) s -= Ad[i * LDD + l] * x[l];
        x[i] = s;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) sTh[(warp * 16 + i) * LDC + warp * 16 + lane] = __float2half_rn(x[i]);
    }
    __syncthreads();
    __half* X = sXh + warp * 16 * 24;
    for (int bi = 1; bi < 4; ++bi) {
      if (warp < bi) {
        const int bj = warp;
        float acc[2][4] = {};
        for (int lb = bj; lb < bi; ++lb) {
          uint32_t fa[4], fb[4];
          load_a(fa, sAh, LDH, bi * 16, lb * 16);
          load_b_t(fb, sTh, LDC, lb * 16, bj * 16);
          mma<__half>(acc[0], fa, fb);
          mma<__half>(acc[1], fa, fb + 2);
        }
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 4; e += 2) store2(X + acc_row(0, e) * 24 + acc_col(8 * t, e), acc[t][e], acc[t][e + 1]);
        __syncwarp();
        float y[2][4] = {};
        uint32_t fa[4], fb[4];
        load_a(fa, sTh, LDC, bi * 16, bi * 16);
        load_b_t(fb, X, 24, 0, 0);
        mma<__half>(y[0], fa, fb);
        mma<__half>(y[1], fa, fb + 2);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 4; e += 2)
            store2(sTh + acc_row(bi * 16, e) * LDC + acc_col(bj * 16 + 8 * t, e), -y[t][e], -y[t][e + 1]);
        __syncwarp();
      }
      __syncthreads();
    }
  }
  // Tm = Tinv Diag(beta) (Offline: Diag(beta)); backward mode: Tm = T2 = Tinv (Offline: I), also
  // written to the workspace.
  // Eight entries per thread and step, read 16 bytes at a time (in place for atk_nd: the same slots).
  Op* T2 = bwd ? static_cast<Op*>(ca.T2) + (gc * a.HV + hv) * C * C : nullptr;
  Op* Tmw = ca.raw_v ? static_cast<Op*>(ca.Tm) + (gc * a.HV + hv) * C * C : nullptr;  // blocked, for the state pass
  static_assert(C * C / 8 % kThreads == 0, "whole steps");
#pragma unroll
  for (int e = tid; e < C * C / 8; e += kThreads) {
    const int i = e / (C / 8), j0 = (e % (C / 8)) * 8;
    // Tinv below the diagonal: groups of 8 columns left of i lie in blocks the solve wrote (a group
    // holding i too has exact zeros right of i and 1 at i); groups from i on hold 1 at i only.
    uint4 th = make_uint4(0, 0, 0, 0);
    if (online && j0 < i) th = *reinterpret_cast<const uint4*>(sTh + i * LDC + j0);
    const __half2* th2 = reinterpret_cast<const __half2*>(&th);
    const float4 b0 = *reinterpret_cast<const float4*>(s_beta + j0), b1 = *reinterpret_cast<const float4*>(s_beta + j0 + 4);
    const float bj[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    uint4 t8;
    uint32_t* t2 = reinterpret_cast<uint32_t*>(&t8);
#pragma unroll
    for (int q2 = 0; q2 < 4; ++q2) {
      float2 t = __half22float2(th2[q2]);
      const int j = j0 + 2 * q2;
      t.x = j == i ? 1.f : t.x, t.y = j + 1 == i ? 1.f : t.y;
      t2[q2] = bwd ? pack2<Op>(t.x, t.y) : pack2<Op>(t.x * bj[2 * q2], t.y * bj[2 * q2 + 1]);
    }
    *reinterpret_cast<uint4*>(sTm + i * LDC + j0) = t8;
    if (T2) *reinterpret_cast<uint4*>(T2 + i * C + j0) = t8;
    if (Tmw) *reinterpret_cast<uint4*>(Tmw + blocked_at(i, j0)) = t8;
  }
  __syncthreads();  // Tm is formed: the Akk / inverse region is free from here on
  if (!diag && !atk_nd) tiles_out();
  if (QUAD || ca.raw_v) return;  // the state pass makes W S and U from Tm, the k rows and the raw v rows
  {  // v rows into the (now free) Akk / inverse region
    const Tin* v0 = v + p.b * a.sv[0] + p.t0 * a.sv[1] + hv * a.sv[2];
    if (ca.Vpad == 64)
      stage_rows<Tin, Op, 64>(sV, LDV, v0, a.sv[1], L, a.V, ca.vec_v);
    else
      stage_rows<Tin, Op, 128>(sV, LDV, v0, a.sv[1], L, a.V, ca.vec_v);
  }
  __syncthreads();

  // U = Tm V and W = Tm (K ⊙ e^gamma): warp w's 16 rows, k over the chunk's C tokens.
  uint32_t fa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) load_a(fa[kk], sTm, LDC, m0, kk * 16);
  // Results go through this warp's 16 rows of the (no longer needed) q tile, then out 16 bytes at a time.
  Op* stage = sQ + m0 * LDK;
  tm_times<Op>(fa, sV, LDV, ca.Vpad, stage, static_cast<Op*>(ca.U) + (gc * a.HV + hv) * C * ca.Vpad, m0, ca.Vpad,
               ca.blocked);
  if (a.online) {
    __syncwarp();
    tm_times<Op>(fa, sK, LDK, KP, stage, static_cast<Op*>(ca.W) + tile, m0, KP, ca.blocked);
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
