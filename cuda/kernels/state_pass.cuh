/// @brief The chunkwise forward's sequential state pass on mma.sync (any tensor-core GPU; backward mode's checkpoints).
#pragma once

#include <cstdint>

#include "launch/chunk.cuh"
#include "ptx/pipe.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Starts the copy (NT threads, as copy_tile_async) of a chunk's row factors for the sequential passes
/// into dst: gamma (C floats) and after it, for raw rows, their inverse norms (2 C floats); with
/// Diagonal decay e^gamma_C (128 floats) instead. head_chunk: (global chunk) x HV + value head.
template <int NT, class Op>
__device__ __forceinline__ void copy_row_factors(Op* dst, const ChunkArgs& ca, int64_t head_chunk, bool diag) {
  const int64_t tile = head_chunk * C;
  if (diag)
    copy_tile_async<2 * KP, NT>(dst, 2 * KP, reinterpret_cast<const Op*>(ca.egC + head_chunk * KP), 2 * KP, 1);
  else
    copy_tile_async<2 * C, NT>(dst, 2 * C, reinterpret_cast<const Op*>(ca.gam + tile), 2 * C, 1);
  if (ca.rn) copy_tile_async<4 * C, NT>(dst + 2 * C, 4 * C, reinterpret_cast<const Op*>(ca.rn + 2 * tile), 4 * C, 1);
}

/// Per (sequence, value head, VT value columns): the sequential pass over the sequence's chunks, on
/// WARPS warps. The float32 state rows RW w .. RW w + RW - 1 (RW = 128 / WARPS) live in warp w's
/// accumulators, its operand copy in sS. In the C-row products warp w owns rows 16 (w % 4) .. + 15
/// and the value columns of group w / 4. The next chunks' tiles are copied while the current one is
/// computed: by a fifth warp with 4 compute warps (ProducerPipe), by the compute warps themselves
/// with 8. With CKPT (backward mode) it writes the state entering each chunk and the chunk's R (the
/// residuals r) instead of o.
template <class Tin, class Op, int VT, int WARPS, bool CKPT, int NBUF>
__global__ void __launch_bounds__(WARPS * 32 + (WARPS == 4 ? 32 : 0)) state_kernel(const ChunkArgs ca) {
  const RecArgs& a = ca.a;
  // With 4 compute warps, warp 4 copies the tiles (ProducerPipe, NBUF buffers); with 8 the compute
  // warps copy one chunk ahead themselves (NBUF = 2; a producer slows the B = 8 checkpointing pass).
  constexpr bool PROD = WARPS == 4;
  static_assert(PROD || NBUF == 2, "buffers");
  constexpr int THREADS = WARPS * 32;
  constexpr int LDV = VT + 8;
  constexpr int NT = VT / 8;                    // n-tiles of the state
  constexpr int RW = KP / WARPS, MT = RW / 16;  // state rows and m-tiles per warp
  constexpr int CG = WARPS / 4;                 // column groups of the C-row products
  constexpr int NTW = NT / CG;                  // their n-tiles per warp
  static_assert(NTW % 2 == 0 && MT >= 1, "tile split");
  constexpr int BUF = state_buffer_elems(VT);
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sBuf = reinterpret_cast<Op*>(smem);  // NBUF x {W, Q, KW [C][LDK], U [C][LDV], P [C][LDC], gamma [C] float}
  Op* sS = sBuf + NBUF * BUF;              // [KP][LDV]
  Op* sR = sS + KP * LDV;                  // [C][LDV] R = U - W S
  Op* sRs = sR + C * LDV;                  // [C][LDV] R ⊙ e^(gamma_C - gamma), zero past L

  const int warp = threadIdx.x >> 5;
  const bool diag = a.decay == kDecayDiagonal;
  const int n = blockIdx.z, hv = blockIdx.y, v0 = blockIdx.x * VT;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : 0, b = a.cu_seqlens ? 0 : n;

  auto issue = [&](int64_t ci, int bi, auto nt) {  // chunk ci into buffer bi, copied by nt threads
    constexpr int CT = decltype(nt)::value;
    Op* buf = sBuf + bi * BUF;
    const int64_t tile = ((first + ci) * a.HV + hv) * C;
    if (a.online) copy_tile_async<KP, CT>(buf, LDK, static_cast<const Op*>(ca.W) + tile * KP, KP, C);
    // q and k rows of the inputs (ChunkArgs::raw_q, raw_kw: 16-bit inputs, zero past the sequence),
    // else the intra kernel's tiles.
    const int rows = static_cast<int>(imin64(C, len - ci * C));
    const int64_t t = bos + ci * C, h = hv / a.group;
    if (ca.raw_q)
      copy_rows_zfill_async<CT>(buf + C * LDK, LDK,
                                static_cast<const Op*>(a.q) + b * a.sq[0] + t * a.sq[1] + h * a.sq[2], a.sq[1], rows);
    else
      copy_tile_async<KP, CT>(buf + C * LDK, LDK, static_cast<const Op*>(ca.Qn) + tile * KP, KP, C);
    if (ca.raw_kw)
      copy_rows_zfill_async<CT>(buf + 2 * C * LDK, LDK,
                                static_cast<const Op*>(a.k) + b * a.sk[0] + t * a.sk[1] + h * a.sk[2], a.sk[1], rows);
    else
      copy_tile_async<KP, CT>(buf + 2 * C * LDK, LDK, static_cast<const Op*>(ca.KWn) + tile * KP, KP, C);
    copy_tile_async<VT, CT>(buf + 3 * C * LDK, LDV, static_cast<const Op*>(ca.U) + tile * ca.Vpad + v0, ca.Vpad, C);
    copy_tile_async<C, CT>(buf + 3 * C * LDK + C * LDV, LDC, static_cast<const Op*>(ca.P) + tile * C, C, C);
    copy_row_factors<CT>(buf + 3 * C * LDK + C * LDV + C * LDC, ca, (first + ci) * a.HV + hv, diag);
    if (!PROD) cp_commit();
  };
  using Pipe = ProducerPipe<NBUF, THREADS>;
  typename Pipe::Slot slot;  // the current chunk's buffer
  if constexpr (PROD) {
    if (warp == WARPS) {  // the producer
      Pipe::produce(count, [&](int64_t ci, int bi) { issue(ci, bi, std::integral_constant<int, 32>{}); });
      return;
    }
  } else if (count > 0) {
    issue(0, 0, std::integral_constant<int, THREADS>{});
  }

  float S[MT][NT][4];
  // f(state element, its row, its global value column) for every accumulator element of this thread.
  auto each_state = [&](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(S[mt][nt][e], acc_row(RW * warp + 16 * mt, e), v0 + acc_col(8 * nt, e));
  };
  each_state([&](float& x, int row, int col) {
    x = (a.h0 && row < a.K && col < a.V) ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + row * a.sh0[2] + col] : 0.f;
    sS[row * LDV + col - v0] = from_float<Op>(x);
  });
  Tin* o = static_cast<Tin*>(a.o);
  const bool want_o = !CKPT || o != nullptr;  // backward mode: o too for a training forward (P holds P Diag(beta))
  const int m0 = 16 * (warp % 4), c0 = (warp / 4) * NTW * 8;
  // Backward mode: the gains of rows m0 + lane / 4 (+ 8) of chunk ci (0 past the sequence).
  auto load_gains = [&](int64_t ci, float* gains) {
    const int64_t t = bos + ci * C + acc_row(m0, 0);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const bool ok = ci * C + acc_row(m0, 0) + 8 * u < len;
      gains[u] = !ok      ? 0.f
                 : a.beta ? load_gate(a.beta, b * a.sbeta[0] + (t + 8 * u) * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype)
                          : 1.f;
    }
  };
  float gain_next[2] = {1.f, 1.f};
  if (CKPT && count > 0) load_gains(0, gain_next);
  for (int64_t ci = 0; ci < count; ++ci) {
    const int L = static_cast<int>(imin64(C, len - ci * C));
    if constexpr (PROD) {
      Pipe::wait_full(slot);
    } else if (ci + 1 < count) {
      issue(ci + 1, slot.buf ^ 1, std::integral_constant<int, THREADS>{});
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    sync_compute<THREADS>();  // also orders the previous chunk's sS writes before this chunk's reads
    const Op* sW = sBuf + slot.buf * BUF;
    const Op* sQ = sW + C * LDK;
    const Op* sKW = sW + 2 * C * LDK;
    const Op* sU = sW + 3 * C * LDK;
    const Op* sP = sU + C * LDV;
    const float* sG =
        reinterpret_cast<const float*>(sP + C * LDC);  // gamma of the chunk's tokens (Diagonal: e^gamma_C)
    const float* sRn = sG + C;                           // raw rows: inverse norms of q, then of k
    const float gl = diag ? 0.f : sG[L - 1], gC = __expf(gl);
    const int64_t vtile = ((first + ci) * a.HV + hv) * int64_t(ca.Vpad);  // (chunk, head) tile, in rows of Vpad
    if (CKPT) store_tile<VT, THREADS>(static_cast<Op*>(ca.S0) + vtile * KP + v0, ca.Vpad, sS, LDV, KP);
    // R = U - W S and Q S for rows m0 .. m0 + 15.
    float ws[NTW][4], acc_o[NTW][4];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ws[nt][e] = acc_o[nt][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t fw[4], fq[4];
      if (want_o) load_a(fq, sQ, LDK, m0, k0);
      if (a.online) load_a(fw, sW, LDK, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sS, LDV, k0, c0 + nt * 8);
        if (want_o) {
          mma<Op>(acc_o[nt], fq, fb);
          mma<Op>(acc_o[nt + 1], fq, fb + 2);
        }
        if (a.online) {
          mma<Op>(ws[nt], fw, fb);
          mma<Op>(ws[nt + 1], fw, fb + 2);
        }
      }
    }
    // Rows i of O get e^gamma_i (O = (Q ⊙ e^gamma) S + P R); R's copy for the state update gets
    // e^(gamma_C - gamma_i), zero past L.
    const int ra = acc_row(m0, 0), rb = ra + 8;
    // (Diagonal decay: the intra-chunk kernel applied both per channel to Q and KW.)
    // Raw rows (ChunkArgs::raw_q, raw_kw): their inverse norms (and q's scale) join these factors.
    const float eo[2] = {diag ? 1.f : __expf(sG[ra]) * (ca.raw_q ? sRn[ra] * a.scale : 1.f),
                         diag ? 1.f : __expf(sG[rb]) * (ca.raw_q ? sRn[rb] * a.scale : 1.f)};
    float es[2] = {ra < L ? (diag ? 1.f : __expf(gl - sG[ra]) * (ca.raw_kw ? sRn[C + ra] : 1.f)) : 0.f,
                   rb < L ? (diag ? 1.f : __expf(gl - sG[rb]) * (ca.raw_kw ? sRn[C + rb] : 1.f)) : 0.f};
    if (CKPT) {  // R = r here: the update's rows get the gains (loaded one chunk ahead)
      es[0] *= gain_next[0], es[1] *= gain_next[1];
      if (ci + 1 < count) load_gains(ci + 1, gain_next);
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = acc_row(m0, e), j = acc_col(c0 + 8 * nt, e);
        const float r0 = to_float(sU[i * LDV + j]) - ws[nt][e], r1 = to_float(sU[i * LDV + j + 1]) - ws[nt][e + 1];
        store2(sR + i * LDV + j, r0, r1);
        store2(sRs + i * LDV + j, r0 * es[e >> 1], r1 * es[e >> 1]);
        acc_o[nt][e] *= eo[e >> 1], acc_o[nt][e + 1] *= eo[e >> 1];
      }
    sync_compute<THREADS>();
    if (CKPT) store_tile<VT, THREADS>(static_cast<Op*>(ca.Rr) + vtile * C + v0, ca.Vpad, sR, LDV, C);
      // O += P R.
#pragma unroll
    for (int k0 = 0; k0 < (want_o ? C : 0); k0 += 16) {
      uint32_t fp[4];
      load_a(fp, sP, LDC, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sR, LDV, k0, c0 + nt * 8);
        mma<Op>(acc_o[nt], fp, fb);
        mma<Op>(acc_o[nt + 1], fp, fb + 2);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = acc_row(m0, e), col = v0 + acc_col(c0 + 8 * nt, e);
        if (want_o && i < L)
          write_pair(o + b * a.so[0] + (bos + ci * C + i) * a.so[1] + hv * a.so[2] + col, acc_o[nt][e],
                     acc_o[nt][e + 1], ca.pair_o, col < a.V, col + 1 < a.V);
      }
      // S <- e^gamma_C S + KW^T (R ⊙ e^(gamma_C - gamma)) (Diagonal decay: state row c times e^gamma_C[c]).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float d0 = diag ? sG[acc_row(RW * warp + 16 * mt, 0)] : gC;
      const float d1 = diag ? sG[acc_row(RW * warp + 16 * mt, 2)] : gC;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= e < 2 ? d0 : d1;
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        uint32_t fk[4];
        load_a_t(fk, sKW, LDK, RW * warp + 16 * mt, k0);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t fb[4];
          load_b_t(fb, sRs, LDV, k0, nt * 8);
          mma<Op>(S[mt][nt], fk, fb);
          mma<Op>(S[mt][nt + 1], fk, fb + 2);
        }
      }
    }
    sync_compute<THREADS>();  // every warp is done reading sS, sR, sRs and this chunk's buffer
    if constexpr (PROD) {
      Pipe::release(slot, ci, count);
      slot.next();
    } else {
      slot.buf ^= 1;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store2(sS + acc_row(RW * warp + 16 * mt, e) * LDV + acc_col(8 * nt, e), S[mt][nt][e], S[mt][nt][e + 1]);
  }
  if (a.hT)
    each_state([&](float& x, int row, int col) {
      if (row < a.K && col < a.V) a.hT[int64_t(n) * a.shT[0] + hv * a.shT[1] + row * a.shT[2] + col] = x;
    });
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
