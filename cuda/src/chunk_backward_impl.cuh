/// @brief The chunkwise backward on tensor cores (SPEC §3.8, §4): every decay, 16-bit operands, float32
/// accumulation, fixed-order reductions (deterministic). Included after chunk_impl.cuh.
///
/// Per chunk (C = 64 rows i, j; gamma the chunk-local cumulative gate, E = e^gamma, Ed = e^{gamma_L - gamma};
/// Bm_ij = e^{gamma_i - gamma_j} kn_i . kw_j (j < i); T2 = (I + Bm Diag(beta))^{-1}; P_ij = e^{gamma_i - gamma_j}
/// qr_i . kw_j (j <= i)), the forward is
///   r = T2 (V - (Kn ⊙ E) S_0),  O = (Qr ⊙ E) S_0 + P Diag(beta) r,  S_C = e^{gamma_L} S_0 + (KW ⊙ Ed)^T Diag(beta) r,
/// and with H = dS_C the backward is
///   dX = dv = Ub + Wb H,  Ub = T2^T Diag(beta) P^T dO,  Wb = T2^T (Diag(beta) KW ⊙ Ed),
///   dS_0 = e^{gamma_L} H + Qr^T (E ⊙ dO) - Kn^T (E ⊙ dX)            (online; offline: no dX term, r = V).
/// Kernels, after the forward's intra-chunk kernel (backward mode: T2 and Kn) and its state pass
/// (backward mode: S_0 and r of every chunk):
///   1. `bwd_prep_kernel` (chunk, value head): Ub, Wb and a copy of do;
///   2. `bwd_rev_kernel` (sequence, value head, value tile): chunks in reverse order, the state
///      gradient in float32 registers; writes dv and H of every chunk, and dh0;
///   3. `bwd_grad_kernel` (chunk, value head), with Aq = dO r^T, Ar = dX r^T masked and decayed to
///      Mq (j < i), Mr (j < i), the diagonal d_i = dO_i . r_i apart:
///        dqr = E ⊙ (dO S_0^T) + Mq Diag(beta) KW + d ⊙ beta ⊙ KW,   dkn = -E ⊙ (dX S_0^T) - Mr Diag(beta) KW,
///        Pr  = Ed ⊙ (r H^T) + Mq^T Qr - Mr^T Kn + d ⊙ Qr,           dkw = beta ⊙ Pr,  dbeta = rowsum(kw ⊙ Pr),
///        dgamma_i = qr_i . dqr_i + kn_i . dkn_i - kw_i . dkw_i (+ sum H ⊙ S_C at the last row) with the
///      gate-free terms (d, and the last row's H r) kept out of it, as the float32 backward does; dg
///      = suffix sums of dgamma;
///      Diagonal decay: gamma is a vector per row, E, Ed act per channel and every e^{gamma_i - gamma_j}
///      above is per channel. The forward's tiles carry the decays (Qr ⊙ E, Kn ⊙ E, KW ⊙ Ed: steps 1
///      and 2 then run as written with gamma = 0, H's rows decaying by e^{gamma_L} per channel); the
///      gradient kernel reads the undecayed tiles, splits e^{gamma_i - gamma_j} at the 16-row block
///      boundaries (as the forward's diag_decay_akk_p does), and sums dgamma per channel (dg per channel,
///      with a boundary term per channel);
///   4. unless 3 finishes dq and dk itself (Identity preconditioner, no GVA), per (chunk, key head),
///      thread = channel: `key_local_kernel` and `key_carry_kernel` (diagonal preconditioners) scan dA
///      in reverse through A_t = e^{g_p,t} A_{t-1} + beta_p,t kn_t^2, chunk-locally then across the
///      chunks; `key_apply_kernel` sums the group's key-side gradients, chains them through M, applies
///      the scanned dA (dk, dg_p, dbeta_p, dcenter's per-chunk part) and the L2 norm's backward.
#pragma once

#include "backward.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Element offset of (batch b, time t, head, channel c) in a tensor with strides s.
__device__ __forceinline__ int64_t at3(const int64_t* s, int64_t b, int64_t t, int64_t head) {
  return b * s[0] + t * s[1] + head * s[2];
}

/// Gain of token t (1 without gain), 0 for rows past the chunk.
__device__ __forceinline__ float gain_of(const RecArgs& a, const ChunkPos& p, int i, int hv) {
  if (i >= p.L) return 0.f;
  return a.beta ? load_gate(a.beta, at3(a.sbeta, p.b, p.t0 + i, hv), a.gate_dtype) : 1.f;
}

/// Copies `rows` rows of `cols` 16-bit elements (cols % 8 == 0, 16-byte aligned rows) between global
/// and shared memory (row strides sld, gld) with all the block's threads, 16 bytes per step.
template <class Op>
__device__ __forceinline__ void copy_tile(Op* dst, int64_t sld, const Op* src, int64_t gld, int rows, int cols) {
  const int pr = cols / 8;
  for (int e = threadIdx.x; e < rows * pr; e += blockDim.x) {
    const int r = e / pr, c8 = (e % pr) * 8;
    *reinterpret_cast<uint4*>(dst + r * sld + c8) = *reinterpret_cast<const uint4*>(src + r * gld + c8);
  }
}

/// Starts the asynchronous copy of `rows` rows of `cols` 16-bit elements (64 or 128) from global (row
/// stride gld) to shared memory (row stride sld) with all the block's NT threads (cp_commit / cp_wait).
template <int NT, class Op>
__device__ __forceinline__ void load_tile_async(Op* dst, int sld, const Op* src, int64_t gld, int rows, int cols) {
  if (cols == 64)
    copy_tile_async<64, NT>(dst, sld, src, gld, rows);
  else
    copy_tile_async<128, NT>(dst, sld, src, gld, rows);
}

/// dst[r][:] = f(r) src[r][:] over `rows` rows of COLS 16-bit elements (row stride ld, shared memory;
/// dst may be src), 16 bytes per step, with all the block's threads.
template <int COLS, class Op, class F>
__device__ __forceinline__ void scale_rows(Op* dst, const Op* src, int ld, int rows, F&& f) {
  constexpr int PR = COLS / 8;
  for (int e = threadIdx.x; e < rows * PR; e += blockDim.x) {
    const int r = e / PR, c8 = (e % PR) * 8;
    const float m = f(r);
    alignas(16) Op x[8];
    *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(src + r * ld + c8);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = from_float<Op>(to_float(x[j]) * m);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = *reinterpret_cast<const uint4*>(x);
  }
}

/// 1. Per (chunk, value head): Ub = T2^T Diag(beta) P^T dO and Wb = T2^T (Diag(beta) KW ⊙ Ed) over the
/// state pass's U and W, and do as a zero-padded 16-bit tile.
template <class Tin, class Op>
__global__ void __launch_bounds__(kThreads) bwd_prep_kernel(const ChunkArgs ca, const BwdArgs bw) {
  const RecArgs& a = ca.a;
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sT2 = reinterpret_cast<Op*>(smem);  // [C][LDC]
  Op* sP = sT2 + C * LDC;                 // [C][LDC]
  Op* sDO = sP + C * LDC;                 // [C][LDK] do, later the warps' output staging
  Op* sY = sDO + C * LDK;                 // [C][LDK] Diag(beta) P^T do
  Op* sKW = sY + C * LDK;                 // [C][LDK] Diag(beta) KW ⊙ Ed
  float* s_gam = reinterpret_cast<float*>(sKW + C * LDK);
  float* s_beta = s_gam + C;
  const int tid = threadIdx.x, warp = tid >> 5, m0 = 16 * warp;
  const int64_t gc = blockIdx.x;
  const int hv = blockIdx.y;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) return;
  const int64_t head = gc * a.HV + hv, Vp = ca.Vpad;
  if (tid < C) {
    s_gam[tid] = ca.gam[head * C + tid];
    s_beta[tid] = gain_of(a, p, tid, hv);
  }
  load_tile_async<kThreads>(sT2, LDC, static_cast<const Op*>(ca.T2) + head * C * C, C, C, C);
  load_tile_async<kThreads>(sP, LDC, static_cast<const Op*>(ca.P) + head * C * C, C, C, C);
  load_tile_async<kThreads>(sKW, LDK, static_cast<const Op*>(ca.KWn) + head * C * KP, KP, C, KP);
  cp_commit();
  const Tin* d_o = static_cast<const Tin*>(bw.d_o) + at3(bw.sdo, p.b, p.t0, hv);
  if (Vp == 64)
    stage_rows<Tin, Op, 64>(sDO, LDK, d_o, bw.sdo[1], p.L, a.V, ca.vec_do);
  else
    stage_rows<Tin, Op, 128>(sDO, LDK, d_o, bw.sdo[1], p.L, a.V, ca.vec_do);
  cp_wait<0>();
  __syncthreads();
  copy_tile(static_cast<Op*>(ca.dO) + head * C * Vp, Vp, sDO, LDK, C, int(Vp));
  const float gl = s_gam[p.L - 1];
  scale_rows<KP>(sKW, sKW, LDK, C,  // KW rows times beta Ed (zero past L)
                 [&](int r) { return r < p.L ? s_beta[r] * __expf(gl - s_gam[r]) : 0.f; });
  // Y = Diag(beta) P^T dO, rows m0 .. m0 + 15 (A = (P Diag(beta))^T: the workspace holds P Diag(beta)
  // stored [k][m]).
  {
    uint32_t fa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) load_a_t(fa[kk], sP, LDC, m0, kk * 16);
    rows_times<Op>(fa, sDO, LDK, int(Vp),
                   [&](int e, int n, float x, float y) { store2(sY + acc_row(m0, e) * LDK + acc_col(n, e), x, y); });
  }
  __syncthreads();  // Y and KWn ⊙ Ed complete; do is no longer read (its rows become staging)
  {
    uint32_t fa[4][4];  // A = T2^T (T2 is stored [k][m])
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) load_a_t(fa[kk], sT2, LDC, m0, kk * 16);
    Op* stage = sDO + m0 * LDK;
    tm_times<Op>(fa, sY, LDK, int(Vp), stage, static_cast<Op*>(ca.U) + head * C * Vp, m0, Vp, false);
    __syncwarp();
    tm_times<Op>(fa, sKW, LDK, KP, stage, static_cast<Op*>(ca.W) + head * C * KP, m0, KP, false);
  }
}

/// 2. Per (sequence, value head, VT value columns), chunks in reverse order on WARPS warps: the state
/// gradient H (float32, a block of rows and columns per warp, its operand copy in sH) starts at dhT; per chunk, H is
/// stored (the gradient leaving the chunk), dX = Ub + Wb H is written (dv and the workspace tile), and
/// H <- e^{gamma_L} H + Qr^T (E ⊙ dO) - Kn^T (E ⊙ dX). The previous chunk's tiles are copied while one
/// is computed; the do tile is scaled by E in place.
template <class Tin, class Op, int VT, int WARPS, int NBUF>
__global__ void __launch_bounds__(WARPS * 32 + (WARPS == 4 ? 32 : 0))
    bwd_rev_kernel(const ChunkArgs ca, const BwdArgs bw) {
  const RecArgs& a = ca.a;
  // With 4 compute warps, warp 4 copies the tiles (ProducerPipe, NBUF buffers); with 16 the compute
  // warps copy one chunk ahead themselves (NBUF = 2; a 17th warp would cap the registers at 120).
  constexpr bool PROD = WARPS == 4;
  static_assert(PROD || NBUF == 2, "buffers");
  constexpr int THREADS = WARPS * 32;
  constexpr int LDV = VT + 8;
  constexpr int NT = VT / 8;
  // The state: WR warps along its 128 rows (MT m-tiles each) times SG column groups (NTS n-tiles each).
  constexpr int RB = KP / 16, WR = WARPS < RB ? WARPS : RB, MT = RB / WR, SG = WARPS / WR, NTS = NT / SG;
  constexpr int CG = WARPS / 4;
  constexpr int NTW = NT / CG;
  static_assert(NTW % 2 == 0 && NTS % 2 == 0 && MT >= 1, "tile split");
  constexpr int BUF = bwd_rev_buffer_elems(VT);
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sBuf = reinterpret_cast<Op*>(smem);  // NBUF x {Wb, Qr, Kn [C][LDK], Ub, do [C][LDV], gamma [C] float}
  Op* sH = sBuf + NBUF * BUF;              // [KP][LDV]
  Op* sX = sH + KP * LDV;                  // [C][LDV] -E ⊙ dX

  const int warp = threadIdx.x >> 5;
  const int n = blockIdx.z, hv = blockIdx.y, v0 = blockIdx.x * VT;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : 0, b = a.cu_seqlens ? 0 : n;
  const int64_t Vp = ca.Vpad;
  const bool diag = a.decay == kDecayDiagonal;  // the tiles carry the decays; sG holds e^gamma_C per row

  auto issue = [&](int64_t ci, int bi, auto nt) {  // chunk ci into buffer bi, copied by nt threads
    constexpr int CT = decltype(nt)::value;
    Op* buf = sBuf + bi * BUF;
    const int64_t head = (first + ci) * a.HV + hv;
    copy_tile_async<KP, CT>(buf, LDK, static_cast<const Op*>(ca.W) + head * C * KP, KP, C);
    copy_tile_async<KP, CT>(buf + C * LDK, LDK, static_cast<const Op*>(ca.Qn) + head * C * KP, KP, C);
    if (a.online) copy_tile_async<KP, CT>(buf + 2 * C * LDK, LDK, static_cast<const Op*>(ca.Kn) + head * C * KP, KP, C);
    copy_tile_async<VT, CT>(buf + 3 * C * LDK, LDV, static_cast<const Op*>(ca.U) + head * C * Vp + v0, Vp, C);
    copy_tile_async<VT, CT>(buf + 3 * C * LDK + C * LDV, LDV, static_cast<const Op*>(ca.dO) + head * C * Vp + v0, Vp,
                            C);
    Op* dec = buf + 3 * C * LDK + 2 * C * LDV;
    if (diag)
      copy_tile_async<2 * KP, CT>(dec, 2 * KP, reinterpret_cast<const Op*>(ca.egC + head * KP), 2 * KP, 1);
    else
      copy_tile_async<2 * C, CT>(dec, 2 * C, reinterpret_cast<const Op*>(ca.gam + head * C), 2 * C, 1);
    if (!PROD) cp_commit();
  };
  using Pipe = ProducerPipe<NBUF, THREADS>;
  typename Pipe::Slot slot;  // the current chunk's buffer
  if constexpr (PROD) {
    if (warp == WARPS) {  // the producer, from the last chunk back
      Pipe::produce(count, [&](int64_t j, int bi) { issue(count - 1 - j, bi, std::integral_constant<int, 32>{}); });
      return;
    }
  } else if (count > 0) {
    issue(count - 1, 0, std::integral_constant<int, THREADS>{});
  }

  const int sr0 = (warp % WR) * MT * 16, sc0 = (warp / WR) * NTS * 8;  // this warp's state rows, columns
  float H[MT][NTS][4];
  auto each_state = [&](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(H[mt][nt][e], acc_row(sr0 + 16 * mt, e), v0 + acc_col(sc0 + 8 * nt, e));
  };
  each_state([&](float& x, int row, int col) {
    x = (bw.dhT && row < a.K && col < a.V) ? bw.dhT[int64_t(n) * bw.sdhT[0] + hv * bw.sdhT[1] + row * bw.sdhT[2] + col]
                                           : 0.f;
    sH[row * LDV + col - v0] = from_float<Op>(x);
  });
  Tin* dv = static_cast<Tin*>(bw.dv);
  const int m0 = 16 * (warp % 4), c0 = (warp / 4) * NTW * 8;
  for (int64_t ci = count - 1; ci >= 0; --ci) {
    const int L = static_cast<int>(imin64(C, len - ci * C));
    if constexpr (PROD) {
      Pipe::wait_full(slot);
    } else if (ci > 0) {
      issue(ci - 1, slot.buf ^ 1, std::integral_constant<int, THREADS>{});
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    sync_compute<THREADS>();
    const Op* sW = sBuf + slot.buf * BUF;
    const Op* sQr = sW + C * LDK;
    const Op* sKn = sW + 2 * C * LDK;
    const Op* sU = sW + 3 * C * LDK;
    Op* sDO = sBuf + slot.buf * BUF + 3 * C * LDK + C * LDV;
    const float* sG = reinterpret_cast<const float*>(sDO + C * LDV);
    const float gC = diag ? 1.f : __expf(sG[L - 1]);
    const int64_t head = (first + ci) * a.HV + hv;
    store_tile<VT, WARPS * 32>(static_cast<Op*>(ca.Hc) + head * KP * Vp + v0, Vp, sH, LDV, KP);
    if (!diag)  // E ⊙ do, read after the next barrier
      scale_rows<VT>(sDO, sDO, LDV, C, [&](int r) { return __expf(sG[r]); });
    // dX = Ub + Wb H for rows m0 .. m0 + 15.
    float acc[NTW][4];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t fw[4];
      load_a(fw, sW, LDK, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sH, LDV, k0, c0 + nt * 8);
        mma<Op>(acc[nt], fw, fb);
        mma<Op>(acc[nt + 1], fw, fb + 2);
      }
    }
    Op* dXg = static_cast<Op*>(ca.dX) + head * C * Vp + v0;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = acc_row(m0, e), j = acc_col(c0 + 8 * nt, e);
        const float x0 = to_float(sU[i * LDV + j]) + acc[nt][e], x1 = to_float(sU[i * LDV + j + 1]) + acc[nt][e + 1];
        const float me = diag ? -1.f : -__expf(sG[i]);
        store2(sX + i * LDV + j, me * x0, me * x1);
        store2(dXg + i * Vp + j, x0, x1);
        const int col = v0 + j;
        if (dv && i < L)
          write_pair(dv + b * bw.sdv[0] + (bos + ci * C + i) * bw.sdv[1] + hv * bw.sdv[2] + col, x0, x1, bw.pair_dv,
                     col < a.V, col + 1 < a.V);
      }
    sync_compute<THREADS>();
    // H <- e^{gamma_L} H + Qr^T (E ⊙ dO) + Kn^T (-E ⊙ dX).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) H[mt][nt][e] *= diag ? sG[acc_row(sr0 + 16 * mt, e)] : gC;
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        uint32_t fq[4], fk[4];
        load_a_t(fq, sQr, LDK, sr0 + 16 * mt, k0);
        if (a.online) load_a_t(fk, sKn, LDK, sr0 + 16 * mt, k0);
#pragma unroll
        for (int nt = 0; nt < NTS; nt += 2) {
          uint32_t fb[4];
          load_b_t(fb, sDO, LDV, k0, sc0 + nt * 8);
          mma<Op>(H[mt][nt], fq, fb);
          mma<Op>(H[mt][nt + 1], fq, fb + 2);
          if (a.online) {
            load_b_t(fb, sX, LDV, k0, sc0 + nt * 8);
            mma<Op>(H[mt][nt], fk, fb);
            mma<Op>(H[mt][nt + 1], fk, fb + 2);
          }
        }
      }
    }
    sync_compute<THREADS>();  // every warp is done reading sH, sX and this chunk's buffer
    if constexpr (PROD) {
      Pipe::release(slot, count - 1 - ci, count);
      slot.next();
    } else {
      slot.buf ^= 1;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store2(sH + acc_row(sr0 + 16 * mt, e) * LDV + acc_col(sc0 + 8 * nt, e), H[mt][nt][e], H[mt][nt][e + 1]);
  }
  if (bw.dh0)
    each_state([&](float& x, int row, int col) {
      if (row < a.K && col < a.V) bw.dh0[int64_t(n) * bw.sdh0[0] + hv * bw.sdh0[1] + row * bw.sdh0[2] + col] = x;
    });
}

/// Sum over the 4 lanes of a quad (the lanes holding one accumulator row), in a fixed order.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
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
  float* s_rho = s_diag + C;           // [C][G] row sums of kw ⊙ Ed (H r), rows < L - 1
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
    // (rows < L - 1) summed over the block's rows feeds the boundary term of dg per channel.
    float bs[NK][2];
#pragma unroll
    for (int nt = 0; nt < NK; ++nt) bs[nt][0] = bs[nt][1] = 0.f;
    each_x([&](int, int i, int nt, int e, int c) {
      const float gC = sG[(C - 1) * LDG + c], es = __expf(sG[m0 * LDG + c]);
      x1[nt][e] *= es;
      x2[nt][e] *= -es;
      if (i == L - 1) s_last[c] = x3[nt][e];
      if (i < L - 1) {
        bs[nt][e & 1] =
            fmaf(s_beta[i] * to_float(sKW[i * LDK + c]), x3[nt][e] * __expf(gC - sG[i * LDG + c]), bs[nt][e & 1]);
        x3[nt][e] *= __expf(gC - sG[(m0 + 15) * LDG + c]);
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
    // X3 (gate-free: kept out of dgamma); rho_i = kw_i . X3_i (rows < L - 1) feeds the boundary term.
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
        rho[hr] = fmaf(to_float(sKW[i * LDK + c]), x3[nt][e], rho[hr]);
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
  // middle one, per channel, scales the B fragments (<= 1 for b < a; the diagonal block b = a, up to
  // e^spread, only when it spreads by <= kDiagSpread, else it is summed elementwise below).
  const int ab = m0 / 16;
  const bool dfast = !DIAG || s_fast[ab];
  const Op* sB3k = DIAG ? sKs : sKn;
  const Op* sB3q = DIAG ? sQs : sQr;
  // Column of this lane's B fragments in n-tile nt; middle factor e^(gamma_s - gamma_e) on both registers.
  auto mid = [&](uint32_t* f, int nt, int s_row, int e_row) {
    if constexpr (DIAG) {
      const int c = ck0 + 8 * nt + (lane >> 2);
      const float m0f = __expf(sG[s_row * LDG + c] - sG[e_row * LDG + c]);
      const float m1f = __expf(sG[s_row * LDG + c + 8] - sG[e_row * LDG + c + 8]);
      const uint32_t p0 = pack2<Op>(m0f, m0f), p1 = pack2<Op>(m1f, m1f);
      f[0] = mul2<Op>(f[0], p0), f[1] = mul2<Op>(f[1], p0), f[2] = mul2<Op>(f[2], p1), f[3] = mul2<Op>(f[3], p1);
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
        mid(fb, nt, m0, k0 + 15);
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
        if (online) {
          load_b_t(fb, sB3k, LDK, k0, ck0 + nt * 8);
          mid(fb, nt, k0, m0 + 15);
          mma<Op>(x3[nt], frt, fb);
          mma<Op>(x3[nt + 1], frt, fb + 2);
        }
        load_b_t(fb, sB3q, LDK, k0, ck0 + nt * 8);
        mid(fb, nt, k0, m0 + 15);
        mma<Op>(x3[nt], fqt, fb);
        mma<Op>(x3[nt + 1], fqt, fb + 2);
      }
    }
  }
  if constexpr (DIAG) {
    // The row factors, then (strong decay) the diagonal block elementwise from the undecayed tiles.
    each_x([&](int, int i, int nt, int e, int c) {
      const float gi = sG[i * LDG + c];
      const float us = __expf(gi - sG[m0 * LDG + c]);
      x1[nt][e] *= us;
      x2[nt][e] *= us;
      x3[nt][e] *= __expf(sG[(m0 + 15) * LDG + c] - gi);
      if (dfast) return;
      for (int j = m0; j < i; ++j) {
        const float f = __expf(gi - sG[j * LDG + c]) * s_beta[j] * to_float(sKW[j * LDK + c]);
        x1[nt][e] = fmaf(to_float(sMq[i * LDC + j]), f, x1[nt][e]);
        if (online) x2[nt][e] = fmaf(to_float(sMr[i * LDC + j]), f, x2[nt][e]);
      }
      for (int l = i + 1; l < m0 + 16; ++l) {
        float y = to_float(sMq[l * LDC + i]) * to_float(sQr[l * LDK + c]);
        if (online) y = fmaf(to_float(sMr[l * LDC + i]), to_float(sKn[l * LDK + c]), y);
        x3[nt][e] = fmaf(y, __expf(sG[l * LDG + c] - gi), x3[nt][e]);
      }
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
        const float dgam = qr * x1[nt][e] + kn * dkn - kw * bi * x3[nt][e];
        if constexpr (DIAG)
          sDG[i * LDG + c] = ok ? dgam : 0.f;
        else
          dgr[hr] += dgam;
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
    // Lane l owns rows 2l, 2l + 1: the boundary term (e^{gamma_L} Σ H ⊙ S_0 + Σ_{i < L-1} beta_i rho_i)
    // by a fixed shuffle tree, then dg_i = boundary + Σ_{j >= i} dgamma_j by a reverse lane scan.
    const int i0 = 2 * lane, i1 = i0 + 1;
    float b =
        (i0 < L - 1 ? s_beta[i0] * row_sum(s_rho, i0) : 0.f) + (i1 < L - 1 ? s_beta[i1] * row_sum(s_rho, i1) : 0.f);
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
/// at 80 registers spill more and measured slower).
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

template <class Tin, class Op, int VT, int WARPS = 4, int NBUF = 2>
cudaError_t launch_rev(const ChunkArgs& ca, const BwdArgs& bw, cudaStream_t stream) {
  constexpr size_t bytes = bwd_rev_smem_bytes(VT, NBUF);
  static const cudaError_t set = allow_smem(bwd_rev_kernel<Tin, Op, VT, WARPS, NBUF>, bytes);
  if (set != cudaSuccess) return set;
  const dim3 grid(ca.Vpad / VT, ca.a.HV, ca.a.N);
  bwd_rev_kernel<Tin, Op, VT, WARPS, NBUF><<<grid, WARPS * 32 + (WARPS == 4 ? 32 : 0), bytes, stream>>>(ca, bw);
  return cudaGetLastError();
}

template <class Tin, class Op>
cudaError_t launch_bwd_all(const ChunkArgs& ca, const BwdArgs& bw, cudaStream_t stream) {
  const RecArgs& a = ca.a;
  if (ca.chunk_bound == 0) return cudaSuccess;
  const char* impl = nullptr;
  // The intra-chunk kernel and state pass in backward mode, unless a training forward ran them.
  cudaError_t e = ca.saved ? cudaSuccess : launch_all<Tin, Op>(ca, stream, &impl);
  if (e != cudaSuccess) return e;
  const dim3 tiles(static_cast<unsigned>(ca.chunk_bound), a.HV);
  static const cudaError_t set_prep = allow_smem(bwd_prep_kernel<Tin, Op>, bwd_prep_smem_bytes());
  if (set_prep != cudaSuccess) return set_prep;
  bwd_prep_kernel<Tin, Op><<<tiles, kThreads, bwd_prep_smem_bytes(), stream>>>(ca, bw);
  int sms = 132, dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t heads = int64_t(a.N) * a.HV;
  const size_t smem = chunk_max_smem();
  if (ca.Vpad == 128 && heads >= sms * 9 / 10 && bwd_rev_smem_bytes(128) <= smem)
    e = launch_rev<Tin, Op, 128, 16>(ca, bw, stream);
  else if (heads * (ca.Vpad / 64) >= sms && bwd_rev_smem_bytes(64) <= smem)
    e = launch_rev<Tin, Op, 64>(ca, bw, stream);
  else if (heads * (ca.Vpad / 32) >= sms && bwd_rev_smem_bytes(32) <= smem)
    e = launch_rev<Tin, Op, 32>(ca, bw, stream);
  else if (bwd_rev_smem_bytes(16, 3) <= smem)  // three buffers (the producer two chunks ahead) where they fit
    e = launch_rev<Tin, Op, 16, 4, 3>(ca, bw, stream);
  else
    e = launch_rev<Tin, Op, 16>(ca, bw, stream);
  if (e != cudaSuccess) return e;
  if (a.decay == kDecayDiagonal) {
    static const cudaError_t set = allow_smem(bwd_grad_kernel<Tin, Op, true>, bwd_grad_smem_bytes());
    if (set != cudaSuccess) return set;
    bwd_grad_kernel<Tin, Op, true><<<tiles, kGradThreads, bwd_grad_smem_bytes(), stream>>>(ca, bw);
  } else {
    static const cudaError_t set = allow_smem(bwd_grad_kernel<Tin, Op, false>, bwd_grad_smem_bytes());
    if (set != cudaSuccess) return set;
    bwd_grad_kernel<Tin, Op, false><<<tiles, kGradThreads, bwd_grad_smem_bytes(), stream>>>(ca, bw);
  }
  if (fused_key_grads(bw)) return cudaGetLastError();
  // The key gradients per chunk: preconditioner chain, statistics' reverse scan, L2 norm.
  const dim3 keys(static_cast<unsigned>(ca.chunk_bound), a.H);
  if (a.precond == kPrecondATK)
    key_local_kernel<Tin, true><<<keys, kThreads, 0, stream>>>(ca, bw);
  else if (a.precond == kPrecondATQ)
    key_local_kernel<Tin, false><<<keys, kThreads, 0, stream>>>(ca, bw);
  if (a.precond != kPrecondIdentity) key_carry_kernel<<<dim3(a.H, a.N), bw.Kp, 0, stream>>>(ca, bw);
  if (a.precond == kPrecondATK)
    key_apply_kernel<Tin, kPrecondATK><<<keys, kThreads, 0, stream>>>(ca, bw);
  else if (a.precond == kPrecondATQ)
    key_apply_kernel<Tin, kPrecondATQ><<<keys, kThreads, 0, stream>>>(ca, bw);
  else
    key_apply_kernel<Tin, kPrecondIdentity><<<keys, kThreads, 0, stream>>>(ca, bw);
  return cudaGetLastError();
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk

namespace dgps::cuda::kernels {

template <class Tin>
cudaError_t launch_chunk_backward(const ChunkArgs& c, const BwdArgs& b, cudaStream_t stream) {
  using Op = std::conditional_t<std::is_same_v<Tin, __half>, __half, __nv_bfloat16>;
  return chunk::launch_bwd_all<Tin, Op>(c, b, stream);
}

}  // namespace dgps::cuda::kernels
