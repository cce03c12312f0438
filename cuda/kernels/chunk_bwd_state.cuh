/// @brief The chunkwise backward's prep kernel and reverse state pass (steps 1 and 2 of launch/chunk_backward_launch.cuh).
#pragma once

#include <cstdint>

#include "launch/backward.cuh"
#include "launch/chunk.cuh"
#include "kernels/chunk_bwd_tiles.cuh"
#include "ptx/pipe.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

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

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
