/// @brief Chunkwise forward of the CPU leaf kernels (SPEC §4), one task per (sequence, value-head group).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "convert.hpp"
#include "dgps/detail/squash.hpp"
#include "gemm.hpp"
#include "intra.hpp"
#include "scratch.hpp"
#include "setup.hpp"
#include "simd.hpp"
#include "squash_simd.hpp"
#include "transpose.hpp"
#include "trickle.hpp"
#include "vmath.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Chunkwise forward of task `task` (SPEC §4): the value heads [hv0, hv0 + nh) of sequence n (groups of
/// `group` heads), columns block vb of vsplit. The group's heads advance chunk by chunk together: the
/// rows of one token's heads are adjacent in the [B,T,H,K] inputs, so a chunk of the group reads
/// whole runs of lines (that the hardware prefetchers fetch ahead) where one head alone reads 512
/// bytes of every 8 KB at H = 16, K = 128 (one head at a time was ~15% slower).
/// Per chunk, rows i < c: R = (I + Akk)^{-1} (Diag(beta) V - Kd S_in) (offline: Diag(beta) V), O = Qd S_in +
/// Aqk R, S_out = Diag(e^{gamma_C}) S_in + KWdT R, with Kd = beta ⊙ e^gamma ⊙ K, Qd = e^gamma ⊙ Qr and
/// KWdT = (KW ⊙ e^{gamma_C - gamma})^T.
template <class T, class In = T>
void chunk_task_t(const KernelParams& p, int64_t task, int64_t vsplit, int64_t group) {
  const Setup<T, In> s(p);
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  // The recurrence never mixes value columns: with fewer (sequence, head) pairs than threads the
  // V columns are split into `vsplit` blocks, each a task of its own ([v0, v1), a multiple of L wide).
  const int64_t ng = (p.HV + group - 1) / group;  // head groups per sequence
  const int64_t pair = task / vsplit, vb = task % vsplit;
  const int64_t n = pair / ng, hv0 = pair % ng * group, nh = imin(group, p.HV - hv0);
  const int64_t vw = round_up((p.V + vsplit - 1) / vsplit, L);
  const int64_t v0 = imin(p.V, vb * vw), v1 = imin(p.V, v0 + vw);
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), len = seq_len(p, n);
  const int64_t ri = read_index(p, n), wi = write_index(p, n);
  if (is_padded(p, n)) {  // a padding sequence (decode through a pool): zero outputs, the pool untouched
    for (int64_t t = 0; t < len; ++t)
      for (int64_t hv = hv0; hv < hv0 + nh; ++hv)
        std::memset(static_cast<void*>(s.orow(b, t0 + t, hv) + v0), 0, size_t(v1 - v0) * sizeof(In));
    return;
  }
  const int64_t K = s.K, Vd = v1 - v0, Kp = s.Kp, Vp = round_up(Vd, L), ldv = padded_ld<T>(Vp);
  // A sequence shorter than the chunk is one chunk of its own length (smaller scratch).
  const int64_t C = imin(p.chunk < 1 ? 1 : p.chunk, len < 1 ? 1 : len);
  const int64_t Cp = round_up(C, L);
  const bool diag = s.decay == decay::Kind::diagonal;

  // Scratch: the thread's reused block, zeroed once per task (padding lanes and columns stay zero).
  // Stg stages rows: the statistics A_t of the chunk (step 2), then KW ⊙ e^{gamma_C - gamma} (step 3),
  // then the sub-block keys of diagonal decay (step 6). RO is [R; O]: the pseudo-values, then the outputs.
  // Each head of the group has its own state S and statistics A. Training cache (KernelParams::saved),
  // when saving: Bu gets the unscaled key products (Akk / beta), Pk the chunk's packed [Aqk lower |
  // Bu^T upper] block.
  const bool saving = p.saved && p.save && p.saved_seg == 0;
  // A checkpoint cache (saved_seg > 0): the state and statistics entering every segment of saved_seg chunks.
  const bool save_ck = p.saved && p.save && p.saved_seg > 0;
  const bool save_p = saving && vb == 0;  // the value-column blocks share the intra-chunk matrices
  const int64_t nS = K * ldv, nA = Kp, nKQ = 2 * C * Kp, nStg = C * Kp, nKW = C * Kp, nGam = C * Kp, nBeta = Cp,
                nAQ = 2 * C * Kp, nKWT = Kp * Cp, nRO = 2 * C * ldv, nP = 2 * C * Cp, nTmp = 2 * (Kp + Cp),
                nLQ = diag ? 2 * kSub * Kp : 0, nPb = diag ? 2 * kSub * Cp : 0, nBu = save_p && s.online ? C * Cp : 0,
                nPk = save_p ? C * p.saved_pld : 0;
  const int64_t total =
      nh * (nS + nA) + nKQ + nStg + nKW + nGam + nBeta + nAQ + 2 * nKWT + nRO + nP + nTmp + nLQ + nPb + nBu + nPk;
  const ScratchLease<T> mem(total);
  std::memset(static_cast<void*>(mem.get()), 0, size_t(total) * sizeof(T));
  T* Sg = mem.get();     // the group's states, nS each
  T* Ag = Sg + nh * nS;  // the group's statistics, nA each
  T* KQ = Ag + nh * nA;
  T* Stg = KQ + nKQ;
  T* KWb = Stg + nStg;
  T* Gam = KWb + nKW;
  T* Bt = Gam + nGam;
  T* AQ = Bt + nBeta;
  T* KWT = AQ + nAQ;
  T* KWdT = KWT + nKWT;
  T* RO = KWdT + nKWT;
  T* P = RO + nRO;
  T* tmp = P + nP;
  T* LQ = tmp + nTmp;
  T* Pb = LQ + nLQ;
  T* Bu = nBu ? Pb + nPb : nullptr;
  T* Pk = Pb + nPb + nBu;

  for (int64_t j = 0; j < nh; ++j) {
    const int64_t hv = hv0 + j, h = hv / s.r;
    if (p.h0.data && ri >= 0) {
      const T* h0 = cptr<T>(p.h0) + ri * p.h0.stride[0] + hv * p.h0.stride[1] + v0 * p.h0.stride[3];
      state_in(h0, p.h0.stride[2], p.h0.stride[3], K, Vd, Sg + j * nS, ldv);  // K-major or K-last
    }
    if (s.diag_pre && p.a0.data && ri >= 0) {
      const T* a0 = cptr<T>(p.a0) + ri * p.a0.stride[0] + h * p.a0.stride[1];
      for (int64_t c = 0; c < K; ++c) Ag[j * nA + c] = a0[c];
    }
  }
  const V iota = iota_v<T>();

  // Memory traffic is spread over the chunk's products (Trickle; `steps` is the number of step() calls
  // of the previous chunk): prefetches of the next chunk's input rows and of its output rows (for
  // writing), and a saving forward's copies into the training cache. The rows of one head are a
  // whole token's stride apart (8 KB at H = 16, K = 128): prefetched in one burst, or not ahead for
  // writing, loading and storing them took about a third of the chunk's time.
  Trickle<T> tr;
  int64_t steps = 160;
  // Queues the prefetch into L2 of `rows` rows of n elements from x on, `ts` elements apart (whole lines).
  const auto prefetch_rows = [&tr](const auto* x, int64_t ts, int64_t rows, int64_t n, bool write) {
    const int64_t mis = int64_t(reinterpret_cast<uintptr_t>(x) & 63);
    tr.prefetch(reinterpret_cast<const char*>(x) - mis, ts * int64_t(sizeof(*x)), rows, n * int64_t(sizeof(*x)) + mis,
                write);
  };
  // Chunk [cs, cs + c) of head hv0 + j; (jn, csn) is the head and chunk that come next (prefetched).
  const auto chunk = [&](int64_t j, int64_t cs, int64_t jn, int64_t csn) {
    const int64_t hv = hv0 + j, h = hv / s.r, hvn = hv0 + jn, hn = hvn / s.r;
    T* S = Sg + j * nS;
    T* A = Ag + j * nA;
    const T ctr = s.diag_pre ? s.center(h) : T(0);
    // This head's first chunk block of the training cache.
    T* sv = saving ? static_cast<T*>(p.saved) + (p.saved_chunk0[n] * p.HV + hv * ((len + C - 1) / C)) * p.saved_block
                   : nullptr;
    if (save_ck && cs / C % p.saved_seg == 0) {
      const int64_t segs = ((len + C - 1) / C + p.saved_seg - 1) / p.saved_seg;
      T* ck = static_cast<T*>(p.saved) + (p.saved_chunk0[n] * p.HV + hv * segs + cs / C / p.saved_seg) * p.saved_block;
      for (int64_t c = 0; c < K; ++c) std::memcpy(ck + c * p.saved_ld + v0, S + c * ldv, size_t(Vd) * sizeof(T));
      if (s.diag_pre && vb == 0) std::memcpy(ck + p.saved_aoff, A, size_t(Kp) * sizeof(T));
    }
    const int64_t c = imin(C, len - cs);
    T* Kn = KQ;                                             // read keys, rows [0, c)
    T* Qr = KQ + c * Kp;                                    // read queries, rows [c, 2c)
    T* R = RO;                                              // rows [0, c)
    T* O = RO + c * ldv;                                    // rows [c, 2c)
    T* blk = sv ? sv + (cs / C) * p.saved_block : nullptr;  // this chunk's block of the training cache
    const int job_s = blk ? tr.copy(blk + v0, p.saved_ld, S, ldv, K, Vp) : -1;  // S_in, before step 8
    if (const int64_t tn = t0 + csn, cn = imin(C, len - csn); cn > 0) {
      prefetch_rows(s.qrow(b, tn, hn), p.q.stride[1], cn, K, false);
      prefetch_rows(s.krow(b, tn, hn), p.k.stride[1], cn, K, false);
      prefetch_rows(s.vrow(b, tn, hvn) + v0, p.v.stride[1], cn, Vd, false);
      if (diag) prefetch_rows(s.grow(b, tn, hvn), p.g.stride[1], cn, K, false);
      prefetch_rows(s.orow(b, tn, hvn) + v0, p.o.stride[1], cn, Vd, true);
    }
    tr.plan(steps, blk ? int64_t(sizeof(T)) * c * ((s.online ? Vp : 0) + (save_p ? p.saved_pld : 0)) : 0);
    // 1. Load and normalise (SPEC §1); R_i = beta_i V_i; chunk-local cumulative gates gamma (SPEC §4).
    for (int64_t i = 0; i < c; ++i) {
      const int64_t t = t0 + cs + i;
      load_row(s.qrow(b, t, h), K, p.l2norm, s.scale, Qr + i * Kp);
      load_row(s.krow(b, t, h), K, p.l2norm, T(1), Kn + i * Kp);
      const T bi = s.beta(b, t, hv);
      Bt[i] = bi;
      T* ri = R + i * ldv;
      load_cvt(s.vrow(b, t, hv) + v0, Vd, ri);
      for (int64_t e = 0; e < Vp; e += L) vstore(ri + e, bi * vload(ri + e));
      if (s.decay == decay::Kind::scalar) {
        Gam[i] = to_c<T>(s.grow(b, t, hv)[0]) + (i ? Gam[i - 1] : T(0));
      } else if (diag) {
        const In* g = s.grow(b, t, hv);
        T* gi = Gam + i * Kp;
        load_cvt(g, K, gi);
        if (i)
          for (int64_t ch = 0; ch < Kp; ch += L) vstore(gi + ch, vload(gi + ch) + vload(gi - Kp + ch));
      }
    }
    if (!diag && s.decay != decay::Kind::scalar)
      for (int64_t i = 0; i < c; ++i) Gam[i] = 0;
    // 2. Diagonal preconditioner (SPEC §2): A_t = exp(g_p) A + beta_p k⊙k, M = squash(A_t) (padding
    //    lanes of A stay 0).
    const T* KW = Kn;
    if (s.diag_pre) {
      if (blk && vb == 0) std::memcpy(blk + p.saved_aoff, A, size_t(Kp) * sizeof(T));  // A entering the chunk
      // The statistics of every row first (8 vectors of channels at a time: independent FMA chains
      // over the tokens), staged in Stg; then the squash of the whole block, 8 vectors at a time
      // (interleaved chains, across token rows), and the preconditioned key (or query).
      T* dst = s.atk ? KWb : Qr;
      const T* src = s.atk ? Kn : Qr;
      T* At = Stg;
      T* ga = tmp;       // e^{g_p} of each row
      T* gb = tmp + Cp;  // beta_p of each row
      for (int64_t i = 0; i < c; ++i) {
        const int64_t t = t0 + cs + i;
        ga[i] = std::exp(s.gp(b, t, h)), gb[i] = s.bp(b, t, h);
      }
      constexpr int NA = 8;  // vectors of channels advanced together (independent chains)
      for (int64_t ch0 = 0; ch0 < Kp; ch0 += NA * L) {
        const int nv = int(imin(NA, (Kp - ch0) / L));
        V x[NA];
        for (int u = 0; u < nv; ++u) x[u] = vload(A + ch0 + u * L);
        for (int64_t i = 0; i < c; ++i) {
          const T ai = ga[i], bi = gb[i];
          for (int u = 0; u < nv; ++u) {
            const V k = vload(Kn + i * Kp + ch0 + u * L);
            x[u] = dgps::maths::stats_step<V>(x[u], ai, bi, k);  // SPEC §2, in lanes
            vstore(At + i * Kp + ch0 + u * L, x[u]);
          }
        }
        for (int u = 0; u < nv; ++u) vstore(A + ch0 + u * L, x[u]);
      }
      const int64_t n = c * Kp;
      int64_t i0 = 0;
      if constexpr (sizeof(T) == 4) {
        constexpr int G = 8;  // vectors squashed together
        for (; i0 + G * L <= n; i0 += G * L) {
          V x[G], m[G];
          for (int u = 0; u < G; ++u) x[u] = vload(At + i0 + u * L);
          if (!squash_vn<G>(x, m, ctr, s.log_x, s.eps)) break;  // the vector-by-vector loop takes over
          for (int u = 0; u < G; ++u) vstore(dst + i0 + u * L, vload(src + i0 + u * L) * m[u]);
        }
        for (; i0 < n; i0 += L) vstore(dst + i0, vload(src + i0) * squash_v(vload(At + i0), ctr, s.log_x, s.eps));
      } else {
        for (; i0 < n; ++i0) dst[i0] = src[i0] * squash1(At[i0], ctr, s.log_x, s.eps);
      }
      if (s.atk) KW = KWb;
    }
    // 3. Decayed operands: Kd_i = -beta_i e^{gamma_i} ⊙ Kn_i (negated: step 4 subtracts by adding),
    //    Qd_i = e^{gamma_i} ⊙ Qr_i, KWdT = (KW ⊙ e^{gamma_C - gamma})^T and (scalar decay or none) KWT =
    //    KW^T. Every exponent is <= 0 for g <= 0.
    T* Kd = AQ;
    T* Qd = AQ + c * Kp;
    const T* gl = diag ? Gam + (c - 1) * Kp : nullptr;
    if (diag) {
      for (int64_t i = 0; i < c; ++i) {
        T* e = tmp;        // e^{gamma_i}
        T* ed = tmp + Kp;  // e^{gamma_C - gamma_i}
        for (int64_t ch = 0; ch < Kp; ch += L) {
          vstore(e + ch, vload(Gam + i * Kp + ch));
          vstore(ed + ch, vload(gl + ch) - vload(Gam + i * Kp + ch));
        }
        exp_inplace(tmp, 2 * Kp);
        const V negb = vsplat(-Bt[i]);
        for (int64_t ch = 0; ch < Kp; ch += L) {
          const V ev = vload(e + ch);
          vstore(Kd + i * Kp + ch, negb * ev * vload(Kn + i * Kp + ch));
          vstore(Qd + i * Kp + ch, ev * vload(Qr + i * Kp + ch));
          vstore(Stg + i * Kp + ch, vload(KW + i * Kp + ch) * vload(ed + ch));
        }
      }
      transpose(c, K, Stg, Kp, KWdT, Cp);
    } else {
      T* e = tmp;        // e^{gamma_i}, i < Cp
      T* ed = tmp + Cp;  // e^{gamma_C - gamma_j}, j < Cp
      for (int64_t i = 0; i < Cp; ++i) {
        e[i] = i < c ? Gam[i] : T(0);
        ed[i] = i < c ? Gam[c - 1] - Gam[i] : T(0);
      }
      exp_inplace(tmp, 2 * Cp);
      for (int64_t i = 0; i < c; ++i) {
        const V fk = vsplat(-Bt[i] * e[i]), fq = vsplat(e[i]);
        for (int64_t ch = 0; ch < Kp; ch += L) {
          vstore(Kd + i * Kp + ch, fk * vload(Kn + i * Kp + ch));
          vstore(Qd + i * Kp + ch, fq * vload(Qr + i * Kp + ch));
        }
      }
      transpose(c, K, KW, Kp, KWT, Cp);
      if (c < Cp)
        for (int64_t ch = 0; ch < K; ++ch)
          for (int64_t j = c; j < Cp; ++j) KWT[ch * Cp + j] = 0;
      for (int64_t ch = 0; ch < K; ++ch)
        for (int64_t j = 0; j < Cp; j += L) vstore(KWdT + ch * Cp + j, vload(KWT + ch * Cp + j) * vload(ed + j));
    }
    if (diag && c < Cp)
      for (int64_t ch = 0; ch < K; ++ch)
        for (int64_t j = c; j < Cp; ++j) KWdT[ch * Cp + j] = 0;
    // 4. Inter-chunk products with S_in: R += Kd S_in (online: R = beta ⊙ V - beta e^gamma K S_in, the
    //    right-hand side of (I + Akk) R = X), O = Qd S_in.
    if (s.online) gemm(c, Vp, K, Kd, Kp, S, ldv, R, ldv, true, Tri::none, &tr);
    gemm(c, Vp, K, Qd, Kp, S, ldv, O, ldv, false, Tri::none, &tr);
    // 5. Intra-chunk matrices: Akk[i,j] = beta_i sum_c Kn_ic KW_jc e^{gamma_ic - gamma_jc} (j < i),
    //    Aqk[i,j] = sum_c Qr_ic KW_jc e^{gamma_ic - gamma_jc} (j <= i); differences inside exp (SPEC §4).
    T* Akk = P;
    T* Aqk = P + c * Cp;
    if (diag) {
      // Sub-blocks of kSub rows, each block I (first row i0) against the rows j < jn through one
      // product: e^{gamma_i - gamma_j} = e^{gamma_i - gamma_i0} e^{gamma_i0 - gamma_j}, both factors <= 1
      // for j < i0 and g <= 0 (no overflow for any g <= 0), so it is [Kl; Ql] (KW ⊙ e^{gamma_i0 - gamma})^T.
      // jn = i0 + nf: the earlier rows, and the block's own pairs of its first nf rows (those within
      // `factor_rows`' range); the later rows' own pairs get exact per-pair exponent differences.
      for (int64_t i0 = 0; i0 < c; i0 += kSub) {
        const int64_t nb = imin(kSub, c - i0);
        const int64_t nf = factor_rows(Gam, Kp, i0, nb);
        const bool fact = nf == nb;
        const int64_t jn = i0 + nf;
        const T* g0 = Gam + i0 * Kp;
        if (jn > 0) {
          for (int64_t i = 0; i < nb; ++i) {
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(Gam + (i0 + i) * Kp + ch) - vload(g0 + ch));
            exp_inplace(tmp, Kp);
            for (int64_t ch = 0; ch < Kp; ch += L) {
              const V f = vload(tmp + ch);
              vstore(LQ + i * Kp + ch, vload(Kn + (i0 + i) * Kp + ch) * f);
              vstore(LQ + (nb + i) * Kp + ch, vload(Qr + (i0 + i) * Kp + ch) * f);
            }
          }
          for (int64_t j = 0; j < jn; ++j) {
            T* w = Stg + j * Kp;
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(w + ch, vload(g0 + ch) - vload(Gam + j * Kp + ch));
            exp_inplace(w, Kp);
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(w + ch, vload(w + ch) * vload(KW + j * Kp + ch));
          }
          transpose(jn, K, Stg, Kp, KWT, Cp);
          gemm(2 * nb, round_up(jn, L), K, LQ, Kp, KWT, Cp, Pb, Cp, false);  // columns >= jn unused
        }
        // Rows of the block: the product's columns j < jn (i0 for the rows past nf; masked to the
        // triangles), zero elsewhere.
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t row = i0 + i;
          const V bi = vsplat(Bt[row]), rv = vsplat(T(row)), jnv = vsplat(T(i < nf ? jn : i0));
          for (int64_t j = 0; j < Cp; j += L) {
            const V jv = iota + T(j);
            const V pk = j < jn ? vload(Pb + i * Cp + j) : V{}, pq = j < jn ? vload(Pb + (nb + i) * Cp + j) : V{};
            vstore(Akk + row * Cp + j, sel((jv < rv) & (jv < jnv), bi * pk, V{}));
            vstore(Aqk + row * Cp + j, sel((jv <= rv) & (jv < jnv), pq, V{}));
            if (Bu) vstore(Bu + row * Cp + j, sel((jv < rv) & (jv < jnv), pk, V{}));
          }
        }
        if (fact) continue;
        for (int64_t i = i0 + nf; i < i0 + nb; ++i) {
          const T* gi = Gam + i * Kp;
          for (int64_t j = i0; j <= i; ++j) {
            const T* gj = Gam + j * Kp;
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(gi + ch) - vload(gj + ch));
            exp_inplace(tmp, Kp);
            V accq{}, acck{};
            for (int64_t ch = 0; ch < Kp; ch += L) {
              const V w = vload(tmp + ch) * vload(KW + j * Kp + ch);
              accq += vload(Qr + i * Kp + ch) * w;
              acck += vload(Kn + i * Kp + ch) * w;
            }
            const T sq = hsum<T>(accq), sk = hsum<T>(acck);
            Aqk[i * Cp + j] = sq;
            if (j < i) Akk[i * Cp + j] = Bt[i] * sk;
            if (Bu && j < i) Bu[i * Cp + j] = sk;
          }
        }
      }
    } else {
      intra_scalar(c, Cp, K, Kn, Qr, Kp, KWT, Gam, Bt, s.online, Akk, Aqk, tmp, Bu);
    }
    if (blk && save_p) {
      // P[i][j] = Aqk[i][j] (j <= i), Bu[j][i] (j > i): Bu^T, then the lower triangle from Aqk.
      const int64_t pld = p.saved_pld;
      if (Bu) transpose(c, c, Bu, Cp, Pk, pld);
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < Cp; j += L) {
          const V jv = iota + T(j);
          vstore(Pk + i * pld + j,
                 sel(jv <= vsplat(T(i)), vload(Aqk + i * Cp + j), Bu ? vload(Pk + i * pld + j) : V{}));
        }
      tr.copy(blk + K * p.saved_ld + (s.online ? C * p.saved_ld : 0), pld, Pk, pld, c, pld);
    }
    // 6. Unit lower-triangular solve (I + Akk) R = X by forward substitution (online only).
    if (s.online) unit_solve(c, Vp, Akk, Cp, R, ldv, false);
    if (blk && s.online) tr.copy(blk + K * p.saved_ld + v0, p.saved_ld, R, ldv, c, Vp);  // R
    // 7. O = Qd S_in + (Aqk ⊙ causal) R.
    gemm(c, Vp, c, Aqk, Cp, R, ldv, O, ldv, true, Tri::a_lower, &tr);
    for (int64_t i = 0; i < c; ++i) store_cvt(O + i * ldv, Vd, s.orow(b, t0 + cs + i, hv) + v0);
    // 8. S_out = Diag(e^{gamma_C}) S_in + KWdT R (the decay applied by the product, tmp = e^{gamma_C}).
    tr.drain(job_s);  // S_in is in the cache before S changes
    if (diag) {
      for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(gl + ch));
      exp_inplace(tmp, Kp);
    } else if (s.decay == decay::Kind::scalar) {
      const V f = vsplat(std::exp(Gam[c - 1]));
      for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, f);
    }
    gemm(K, Vp, c, KWdT, Cp, R, ldv, S, ldv, true, Tri::none, &tr, s.decay == decay::Kind::none ? nullptr : tmp);
    steps = tr.steps();
    tr.drain_all();
  };
  for (int64_t cs = 0; cs < len; cs += C)
    for (int64_t j = 0; j < nh; ++j) {
      if (j + 1 < nh)
        chunk(j, cs, j + 1, cs);
      else
        chunk(j, cs, 0, cs + C);
    }

  if (saving) stream_fence();
  for (int64_t j = 0; j < nh; ++j) {
    const int64_t hv = hv0 + j, h = hv / s.r;
    if (p.hT.data && wi >= 0) {
      T* hT = s.state(p.hT, wi, hv) + v0 * p.hT.stride[3];
      state_out(Sg + j * nS, ldv, K, Vd, hT, p.hT.stride[2], p.hT.stride[3]);
    }
    if (s.diag_pre && p.aT.data && wi >= 0 && hv % s.r == 0 && vb == 0) {
      T* aT = mptr<T>(p.aT) + wi * p.aT.stride[0] + h * p.aT.stride[1];
      for (int64_t c = 0; c < K; ++c) aT[c] = Ag[j * nA + c];
    }
  }
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
