/// @brief The chunkwise forward's sequential state pass on Hopper's warpgroup products (wgmma, bulk and tensor copies).
#pragma once

#include <cstdint>

#include <cuda.h>  // CUtensorMap

#include "launch/chunk.cuh"
#include "ptx/pipe.cuh"
#include "kernels/precond_stats.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"
#include "ptx/wgmma.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Starts the asynchronous copy (threads 0 .. NT - 1) of a chunk's C rows of COLS 16-bit elements from
/// global memory (row stride gld) into a blocked tile at dst (wgmma.cuh; column groups of kWgColGroup
/// bytes): eight consecutive threads copy 16 consecutive bytes of one row each, into eight different
/// bank groups. Rows from `valid` on are zero-filled and nothing is read for them. Each thread steps
/// one source pointer; its destination offsets are compile-time constants past its own.
template <int COLS, int NT, class Op>
__device__ __forceinline__ void copy_blocked_async(unsigned char* dst, const Op* src, int64_t gld, int valid) {
  constexpr int PR = COLS / 8, RPP = NT / PR, RG = PR * kWgColGroup;  // RPP rows per pass
  static_assert(NT % PR == 0 && RPP % 8 == 0 && C % RPP == 0, "whole row groups per pass");
  const int t = threadIdx.x, r0 = t / PR, j = t % PR;
  const Op* s = src + r0 * gld + 8 * j;
  const int64_t step = RPP * gld;
  dst += (r0 / 8) * RG + (r0 % 8) * 16 + j * kWgColGroup;
#pragma unroll
  for (int r = 0; r < C; r += RPP, s += step) {
    const bool ok = r + r0 < valid;
    cp_async16_zfill(dst + (r / 8) * RG, ok ? s : src, ok ? 16 : 0);
  }
}

/// Starts the asynchronous copy (NT threads, NT a multiple of C) of a chunk's C rows of 128 16-bit
/// elements (row stride gld) into a packed blocked tile at dst (column groups of C rows x 16 bytes):
/// thread t copies row t % C of column groups t / C, t / C + NT / C, ... Rows from `valid` on are
/// zero-filled and nothing is read for them. (The warpgroup state pass's fallback for a sequence's
/// last, partial chunk of packed sequences, whose rows past its end the tensor copy would read from
/// the next sequence.)
template <int NT, class Op>
__device__ __forceinline__ void copy_packed_async(unsigned char* dst, const Op* src, int64_t gld, int valid) {
  static_assert(NT % C == 0, "whole rows per pass");
  const int r = threadIdx.x % C;
  const bool ok = r < valid;
#pragma unroll
  for (int grp = threadIdx.x / C; grp < KP / 8; grp += NT / C)
    cp_async16_zfill(dst + grp * C * 16 + r * 16, ok ? src + r * gld + 8 * grp : src, ok ? 16 : 0);
}

/// state_wg_kernel's compile-time paths (its MODE bits): Diagonal decay, raw v rows, the write keys formed
/// in the pass (ChunkArgs::kw_state).
constexpr int kWgDiag = 1, kWgRawV = 2, kWgKW = 4;

/// The forward's sequential pass (state_kernel without backward mode) on Hopper's warpgroup products
/// (sm_90a; wgmma.cuh), for 64 x WGS value columns. It keeps the transposed state: warpgroup g holds
/// S^T for value columns 64 g .. 64 g + 63 (64 x 128, float32) in its accumulators, so every product
/// of the chunk takes its A operand from registers (an accumulator converted to 16 bits is an A
/// fragment) and its B operand from the chunk's tiles, and nothing the chain produces goes through
/// shared memory:
///   R^T = U^T - S^T W^T and O^T = S^T Q^T (8 + 8 products of 64 x 64 x 16),
///   O^T <- O^T Diag(e^gamma) + R^T P^T (4) and S^T <- e^gamma_C S^T + (R^T Diag(e^(gamma_C - gamma))) KW
///   (4 of 64 x 128 x 16).
/// The next chunk's tiles are copied while the current one is computed (two buffers): thread 0 issues
/// one bulk copy per tile the intra-chunk kernel wrote blocked (W, Q, KW, P, U, the row factors),
/// completing on the buffer's mbarrier. Raw q and k rows (ChunkArgs::raw_q, raw_kw) come by tensor
/// copies through the maps tq and tk (ChunkArgs::tma_rows; a packed sequence's last, partial chunk by
/// cp.async), or else by every thread (cp.async) into padded column groups.
/// With ChunkArgs::raw_v (Online, V = 128, 128 columns) the intra-chunk kernel wrote the solve Tm instead
/// of W and U, and R^T comes from the k rows and the raw v rows (map tv over v; raw k through tk):
///   Z^T = S^T K^T (8 products, K the raw k rows), Y^T = V^T - Z^T Diag(e^gamma rn_k) in registers,
///   R^T = Y^T Tm^T (4 more products, A = Y^T from registers), since W S = Tm Diag(e^gamma) K S;
/// without raw rows (kg) K is the intra-chunk kernel's K ⊙ e^gamma in W's place and Y^T = V^T - Z^T.
/// Split state pass (ChunkArgs::split; 128 columns with raw_v): block z runs segment z % segments of
/// sequence z / segments. With TR (pass 1, segments but the last) block x = 0 starts from S = I and
/// reads no v rows (its state at the segment's end is the segment's transition A), x = 1 from S = 0
/// (the offset B); neither forms O, so no q rows and no P are copied; each writes S^T to Tseg. Without
/// TR (pass 2) each segment starts from Sseg (split_scan_kernel's) and the last one writes hT. Packed
/// sequences (cu_seqlens) have as many segments as their chunks need (split_last_segment); the blocks of
/// the others return at once.
/// O^T leaves through a staging tile (stmatrix, transposed to token rows) written 16 bytes per thread
/// where o's rows allow it (ChunkArgs::vec_o, 16-bit o), else element by element.
/// MODE (compile-time paths, so that a launch issues no code of the others): kWgDiag for Diagonal
/// decay, kWgRawV for raw v rows (ChunkArgs::raw_v; 128 columns), kWgKW for the write keys formed in the
/// pass (ChunkArgs::kw_state: a third warpgroup forms them while the two compute warpgroups run the
/// chain); the launcher picks it (launch_state_wg).
template <class Tin, class Op, int WGS, bool TR = false, int MODE = TR ? kWgRawV : 0>
__global__ void __launch_bounds__(WGS * 128 + (MODE & kWgKW ? 128 : 0), 1)
    state_wg_kernel(const ChunkArgs ca, const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                    const __grid_constant__ CUtensorMap tv) {
#if DGPS_WGMMA
  const RecArgs& a = ca.a;
  constexpr int VT = 64 * WGS, NT = WGS * 128;
  constexpr int CGP = kWgColGroup;   // column group of the raw rows' tiles
  constexpr int RGK = KP / 8 * CGP;  // and their row group
  constexpr int CGB = C * 16;        // column group of the packed tiles (row group: 128 bytes)
  constexpr int BUF = wg_buffer_bytes(VT);
  constexpr int UOFF = wg_u_off(), POFF = wg_p_off(VT), GOFF = wg_g_off(VT), QOFF = wg_q_off(VT), KWOFF = wg_kw_off(VT);
  constexpr int TMOFF = wg_tm_off(VT), OOFF = wg_o_off(VT);
  extern __shared__ __align__(128) unsigned char smem[];
  // The warp index through a shuffle: ptxas then knows it is uniform, and the products are not on a
  // divergent path (which would serialise them).
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), g = warp / 4;
  const int m0 = 16 * (warp % 4), wt = threadIdx.x % 128;
  float* s_eo = reinterpret_cast<float*>(smem + 2 * BUF) + g * 3 * C;  // the warpgroup's row factors of O
  float* s_es = s_eo + C;                                              // of R's copy for the update
  float* s_ez = s_es + C;                                              // and of K's rows in Z (raw_v)
  const uint32_t bar0 = smem_addr(smem + 2 * BUF + sizeof(float) * 3 * C * WGS);  // buffer b's mbarrier: bar0 + 8 b
  const uint32_t barw0 = bar0 + 16;  // kw_state: buffer b's write-key inputs' mbarrier, barw0 + 8 b
  // Diagonal decay and raw v rows at compile time (MODE): the code of the paths a launch does not take
  // would otherwise be issued under false predicates.
  constexpr bool diag = MODE & kWgDiag, rv = MODE & kWgRawV, kwf = MODE & kWgKW;
  static_assert(!kwf || (rv && !diag && WGS == 2), "kw_state: raw rows, 128 columns");
  const bool raw = ca.raw_q || ca.raw_kw;
  // raw_v: the raw v rows in U's place; Z's k rows are KW's tile when that is raw k (raw_kw), raw k rows
  // copied into W's place when q's rows are raw but KW is not k (rk), or else the intra-chunk kernel's
  // K ⊙ e^gamma (normalised and decayed already) in W's place (kg).
  // (128 columns only: the host sets raw_v with 128-column tiles, and v's tile is then one packed key tile.)
  const bool rk = rv && raw && !ca.raw_kw, kg = rv && !raw;
  static_assert(!rv || 2 * C * VT == kWgPacked, "raw v rows: a 128-column v tile is one packed key tile");
  static_assert(!TR || rv, "the split pass runs 128-column tiles with raw v rows");
  // Chunk ci's raw rows by cp.async (its copies then need a proxy fence and a barrier before the products)?
  auto rows_by_threads = [&](int rows) { return (raw || rv) && (!ca.tma_rows || (a.cu_seqlens && rows < C)); };
  // Split pass: segment `seg` of sequence n (TR: part 0 the transition, 1 the offset); TR reads the q
  // rows, P and (part 0) v rows not at all.
  const bool split = ca.split > 1;
  const int segs = split ? ca.split - TR : 1, n = blockIdx.z / segs, seg = blockIdx.z % segs, hv = blockIdx.y;
  const int part = TR ? blockIdx.x : 0, v0 = (TR ? 0 : blockIdx.x * VT) + 64 * g;  // the warpgroup's first column
  const bool need_v = !TR || part == 1;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t c0 = split ? seg * ca.seg_chunks : 0, cend = split ? imin64(count, c0 + ca.seg_chunks) : count;
  // Packed sequences have `split` segments at most (the longest possible): a segment past this sequence's
  // chunks has nothing to do, and pass 1 skips the sequence's last segment too (split_last_segment).
  if (split && (TR ? seg >= split_last_segment(ca, count) : seg > split_last_segment(ca, count))) return;
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : 0, b = a.cu_seqlens ? 0 : n;
  if (!a.online) {  // Offline solve: W's tiles stay zero (never copied), so R = U
    for (int e = threadIdx.x; e < 2 * kWgPacked / 16; e += NT)
      *reinterpret_cast<uint4*>(smem + (e / (kWgPacked / 16)) * BUF + (e % (kWgPacked / 16)) * 16) = uint4{};
  }
  if (threadIdx.x == 0) {
    wg::bar_init(bar0);
    wg::bar_init(bar0 + 8);
    wg::bar_init(barw0);
    wg::bar_init(barw0 + 8);
  }
  __syncthreads();
  // Bytes of one chunk's bulk copies (the same for every chunk).
  const uint32_t bulk_bytes = (a.online && (!rv || kg) ? kWgPacked : 0) + (rv ? 2 * C * C : 2 * C * VT) +
                              (TR ? 0 : 2 * C * C) + (diag ? 4 * KP : 4 * C + (ca.rn && !kwf ? 8 * C : 0)) +
                              (ca.raw_q || TR ? 0 : kWgPacked) + (ca.raw_kw || kwf ? 0 : kWgPacked);
  // kw_state: the write keys' inputs (the raw k rows where a tensor copy brings them, the rows' inverse
  // norms, the statistics entering the chunk, the rows' e^g_p and beta_p) are issued first and complete
  // on their own mbarrier, so that the KW warpgroup starts before the chunk's other tiles have landed.
  const uint32_t kw_bytes = 8 * C + kWgFactorBytes - kWgAinOff;
  const bool rq = ca.raw_q && !TR, rvc = rv && need_v;  // raw q rows, raw v rows copied
  auto issue = [&](int64_t ci, int bi) {  // chunk ci into buffer bi
    unsigned char* buf = smem + bi * BUF;
    const int64_t hc = (first + ci) * a.HV + hv, tile = hc * C;
    const int rows = static_cast<int>(imin64(C, len - ci * C));
    const int64_t t = bos + ci * C, h = hv / a.group;
    const bool by_threads = rows_by_threads(rows);
    if (by_threads) {
      const Op* q0 = static_cast<const Op*>(a.q) + b * a.sq[0] + t * a.sq[1] + h * a.sq[2];
      const Op* k0 = static_cast<const Op*>(a.k) + b * a.sk[0] + t * a.sk[1] + h * a.sk[2];
      const Op* x0 = static_cast<const Op*>(a.v) + b * a.sv[0] + t * a.sv[1] + hv * a.sv[2];  // raw_v: VT = 128
      if (ca.tma_rows) {
        if (rq) copy_packed_async<NT>(buf + QOFF, q0, a.sq[1], rows);
        if (ca.raw_kw) copy_packed_async<NT>(buf + KWOFF, k0, a.sk[1], rows);
      } else {
        if (rq) copy_blocked_async<KP, NT>(buf + QOFF, q0, a.sq[1], rows);
        if (ca.raw_kw) copy_blocked_async<KP, NT>(buf + KWOFF, k0, a.sk[1], rows);
      }
      // W's and U's places hold packed tiles only (a padded one would overrun them).
      if (rk) copy_packed_async<NT>(buf, k0, a.sk[1], rows);
      if (rvc) copy_packed_async<NT>(buf + UOFF, x0, a.sv[1], rows);
    }
    cp_commit();
    if (threadIdx.x == 0) {
      const uint32_t bar = bar0 + 8 * bi, dst = smem_addr(buf);
      const int ti = static_cast<int>(t), hi = static_cast<int>(h), bn = static_cast<int>(b);  // tensor coordinates
      if (kwf) {  // (the norms of k (with q's) are the write keys' inputs: copied here, not below)
        const uint32_t bw = barw0 + 8 * bi;
        wg::bar_expect(bw, kw_bytes + (by_threads ? 0 : kWgPacked));
        if (!by_threads) wg::tensor_copy5(dst, &tk, ti, hi, bn, bw);
        wg::bulk_copy(dst + GOFF + 4 * C, ca.rn + 2 * tile, 8 * C, bw);
        wg::bulk_copy(dst + GOFF + kWgAinOff, ca.Ain + ((first + ci) * a.H + h) * KP, 4 * KP, bw);
        wg::bulk_copy(dst + GOFF + kWgPgOff, ca.pg + hc * 2 * C, 8 * C, bw);
      }
      if ((raw || rv) && !by_threads) {  // the raw rows' tiles by tensor copies
        wg::bar_expect(bar, bulk_bytes + (rq + ca.raw_kw + (rk && !kwf) + rvc) * kWgPacked);
        if (rq) wg::tensor_copy5(dst + QOFF, &tq, ti, hi, bn, bar);
        if (ca.raw_kw) wg::tensor_copy5(dst + KWOFF, &tk, ti, hi, bn, bar);
        if (rk && !kwf) wg::tensor_copy5(dst, &tk, ti, hi, bn, bar);
        if (rvc) wg::tensor_copy5(dst + UOFF, &tv, ti, hv, bn, bar);
      } else {
        wg::bar_expect(bar, bulk_bytes);
      }
      if (a.online && (!rv || kg)) wg::bulk_copy(dst, static_cast<const Op*>(ca.W) + tile * KP, kWgPacked, bar);
      if (rv)
        wg::bulk_copy(dst + TMOFF, static_cast<const Op*>(ca.Tm) + tile * C, 2 * C * C, bar);
      else
        wg::bulk_copy(dst + UOFF, static_cast<const Op*>(ca.U) + tile * ca.Vpad + blockIdx.x * VT * C, 2 * C * VT, bar);
      if (!TR) wg::bulk_copy(dst + POFF, static_cast<const Op*>(ca.P) + tile * C, 2 * C * C, bar);
      if (diag) {
        wg::bulk_copy(dst + GOFF, ca.egC + hc * KP, 4 * KP, bar);
      } else {
        wg::bulk_copy(dst + GOFF, ca.gam + tile, 4 * C, bar);
        if (ca.rn && !kwf) wg::bulk_copy(dst + GOFF + 4 * C, ca.rn + 2 * tile, 8 * C, bar);
      }
      if (!ca.raw_q && !TR) wg::bulk_copy(dst + QOFF, static_cast<const Op*>(ca.Qn) + tile * KP, kWgPacked, bar);
      if (!kwf && !ca.raw_kw) {
        wg::bulk_copy(dst + KWOFF, static_cast<const Op*>(ca.KWn) + tile * KP, kWgPacked, bar);
      }
    }
  };
  // kw_state: warpgroup WGS (the block's last 128 threads, their registers mostly handed to the compute
  // warpgroups) forms each chunk's write keys into KW's place (padded) while the compute warpgroups run
  // the chain: from the chunk's raw k rows in W's place (rk) and its statistics' factors, by the
  // operations of the intra-chunk kernel (stat_step, squash_fast) on the same values; thread wt takes
  // channel wt. It waits for its inputs' copies (the buffer's write-key mbarrier: they are issued before
  // the chunk's other tiles, so that the compute warpgroups' wait for KW does not include theirs) and,
  // where the compute threads copy the rows (cp.async), for their named barrier
  // kRowsBar + buffer; it then arrives at kKwBar + buffer, where the compute warpgroups wait before the
  // update's products. (One chunk ahead at most: a buffer's next copies start only after the compute
  // warpgroups passed its KW barrier.)
  constexpr int kKwBar = 4, kRowsBar = 6, KWT = NT + 128;
  // setmaxnreg moves registers within the block's allocation (384 threads: 168 each at launch), so the
  // three warpgroups' shares must fit it, or the compute warpgroups' increase waits forever.
  constexpr int kKwRegs = 40, kComputeRegs = 232;
  static_assert(kKwRegs + 2 * kComputeRegs <= 3 * (65536 / 384 / 8 * 8), "registers of the block");
  if constexpr (kwf) {
    if (g == WGS) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kKwRegs) : "memory");
      const float center = load_gate(a.center, hv / a.group, a.gate_dtype), log2_x = a.log_x * 1.44269504089f;
      const int at = (wt / 8) * C * 8 + wt % 8;  // element (row t, channel wt) of a packed tile: at + 8 t
      // KW padded (column groups kWgColGroup bytes apart), so that a warp's stores of one row fall in
      // four different 16-byte bank groups: element (t, wt) at atw + (t / 8) RGK / 2 + 8 (t % 8).
      const int atw = (wt / 8) * (CGP / 2) + wt % 8;
      for (int64_t ci = c0; ci < cend; ++ci) {
        const int bk = static_cast<int>((ci - c0) & 1);
        if (rows_by_threads(static_cast<int>(imin64(C, len - ci * C))))
          asm volatile("bar.sync %0, %1;\n" ::"r"(kRowsBar + bk), "n"(KWT) : "memory");
        wg::bar_wait(barw0 + 8 * bk, static_cast<uint32_t>((ci - c0) >> 1) & 1);
        const unsigned char* buf = smem + bk * BUF;
        const Op* kr = reinterpret_cast<const Op*>(buf);
        Op* kw = reinterpret_cast<Op*>(smem + bk * BUF + KWOFF);
        const float* f = reinterpret_cast<const float*>(buf + GOFF);
        const float *rnk = f + 2 * C, *egp = f + kWgPgOff / 4, *bp = egp + C;
        float A = f[kWgAinOff / 4 + wt];
        // The 8 rows' factors are read 16 bytes at a time (Float8: one broadcast load per four rows).
#pragma unroll 1
        for (int t0 = 0; t0 < C; t0 += 8) {
          float kn[8], Ar[8];
          {
            const Float8 r8(rnk + t0);
#pragma unroll
            for (int u = 0; u < 8; ++u) kn[u] = to_float(kr[at + 8 * (t0 + u)]) * r8[u];
#pragma unroll
            for (int u = 0; u < 8; u += 2) round_pair<Op>(kn[u], kn[u + 1]);  // the intra kernel's 16-bit kn
          }
          {
            const Float8 e8(egp + t0), b8(bp + t0);
#pragma unroll
            for (int u = 0; u < 8; ++u) Ar[u] = A = stat_step(A, e8[u], b8[u], kn[u]);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u)
            kw[atw + (t0 / 8) * (RGK / 2) + 8 * u] = from_float<Op>(kn[u] * squash_fast(Ar[u], center, log2_x, a.eps));
        }
        wg::proxy_fence();  // the update's products read KW through the async proxy
        asm volatile("bar.arrive %0, %1;\n" ::"r"(kKwBar + bk), "n"(KWT) : "memory");
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kComputeRegs) : "memory");
  }
  if (cend > c0) issue(c0, 0);
  // The B operands' descriptors: Q and KW packed, or raw rows copied by the threads into padded column groups.
  const bool q_pad = ca.raw_q && !ca.tma_rows, kw_pad = (ca.raw_kw && !ca.tma_rows) || kwf;  // kwf: padded KW
  const uint32_t q_cg = q_pad ? CGP : CGB, q_rg = q_pad ? RGK : 128;
  const uint32_t kw_cg = kw_pad ? CGP : CGB, kw_rg = kw_pad ? RGK : 128;
  // raw_v: the rows of k in Z (KW's tile, or packed in W's place); v's tile is packed.
  const uint32_t k_cg = ca.raw_kw ? kw_cg : CGB, k_rg = ca.raw_kw ? kw_rg : 128;

  // S^T: value column acc_row(m0, e) of the warpgroup (row) and key acc_col(8 i, e) (column) in ST[4 i + e].
  // (Split: from I or 0 in pass 1, from the segment's start state in pass 2; S^T's columns past K stay zero.)
  float ST[64];
  const float* s0 = split ? ca.Sseg + ((int64_t(n) * a.HV + hv) * segs + seg) * KP * KP : nullptr;
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    const int c = v0 + acc_row(m0, j % 4), k = acc_col(8 * (j / 4), j % 4);
    if (TR)
      ST[j] = part == 0 && c == k && k < a.K ? 1.f : 0.f;
    else if (split)
      ST[j] = s0[c * KP + k];
    else
      ST[j] = (a.h0 && k < a.K && c < a.V) ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + k * a.sh0[2] + c] : 0.f;
  }
  Tin* o = static_cast<Tin*>(a.o);
  int bi = 0;
  for (int64_t ci = c0; ci < cend; ++ci) {
    const int L = static_cast<int>(imin64(C, len - ci * C));
    if (ci + 1 < cend) {
      sync_compute<NT>();  // every warp is done with chunk ci - 1's buffer
      issue(ci + 1, bi ^ 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    // Chunk ci's raw rows have landed: visible to the products of every warpgroup. (Also on the last
    // chunk, where no copy was issued above: every warp is done with the previous chunk's s_eo, s_es.)
    const bool by_threads = rows_by_threads(L);
    if (by_threads) wg::proxy_fence();
    if (by_threads || ci + 1 == cend) sync_compute<NT>();
    if (kwf && by_threads) asm volatile("bar.arrive %0, %1;\n" ::"r"(kRowsBar + bi), "n"(KWT) : "memory");
    const uint32_t phase = static_cast<uint32_t>((ci - c0) >> 1) & 1;  // buffer bi's round
    wg::bar_wait(bar0 + 8 * bi, phase);  // and its bulk copies
    if (kwf) wg::bar_wait(barw0 + 8 * bi, phase);
    unsigned char* buf = smem + bi * BUF;
    const uint32_t W_a = smem_addr(buf), Q_a = W_a + QOFF, KW_a = W_a + KWOFF, P_a = W_a + POFF;
    const uint32_t K_a = ca.raw_kw ? KW_a : W_a, TM_a = W_a + TMOFF;  // raw_v: Z's k rows, Tm
    const Op* sU = reinterpret_cast<const Op*>(buf + UOFF);
    const float* sG = reinterpret_cast<const float*>(buf + GOFF);  // gamma (Diagonal decay: e^gamma_C)
    const float* sRn = sG + C;                                     // raw rows: inverse norms of q, then of k
    // R^T and O^T from S^T (16-bit A fragments).
    float rt[32], ot[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) rt[j] = ot[j] = 0.f;
    {
      uint32_t sa[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x) sa[kk][x] = pack2<Op>(ST[8 * kk + 2 * x], ST[8 * kk + 2 * x + 1]);
      // rt = S^T W^T (raw_v: Z^T = S^T K^T), ot = S^T Q^T
      const uint32_t r_a = rv ? K_a : W_a, r_cg = rv ? k_cg : CGB, r_rg = rv ? k_rg : 128;
      // R's products first, in a group of their own: the chain S -> R -> S waits on them alone, and O's
      // (off the chain) run on the tensor cores while R's factors are formed.
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) wg::mma<Op, 64, 0>(rt, sa[kk], wg::desc(r_a + kk * 2 * r_cg, r_cg, r_rg), true);
      wg::commit();
      if constexpr (!TR) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) wg::mma<Op, 64, 0>(ot, sa[kk], wg::desc(Q_a + kk * 2 * q_cg, q_cg, q_rg), true);
        wg::commit();
      }
      // Meanwhile the chunk's row factors (scalar or no decay; with Diagonal decay the intra-chunk kernel
      // applied the decays to the tiles): O's rows get e^gamma_t (and raw q's norm and scale), R's copy
      // for the update e^(gamma_C - gamma_t) (and raw k's norm), zero past L; raw_v: Z's columns
      // e^gamma_t and raw k's norm.
      if constexpr (!diag) {
        const float gl = sG[L - 1];
        if (wt < C) {
          s_eo[wt] = __expf(sG[wt]) * (ca.raw_q ? sRn[wt] * a.scale : 1.f);
          if (rv) s_ez[wt] = kg ? 1.f : __expf(sG[wt]) * sRn[C + wt];
        } else {
          s_es[wt - C] = wt - C < L ? __expf(gl - sG[wt - C]) * (ca.raw_kw ? sRn[wt] : 1.f) : 0.f;
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + g) : "memory");
      }
      wg::wait<TR ? 0 : 1>();  // R's group (O's may still run)
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(rt[j]);
      if constexpr (rv) {
        // R^T = (V^T - Z^T Diag(e^gamma rn_k)) Tm^T (Diagonal decay: no raw k rows, Y^T = V^T - Z^T). V^T's
        // A fragments by ldmatrix.trans from v's packed tile: matrix q of each four holds value rows
        // 8 (q & 1) .. and tokens 8 (2 kk + q / 2) .., lane l addresses row l % 8 of matrix l / 8.
        const int l = threadIdx.x & 31;
        const unsigned char* vrow =
            buf + UOFF + ((64 * g + m0) / 8 + ((l >> 3) & 1)) * CGB + (8 * (l >> 4) + (l & 7)) * 16;
        uint32_t ya[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t vf[4] = {0u, 0u, 0u, 0u};
          if (need_v) ldsm_x4_t(vf, vrow + kk * 16 * 16);
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
            const float2 v = unpack2<Op>(vf[x]);
            ya[kk][x] = diag ? pack2<Op>(v.x - rt[j], v.y - rt[j + 1])
                             : pack2<Op>(v.x - rt[j] * s_ez[t], v.y - rt[j + 1] * s_ez[t + 1]);
          }
        }
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 64, 0>(rt, ya[kk], wg::desc(TM_a + kk * 2 * CGB, CGB, 128), kk > 0);
        wg::commit();
      }
      wg::wait<0>();
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(rt[j]), wg::pin(ot[j]);
    }
    // R^T = U^T - S^T W^T (raw_v: formed above); its 16-bit fragments as is (for O) and scaled (for the
    // update; Diagonal decay: zero past L only); O^T's columns scaled; the state decayed.
    uint32_t rb[4][4], ra[4][4];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = acc_row(m0, j % 4), t = acc_col(8 * (j / 4), j % 4);
      if constexpr (!rv) rt[j] = to_float(sU[blocked_at(t, 64 * g + (c & ~7)) + (c & 7)]) - rt[j];
      if constexpr (!diag) ot[j] *= s_eo[t];
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
        rb[kk][x] = pack2<Op>(rt[j], rt[j + 1]);
        if constexpr (!diag) ra[kk][x] = pack2<Op>(rt[j] * s_es[t], rt[j + 1] * s_es[t + 1]);
      }
    if constexpr (diag) {
      if (L == C) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int x = 0; x < 4; ++x) ra[kk][x] = rb[kk][x];
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
            ra[kk][x] = pack2<Op>(t < L ? rt[j] : 0.f, t + 1 < L ? rt[j + 1] : 0.f);
          }
      }
      // S^T's column k decays by e^gamma_C[k] (sG): a thread's columns come in adjacent pairs.
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float2 e = *reinterpret_cast<const float2*>(sG + acc_col(8 * i, 0));
        ST[4 * i] *= e.x, ST[4 * i + 1] *= e.y, ST[4 * i + 2] *= e.x, ST[4 * i + 3] *= e.y;
      }
    } else {
      const float gC = __expf(sG[L - 1]);
#pragma unroll
      for (int j = 0; j < 64; ++j) ST[j] *= gC;
    }
    if constexpr (kwf) asm volatile("bar.sync %0, %1;\n" ::"r"(kKwBar + bi), "n"(KWT) : "memory");  // KW written
    wg::fence();
    if constexpr (!TR)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 64, 0>(ot, rb[kk], wg::desc(P_a + kk * 2 * CGB, CGB, 128), true);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 128, 1>(ST, ra[kk], wg::desc(KW_a + kk * 2 * kw_rg, kw_rg, kw_cg), true);
    wg::commit();
    wg::wait<0>();
#pragma unroll
    for (int j = 0; j < 64; ++j) wg::pin(ST[j]);
    if constexpr (!TR) {
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(ot[j]);
      const int64_t orow0 = b * a.so[0] + (bos + ci * C) * a.so[1] + hv * a.so[2];
      bool staged = false;
      if constexpr (sizeof(Tin) == 2) staged = ca.vec_o;
      if (staged) {
        // O^T's 16-bit fragments transposed by stmatrix into the token rows of the block's stage (row
        // stride OLD: 16 bytes of padding put a matrix's eight rows in different banks), then each
        // token row's 128 bytes of this warpgroup to o, 16 bytes per thread. Matrix q of each four:
        // value rows 8 (q & 1) .., tokens 8 (2 i + q / 2) ..; lane l addresses token row l % 8 of matrix l / 8.
        constexpr int OLD = 2 * VT + 16;
        unsigned char* stage = smem + OOFF;
        const int l = threadIdx.x & 31;
        const uint32_t st0 = smem_addr(stage + (8 * (l >> 4) + (l & 7)) * OLD + (64 * g + m0 + 8 * ((l >> 3) & 1)) * 2);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          wg::stsm_x4_t(st0 + 16 * i * OLD, pack2<Op>(ot[8 * i], ot[8 * i + 1]),
                        pack2<Op>(ot[8 * i + 2], ot[8 * i + 3]), pack2<Op>(ot[8 * i + 4], ot[8 * i + 5]),
                        pack2<Op>(ot[8 * i + 6], ot[8 * i + 7]));
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + g) : "memory");
        const int r0 = wt / 8, col = v0 + 8 * (wt % 8);  // col: o's column (the stage's: col - v0 + 64 g)
        if (col < a.V)
#pragma unroll
          for (int p = 0; p < C / 16; ++p) {
            const int r = r0 + 16 * p;
            if (r < L)
              *reinterpret_cast<uint4*>(o + orow0 + r * a.so[1] + col) =
                  *reinterpret_cast<const uint4*>(stage + r * OLD + (col - v0 + 64 * g) * 2);
          }
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int c = v0 + acc_row(m0, j % 4), t = acc_col(8 * (j / 4), j % 4);
          if (t < L && c < a.V) o[orow0 + t * a.so[1] + c] = from_float<Tin>(ot[j]);
        }
      }
    }
    bi ^= 1;
  }
  if (TR) {  // S^T at the segment's end: A^T (part 0) or B^T (part 1)
    float* d = ca.Tseg + (((int64_t(n) * a.HV + hv) * segs + seg) * 2 + part) * KP * KP;
#pragma unroll
    for (int j = 0; j < 64; ++j) d[(v0 + acc_row(m0, j % 4)) * KP + acc_col(8 * (j / 4), j % 4)] = ST[j];
  } else if (a.hT && (!split || seg == split_last_segment(ca, count)))
#pragma unroll
    for (int j = 0; j < 64; ++j) {
      const int c = v0 + acc_row(m0, j % 4), k = acc_col(8 * (j / 4), j % 4);
      if (k < a.K && c < a.V) a.hT[int64_t(n) * a.shT[0] + hv * a.shT[1] + k * a.shT[2] + c] = ST[j];
    }
#else
  (void)ca;
#endif
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
