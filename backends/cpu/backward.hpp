/// @brief Chunkwise backward of the CPU leaf kernels (SPEC §4, paper App. D), compiled once per ISA.
///
/// Included by kernel_impl.hpp into the per-ISA anonymous namespace. One task per (sequence n, key head h).
/// Without a full training cache the sequence is cut into segments of dgps::detail::kCheckpointTokens: a
/// checkpoint sweep keeps the state entering each segment (per value head) and the statistics entering
/// it (or a checkpoint cache, saved by the forward, holds them: no checkpoint sweep); then per segment,
/// last to first:
///  1. a token pass computes the normalised q and k, the squash M of the diagonal statistics and the
///     read queries / write keys (as the forward kernel does) of the segment's tokens;
///  2. per value head, a forward sweep over the segment's chunks from its checkpoint stores each chunk's
///     entry state (transposed), its pseudo-values R (transposed) and its intra-chunk matrices; a
///     reverse sweep then carries the state gradient dS (one per value head, from dhT to dh0), writes
///     dv, dbeta and dg, and adds the gradients of the read queries, read keys and write keys (summed
///     over the group's value heads, GVA). The recomputation repeats the same operations on the same
///     operands (the same values as one sweep over the sequence); the workspace is
///     O(T / (C seg) K V + seg C (K + V)) instead of O(T / C K V). With a training cache
///     (KernelParams::saved, filled by the forward) there is no forward sweep: the reverse sweep reads
///     each chunk's S_in, R, Aqk and Akk / beta from the cache, and runs step 1 chunk by chunk in the
///     first value head's sweep (from the statistics entering the chunk, also saved);
///  3. a reverse token pass chains those through the preconditioner statistics (dk, dg_p, dbeta_p,
///     dcenter, da0) and through the L2 norm and scale (dq, dk); it runs chunk by chunk inside the
///     last value head's reverse sweep, while the chunk's token gradients are still in cache.
/// With a training cache and one value head per key head, a task takes up to 8 adjacent key heads of
/// one sequence and runs their reverse sweeps chunk by chunk together (each head keeps its own dS):
/// the heads' rows of one token are adjacent in the inputs and gradients, so a chunk of the group reads
/// and writes whole runs of lines (~15% faster than one head per task at H = 16, K = V = 128).
/// Diagonal decay: the pairs of a kSub-row diagonal block go through the same factored product as
/// the earlier rows when the block's gates span at most kFactorRange (else one exponential per pair).
///
/// Per chunk (rows i, j; gamma the chunk-local cumulative gate; E = e^gamma, Ed = e^{gamma_C - gamma}):
///   Bm[i,j] = sum_c K[i,c] KW[j,c] e^{gamma_ic - gamma_jc} (j < i),  Akk = Diag(beta) Bm,
///   Aq[i,j] = sum_c Q[i,c] KW[j,c] e^{gamma_ic - gamma_jc} (j <= i),
///   X = Diag(beta) V - (beta K ⊙ E) S_in (online; beta V offline),  R = (I + Akk)^{-1} X,
///   O = (Q ⊙ E) S_in + Aq R,  S_out = Diag(e^{gamma_C}) S_in + (KW ⊙ Ed)^T R.
/// Reverse: dX = (I + Akk)^{-T} (Aq^T dO + (KW ⊙ Ed) dS_out), dAq = dO R^T, dAkk = -dX R^T,
///   dS_in = Diag(e^{gamma_C}) dS_out + (Q ⊙ E)^T dO - (beta K ⊙ E)^T dX; every exponential factor is
///   a difference of gates (sub-blocks of kSub rows for diagonal decay), so g = -50 stays finite.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <dgps/training_cache.hpp>

#include "backward_steps.hpp"
#include "convert.hpp"
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

/// Chunkwise backward of task n * ceil(H / group) + h0 / group (the steps in the file comment): the key
/// heads [h0, h0 + nh) of sequence n; writes every requested gradient of the group and the dcenter term
/// of its key head h0 + j to dcenter_out[j]. Several key heads (group > 1: only with a training cache
/// and one value head per key head) advance chunk by chunk together, as in the forward's chunk_task_t:
/// the rows of one token's heads are adjacent in the [B,T,H,K] inputs and gradients.
template <class T>
void backward_task_t(const KernelParams& p, int64_t task, int64_t group, double* dcenter_out) {
  const Setup<T> s(p);
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  const int64_t groups = (p.H + group - 1) / group;  // key-head groups per sequence
  const int64_t n = task / groups, h0 = task % groups * group, nh = imin(group, p.H - h0);
  int64_t h = h0;  // the current key head (select_head)
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), si = state_index(p, n);
  const int64_t len = seq_len(p, n) > 0 ? seq_len(p, n) : 0;
  const int64_t K = s.K, Vd = s.V, Kp = s.Kp, Vp = s.Vp, r = s.r;
  const int64_t C = imin(p.chunk < 1 ? 1 : p.chunk, len < 1 ? 1 : len);
  const int64_t Cp = round_up(C, L), C2 = 2 * Cp, S2 = 2 * kSub;
  // Padded row strides (padded_ld) of the V-wide blocks, of S_in^T and dS^T, and of R^T and dKWd^T.
  const int64_t ldv = padded_ld<T>(Vp), ldk = padded_ld<T>(Kp), ldr = padded_ld<T>(Cp);
  const int64_t nch = (len + C - 1) / C;
  const bool diag = s.decay == decay::Kind::diagonal, scal = s.decay == decay::Kind::scalar;
  const bool decays = diag || scal, online = s.online;
  T ctr = 0;  // the current key head's center
  for (int64_t j = 0; j < nh; ++j) dcenter_out[j] = 0;
  // Training cache (KernelParams::saved) filled by the forward: each chunk's S_in, R and intra-chunk
  // matrices are read from it (one chunk at a time) instead of recomputed by a forward sweep.
  // A checkpoint cache (saved_seg > 0) holds only the states (and statistics) entering the segments.
  const T* saved = p.saved && !p.save ? static_cast<const T*>(p.saved) + p.saved_chunk0[n] * p.HV * p.saved_block
                                      : nullptr;
  const bool ckpt = saved && p.saved_seg > 0;
  const T* sv = ckpt ? nullptr : saved;
  const bool cached = sv != nullptr;
  // Without the cache: chunks per segment, segments, chunks held by the per-chunk stores.
  const int64_t seg = cached ? 1 : imin(ckpt ? p.saved_seg : dgps::detail::segment_chunks(C), nch);
  const int64_t nseg = cached ? 1 : seg < 1 ? 0 : (nch + seg - 1) / seg;  // 0: an empty sequence
  const int64_t nst = cached ? 1 : seg;
  // With the cache and one value head per key head, the per-token arrays hold one chunk's rows (the
  // token pass runs chunk by chunk, each chunk's rows consumed before the next): token t at row
  // t - tbase, tbase the chunk's first token (the same lines reused, where all of a 4096-token
  // sequence's rows took fresh ones: about 1 MB per head for PGDN).
  const bool local = cached && r == 1;
  const int64_t rows = local ? C : cached ? len : imin(len, seg * C);
  int64_t tbase = 0, cbase = 0;  // the first token of the per-token rows, the first chunk of the stores
  auto trow = [&](int64_t t) { return (t - tbase) * Kp; };

  // Workspace: two blocks carved by `big_layout` and `layout` (a first pass with base null only counts).
  // Per token [len, Kp]: normalised q, k, read queries, write keys, squash M, statistics A_t, dM/dA, the
  // gradients of the read queries, read keys and write keys (summed over the value heads; with one
  // value head per group only the current chunk's rows [C, Kp], as step 3 consumes them chunk by
  // chunk: row t at grad_row(t)); [len]: rstd.
  T *Qn = nullptr, *Kn = nullptr, *Qr = nullptr, *KW = nullptr, *Mt = nullptr, *At = nullptr, *Dt = nullptr;
  T *dQr = nullptr, *dKn = nullptr, *dKW = nullptr;
  // Per chunk of one value head: S_in^T [Vd, ldk], R^T [Vd, ldr], R [C, ldv], Bm and Aq [C, Cp].
  T *SinT = nullptr, *RT = nullptr, *Rs = nullptr, *Bms = nullptr, *Aqs = nullptr, *rq = nullptr, *rk = nullptr;
  // Without the cache: the state entering each segment [nseg, r, K, ldv], the statistics entering it.
  T *Ck = nullptr, *Ack = nullptr;
  // Chunk operands and gradients.
  T *S = nullptr, *dS = nullptr, *dSg = nullptr, *Vb = nullptr, *G = nullptr, *R = nullptr, *Akk = nullptr,
    *Gam = nullptr;
  T *E = nullptr, *Ed = nullptr, *eC = nullptr, *Kne = nullptr, *Qd = nullptr, *Kd = nullptr, *KWd = nullptr;
  T *KWdT = nullptr, *KWT = nullptr, *Bt = nullptr, *dOX = nullptr;
  T *dAB = nullptr, *dQi = nullptr, *dKi = nullptr, *dKWi = nullptr;
  T *dQd = nullptr, *dKdn = nullptr, *dKWd = nullptr, *dKWdT = nullptr, *dST = nullptr, *ddq = nullptr, *dgam = nullptr,
    *sumC = nullptr, *dbet = nullptr;
  T *tmp = nullptr, *acc = nullptr;
  // Diagonal-decay sub-blocks.
  T *LQK = nullptr, *Fi = nullptr, *KWt = nullptr, *Fj = nullptr, *KWtT = nullptr, *dLQK = nullptr;
  T *dKWt = nullptr, *Pb = nullptr;
  // Token pass.
  T *A0 = nullptr, *dA = nullptr, *A0g = nullptr, *dAg = nullptr, *dqn = nullptr, *dkn = nullptr, *dx = nullptr,
    *qh = nullptr, *ones = nullptr;
  // The per-token arrays and the per-chunk stores (most of the memory) are not zeroed: every element
  // read is written first (padding columns explicitly). The chunk operands are zero-initialised.
  auto big_layout = [&](T* base) {
    int64_t off = 0;
    auto take = [&](T*& ptr, int64_t cnt) {
      ptr = base ? base + off : nullptr;
      off += round_up(cnt > 0 ? cnt : 1, 16);
    };
    const int64_t nt = rows * Kp;
    const int64_t ng = (r == 1 ? C : rows) * Kp;
    take(Qn, nt), take(Kn, nt), take(dQr, ng), take(dKn, ng), take(dKW, ng), take(rq, rows), take(rk, rows);
    take(Qr, s.atq ? nt : 0), take(KW, s.atk ? nt : 0);  // otherwise aliases of Qn and Kn
    take(Mt, s.diag_pre ? nt : 0), take(At, s.diag_pre ? nt + Kp : 0), take(Dt, s.diag_pre ? nt : 0);
    if (At) At += Kp;  // row -1: the statistics entering the first row held
    take(SinT, nst * Vd * ldk), take(RT, nst * Vd * ldr), take(Rs, nst * C * ldv), take(Bms, nst * C * Cp);
    take(Aqs, nst * C * Cp);
    take(Ck, cached || ckpt ? 0 : (nseg > 0 ? nseg : 1) * r * K * ldv);
    take(Ack, !cached && !ckpt && s.diag_pre ? (nseg + 1) * Kp : 0);
    return off;
  };
  // One block kept by the thread across tasks and calls (ScratchLease): the per-token arrays and
  // stores, then the chunk operands (zeroed). A fresh allocation per task paid its page faults.
  const int64_t n_big = big_layout(nullptr);
  auto grad_row = [&](int64_t t) { return (r == 1 ? t % C : t - tbase) * Kp; };
  // Row (b, t, hh) of the gradient view x (t a token index of the batch row, t0 included).
  auto orow = [&](const auto& x, int64_t t, int64_t hh) {
    return mptr<T>(x) + b * x.stride[0] + t * x.stride[1] + hh * x.stride[2];
  };
  auto layout = [&](T* base) {
    int64_t off = 0;
    auto take = [&](T*& ptr, int64_t cnt) {
      ptr = base ? base + off : nullptr;
      off += round_up(cnt > 0 ? cnt : 1, 16);
    };
    take(S, K * ldv), take(dST, cached ? 0 : Vd * ldk), take(dSg, (cached ? nh : r) * K * ldv), take(Vb, C * ldv),
        take(G, C * ldv);
    take(R, C * ldv), take(Akk, C * Cp);
    take(Gam, C * Kp), take(E, C * Kp), take(Ed, C * Kp), take(Kne, C * Kp), take(Qd, C * Kp), take(Kd, C * Kp);
    take(KWd, C * Kp), take(dQi, C * Kp), take(dKi, C * Kp), take(dKWi, C * Kp), take(dgam, C * Kp);
    take(dQd, 2 * Cp * Kp);
    dKdn = dQd ? dQd + Cp * Kp : nullptr;
    take(eC, Kp), take(sumC, Kp), take(acc, Kp), take(Bt, Cp), take(dbet, Cp), take(ddq, Cp), take(tmp, Kp + Cp);
    take(KWdT, K * Cp), take(KWT, K * Cp);
    take(dKWd, C * Kp), take(dOX, C2 * ldv), take(dAB, C2 * Cp);
    take(dKWdT, cached ? K * ldr : 0);
    if (diag) {
      take(LQK, S2 * Kp), take(Fi, kSub * Kp), take(KWt, C * Kp), take(Fj, C * Kp), take(KWtT, K * Cp);
      take(dLQK, S2 * Kp), take(dKWt, C * Kp), take(Pb, S2 * Cp);
    }
    take(A0g, nh * Kp), take(dAg, nh * Kp), take(dqn, Kp), take(dkn, Kp), take(dx, Kp), take(qh, Kp), take(ones, Kp);
    return off;
  };
  const int64_t n_small = layout(nullptr);
  const ScratchLease<T> scratch(n_big + n_small);
  big_layout(scratch.get());
  layout(scratch.get() + n_big);
  std::memset(static_cast<void*>(scratch.get() + n_big), 0, size_t(n_small) * sizeof(T));
  if (!s.atq) Qr = Qn;
  if (!s.atk) KW = Kn;
  for (int64_t c = 0; c < K; ++c) ones[c] = 1;
  // Key head h0 + j of the group becomes the current one: its center, state gradient dS (of the value
  // head being swept), entering statistics A0 and their gradient dA (each head has its own).
  auto select_head = [&](int64_t j) {
    h = h0 + j;
    ctr = s.diag_pre ? s.center(h) : T(0);
    dS = dSg + j * K * ldv, A0 = A0g + j * Kp, dA = dAg + j * Kp;
  };
  select_head(0);

  // 1. Token pass (SPEC §1-2): normalised q (times scale) and k, statistics A_t, M, qr and kw.
  if (s.diag_pre && p.a0.data)
    for (int64_t j = 0; j < nh; ++j) {
      const T* a0 = cptr<T>(p.a0) + si * p.a0.stride[0] + (h0 + j) * p.a0.stride[1];
      for (int64_t c = 0; c < K; ++c) A0g[j * Kp + c] = a0[c];
    }
  // Tokens [ta, tb), the statistics entering them being `a_in` (A0 for ta = 0); with ta > 0 also writes
  // a_in to row ta - 1 of At, which the reverse token pass reads.
  auto token_rows = [&](int64_t ta, int64_t tb, const T* a_in) {
    if (s.diag_pre && ta > 0 && a_in != At + trow(ta - 1)) std::memcpy(At + trow(ta - 1), a_in, size_t(Kp) * sizeof(T));
    for (int64_t t = ta; t < tb; ++t) {
      const int64_t ti = t0 + t;
      if (t + 8 < tb) {
        prefetch(s.qrow(b, ti + 8, h), K * int64_t(sizeof(T)));
        prefetch(s.krow(b, ti + 8, h), K * int64_t(sizeof(T)));
      }
      load_row(s.qrow(b, ti, h), K, p.l2norm, s.scale, Qn + trow(t), rq + (t - tbase));
      load_row(s.krow(b, ti, h), K, p.l2norm, T(1), Kn + trow(t), rk + (t - tbase));
      for (int64_t c = K; c < Kp; ++c) Qn[trow(t) + c] = Kn[trow(t) + c] = 0;
      if (s.diag_pre) {
        const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
        const T* prev = t > ta ? At + trow(t - 1) : a_in;
        const T* kn = Kn + trow(t);
        for (int64_t c = 0; c < Kp; ++c) At[trow(t) + c] = stats1(prev[c], a, bb, kn[c]);
      }
    }
    const int64_t o = trow(ta), n = (tb - ta) * Kp;
    if (s.diag_pre) squash_slope(At + o, Mt + o, Dt + o, n, ctr, s.log_x, s.eps);
    if (s.atq)
      for (int64_t i = o; i < o + n; ++i) Qr[i] = Qn[i] * Mt[i];
    if (s.atk)
      for (int64_t i = o; i < o + n; ++i) KW[i] = Kn[i] * Mt[i];
  };
  // Without a training cache segment by segment (step 2); with one chunk by chunk in the first value
  // head's reverse sweep (the forward saved the statistics entering each chunk), its rows prefetched
  // meanwhile.

  // Chunk operands of tokens [cs, cs + c) for value head hv: gates, decay factors (E = e^gamma, Ed =
  // e^{gamma_C - gamma}: rows of channels for diagonal decay, one value per row otherwise), decayed
  // keys and queries, and their transposes (padding columns cleared, as the stacked products read them).
  auto build = [&](int64_t cs, int64_t c, int64_t hv, bool forward_sweep) {
    for (int64_t i = 0; i < Cp; ++i) Bt[i] = i < c ? s.beta(b, t0 + cs + i, hv) : T(0);
    if (diag) {
      for (int64_t i = 0; i < c; ++i) {
        const T* g = s.grow(b, t0 + cs + i, hv);
        for (int64_t ch = 0; ch < K; ++ch) Gam[i * Kp + ch] = g[ch] + (i ? Gam[(i - 1) * Kp + ch] : T(0));
      }
      const T* gl = Gam + (c - 1) * Kp;
      for (int64_t i = 0; i < c; ++i) {
        for (int64_t ch = 0; ch < Kp; ++ch) {
          E[i * Kp + ch] = Gam[i * Kp + ch];
          Ed[i * Kp + ch] = gl[ch] - Gam[i * Kp + ch];
        }
        exp_inplace(E + i * Kp, Kp);
        exp_inplace(Ed + i * Kp, Kp);
      }
      std::memcpy(eC, gl, size_t(Kp) * sizeof(T));
      exp_inplace(eC, Kp);
    } else {
      for (int64_t i = 0; i < c; ++i) Gam[i] = scal ? s.grow(b, t0 + cs + i, hv)[0] + (i ? Gam[i - 1] : T(0)) : T(0);
      const T gC = Gam[c - 1];
      for (int64_t i = 0; i < c; ++i) E[i] = std::exp(Gam[i]), Ed[i] = std::exp(gC - Gam[i]);  // one per row
      const T ec = std::exp(gC);
      for (int64_t ch = 0; ch < Kp; ++ch) eC[ch] = ec;
    }
    for (int64_t i = 0; i < c; ++i) {
      const T* q = Qr + trow(cs + i);
      const T* k = Kn + trow(cs + i);
      const T* w = KW + trow(cs + i);
      const int64_t o = i * Kp;
      const V er = diag ? V{} : vsplat(E[i]), edr = diag ? V{} : vsplat(Ed[i]);
      for (int64_t ch = 0; ch < Kp; ch += L) {
        const V e = diag ? vload(E + o + ch) : er, kne = vload(k + ch) * e;
        vstore(Kne + o + ch, kne);
        vstore(Kd + o + ch, Bt[i] * kne);
        vstore(Qd + o + ch, vload(q + ch) * e);
        vstore(KWd + o + ch, vload(w + ch) * (diag ? vload(Ed + o + ch) : edr));
      }
    }
    // Transposes KWd^T and KW^T for the forward sweep (the reverse one reads Qd and Kd transposed
    // through gemm_at).
    auto pad = [&](T* m, int64_t ld, int64_t col0) {
      if (c < Cp)
        for (int64_t ch = 0; ch < K; ++ch)
          for (int64_t i = c; i < Cp; ++i) m[ch * ld + col0 + i] = 0;
    };
    if (forward_sweep) {
      transpose(c, K, KWd, Kp, KWdT, Cp), pad(KWdT, Cp, 0);
      transpose(c, K, KW + trow(cs), Kp, KWT, Cp), pad(KWT, Cp, 0);
    }
  };

  // Diagonal decay, rows [i0, i0 + nb) against rows j < jn: e^{gamma_i - gamma_j} = Fi_i * Fj_j with
  // Fi = e^{gamma_i - gamma_i0}, Fj = e^{gamma_i0 - gamma_j}, both <= 1 for g <= 0 and j < i0 (jn = i0);
  // jn = i0 + nb also takes the block's own rows, where Fj >= 1 (see `factorable`).
  // Fills Fi, LQK = [Q ⊙ Fi (kSub rows); K ⊙ Fi (kSub rows)], Fj and KWt = KW ⊙ Fj (rows j < jn).
  auto sub_block = [&](int64_t cs, int64_t i0, int64_t nb, int64_t jn) {
    const T* g0 = Gam + i0 * Kp;
    std::memset(LQK, 0, size_t(S2 * Kp) * sizeof(T));
    for (int64_t i = 0; i < nb; ++i) {
      T* f = Fi + i * Kp;
      for (int64_t ch = 0; ch < Kp; ++ch) f[ch] = Gam[(i0 + i) * Kp + ch] - g0[ch];
      exp_inplace(f, Kp);
      for (int64_t ch = 0; ch < Kp; ++ch) {
        LQK[i * Kp + ch] = Qr[trow(cs + i0 + i) + ch] * f[ch];
        LQK[(kSub + i) * Kp + ch] = Kn[trow(cs + i0 + i) + ch] * f[ch];
      }
    }
    for (int64_t j = 0; j < jn; ++j) {
      T* f = Fj + j * Kp;
      for (int64_t ch = 0; ch < Kp; ++ch) f[ch] = g0[ch] - Gam[j * Kp + ch];
      exp_inplace(f, Kp);
      for (int64_t ch = 0; ch < Kp; ++ch) KWt[j * Kp + ch] = KW[trow(cs + j) + ch] * f[ch];
    }
  };

  // Intra-chunk matrices Bm (strictly lower, without beta; online only) and Aq (lower with the
  // diagonal) (SPEC §4); Bm only for Aq null (the checkpoint sweep).
  auto intra = [&](int64_t cs, int64_t c, T* Bm, T* Aq) {
    if (!Aq && !online) return;
    if (!diag) {
      intra_scalar(c, Cp, K, Kn + trow(cs), Qr + trow(cs), Kp, KWT, Gam, static_cast<const T*>(nullptr), online, Bm, Aq,
                   tmp);
      return;
    }
    std::memset(Bm, 0, size_t(C * Cp) * sizeof(T));
    if (Aq) std::memset(Aq, 0, size_t(C * Cp) * sizeof(T));
    for (int64_t i0 = 0; i0 < c; i0 += kSub) {
      const int64_t nb = imin(kSub, c - i0);
      // Rows j < jn through one product; the block's own pairs too when factorable, else one by one.
      const bool fact = factorable(Gam, Kp, i0, nb);
      const int64_t jn = fact ? i0 + nb : i0;
      if (jn > 0) {
        sub_block(cs, i0, nb, jn);
        transpose(jn, K, KWt, Kp, KWtT, Cp);
        const int64_t o = Aq ? 0 : kSub;  // without Aq only the K rows
        gemm(kSub + nb - o, round_up(jn, L), K, LQK + o * Kp, Kp, KWtT, Cp, Pb + o * Cp, Cp,
             false);  // cols >= jn unused
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t j = 0; j < imin(jn, i0 + i + 1); ++j) {
            if (Aq) Aq[(i0 + i) * Cp + j] = Pb[i * Cp + j];
            if (online && j < i0 + i) Bm[(i0 + i) * Cp + j] = Pb[(kSub + i) * Cp + j];
          }
      }
      if (fact) continue;
      for (int64_t i = i0; i < i0 + nb; ++i) {
        const T* gi = Gam + i * Kp;
        const T* q = Qr + trow(cs + i);
        const T* k = Kn + trow(cs + i);
        for (int64_t j = i0; j <= i; ++j) {
          const T* gj = Gam + j * Kp;
          const T* w = KW + trow(cs + j);
          for (int64_t ch = 0; ch < Kp; ++ch) tmp[ch] = gi[ch] - gj[ch];
          exp_inplace(tmp, Kp);
          for (int64_t ch = 0; ch < Kp; ++ch) tmp[ch] *= w[ch];
          const T sq = Aq ? dotv(q, tmp, Kp) : T(0), sk = dotv(k, tmp, Kp);
          if (Aq) Aq[i * Cp + j] = sq;
          if (online && j < i) Bm[i * Cp + j] = sk;
        }
      }
    }
  };

  // Values of the chunk; the next chunk's rows are prefetched meanwhile.
  auto load_values = [&](int64_t cs, int64_t c, int64_t hv) {
    for (int64_t i = 0; i < c; ++i) {
      if (cs + c + i < len) prefetch(s.vrow(b, t0 + cs + c + i, hv), Vd * int64_t(sizeof(T)));
      copy_row(Vb + i * ldv, s.vrow(b, t0 + cs + i, hv), Vd);
    }
  };
  auto make_akk = [&](int64_t c, const T* Bm) {
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < Cp; ++j) Akk[i * Cp + j] = j < i ? Bt[i] * Bm[i * Cp + j] : T(0);
  };

  // 3. Reverse token pass, token t (called in decreasing t, chunk by chunk from the reverse sweep of the
  // group's last value head, while the chunk's rows are in cache): the preconditioner statistics
  // (SPEC §2, dA carried backwards) and the L2 norm / scale (SPEC §1).
  if (s.diag_pre && p.daT.data)
    for (int64_t j = 0; j < nh; ++j) {
      const T* daT = cptr<T>(p.daT) + si * p.daT.stride[0] + (h0 + j) * p.daT.stride[1];
      for (int64_t c = 0; c < K; ++c) dAg[j * Kp + c] = daT[c];
    }
  auto token_grad = [&](int64_t t) {
    const int64_t ti = t0 + t;
    const T* qn = Qn + trow(t);
    const T* kn = Kn + trow(t);
    const T* m = Mt + trow(t);
    const T* gq = dQr + grad_row(t);
    const T* gk = dKn + grad_row(t);
    const T* gw = dKW + grad_row(t);
    for (int64_t c = 0; c < Kp; c += L) {
      const V mv = s.diag_pre ? vload(m + c) : V{};
      vstore(dqn + c, s.atq ? vload(gq + c) * mv : vload(gq + c));
      vstore(dkn + c, vload(gk + c) + (s.atk ? vload(gw + c) * mv : vload(gw + c)));
    }
    if (s.diag_pre) {
      const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
      const T* cur = At + trow(t);
      const T* prev = t ? At + trow(t - 1) : A0;
      const T* slope = Dt + trow(t);
      // dr = dM/dr (through M's slope), dAc = dL/dA_t; the gate sums are dots of these rows.
      T* dr = dx;
      T* dAc = qh;
      for (int64_t c = 0; c < Kp; c += L) {
        const V knv = vload(kn + c);
        const V dmA = (s.atk ? vload(gw + c) * knv : vload(gq + c) * vload(qn + c)) * vload(slope + c);
        const V dac = vload(dA + c) + dmA;
        vstore(dr + c, dmA * (vload(cur + c) + s.eps));
        vstore(dAc + c, dac);
        vstore(dkn + c, vload(dkn + c) + T(2) * bb * knv * dac);
        vstore(dA + c, a * dac);
      }
      const T dc = -dotv(dr, ones, K), dgp = a * dotv(dAc, prev, K);
      for (int64_t c = 0; c < K; ++c) dr[c] = kn[c] * kn[c];
      const T dbp = dotv(dAc, dr, K);
      dcenter_out[h - h0] += double(dc);
      if (p.dg_p.data) *orow(p.dg_p, ti, h) = dgp;
      if (p.dbeta_p.data) *orow(p.dbeta_p, ti, h) = dbp;
    }
    if (p.dq.data) {
      // The normalised q: Qn / scale, or from the input row when scale is 0.
      if (p.l2norm) {
        if (s.scale != T(0)) {
          const T inv = T(1) / s.scale;
          for (int64_t c = 0; c < K; ++c) qh[c] = qn[c] * inv;
        } else {
          const T* x = s.qrow(b, ti, h);
          for (int64_t c = 0; c < K; ++c) qh[c] = x[c] * rq[t - tbase];
        }
      }
      norm_backward(qh, rq[t - tbase], K, p.l2norm, s.scale, dqn, orow(p.dq, ti, h));
    }
    if (p.dk.data) norm_backward(kn, rk[t - tbase], K, p.l2norm, T(1), dkn, orow(p.dk, ti, h));
  };

  // Chunk ci of value head hv from the training cache: S_in^T and R^T (padding cleared as the forward
  // sweep leaves it), Aq and Bm unpacked from P. Offline, R = Diag(beta) V (Bt of the chunk built).
  auto load_saved = [&](int64_t hv, int64_t ci, int64_t cs, int64_t c) {
    const int64_t ld = p.saved_ld, pld = p.saved_pld;
    const T* blk = sv + (hv * nch + ci) * p.saved_block;
    transpose(K, Vd, blk, ld, SinT, ldk);
    // The gate gradient's chunk-total term sum_e S_in[c, e] dS_out[c, e] (dS is this chunk's dS_out until
    // the end of reverse_chunk), while the saved rows are in cache.
    if (decays)
      for (int64_t ch = 0; ch < Kp; ++ch) sumC[ch] = ch < K ? dotv(blk + ch * ld, dS + ch * ldv, Vd) : T(0);
    if (K < Kp)
      for (int64_t e = 0; e < Vd; ++e)
        for (int64_t ch = K; ch < Kp; ++ch) SinT[e * ldk + ch] = 0;
    // R^T straight from the saved rows (online; the reverse sweep reads R only as R^T here).
    if (online) {
      transpose(c, Vd, blk + K * ld, ld, RT, ldr);
    } else {
      for (int64_t i = 0; i < c; ++i) {
        const T* v = s.vrow(b, t0 + cs + i, hv);
        for (int64_t e = 0; e < Vd; ++e) Rs[i * ldv + e] = Bt[i] * v[e];
        for (int64_t e = Vd; e < Vp; ++e) Rs[i * ldv + e] = 0;
      }
      transpose(c, Vd, Rs, ldv, RT, ldr);
    }
    if (c < Cp)
      for (int64_t e = 0; e < Vd; ++e)
        for (int64_t i = c; i < Cp; ++i) RT[e * ldr + i] = 0;
    const T* P = blk + K * ld + (online ? C * ld : 0);
    const V iota = iota_v<T>();
    if (online) transpose(c, c, P, pld, Bms, Cp);  // Bm[i][j] = P[j][i], kept for j < i below
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < Cp; j += L) {
        const V jv = iota + T(j), pv = vload(P + i * pld + j);
        vstore(Aqs + i * Cp + j, sel(jv <= vsplat(T(i)), pv, V{}));
        if (online) vstore(Bms + i * Cp + j, sel(jv < vsplat(T(i)), vload(Bms + i * Cp + j), V{}));
      }
  };

  // Reverse sweep: dO and dX stacked in dOX, dAq and dB in dAB. The strided rows of the (head, chunk)
  // processed next are prefetched from inside this chunk's products (Trickle); `steps` is the number of
  // step() calls of the chunk before.
  T* dO = dOX;
  T* dX = dOX + Cp * ldv;
  T* dAq = dAB;
  T* dB = dAB + Cp * Cp;
  auto do_row = [&](int64_t t, int64_t hv) {
    return cptr<T>(p.d_o) + b * p.d_o.stride[0] + (t0 + t) * p.d_o.stride[1] + hv * p.d_o.stride[2];
  };
  Trickle<T> tr;
  int64_t steps = 200;
  // dS = dhT of value head hv: the gradient of the state leaving the last chunk.
  auto init_ds = [&](int64_t hv) {
    std::memset(dS, 0, size_t(K * ldv) * sizeof(T));
    if (p.dhT.data) {
      const T* dhT = s.state(p.dhT, si, hv);
      for (int64_t c = 0; c < K; ++c) std::memcpy(dS + c * ldv, dhT + c * p.dhT.stride[2], size_t(Vd) * sizeof(T));
    }
  };
  auto write_dh0 = [&](int64_t hv) {
    if (p.dh0.data) {
      T* dh0 = s.state(p.dh0, si, hv);
      for (int64_t c = 0; c < K; ++c) std::memcpy(dh0 + c * p.dh0.stride[2], dS + c * ldv, size_t(Vd) * sizeof(T));
    }
  };
  // Chunk ci of value head h * r + jh, dS carried from the chunk after it to this one's entry; the head
  // processed next is value head hn * r + jh at chunk start csn (none for csn < 0).
  auto reverse_chunk = [&](int64_t jh, int64_t ci, int64_t hn, int64_t csn) {
    const int64_t hv = h * r + jh, hvn = hn * r + jh;
    const int64_t cs = ci * C, c = imin(C, len - cs);
    const int64_t cj = cached ? 0 : ci - cbase;  // index in the per-chunk stores
    const T* Bm = Bms + cj * C * Cp;
    const T* Aq = Aqs + cj * C * Cp;
    const T* SinTc = SinT + cj * Vd * ldk;
    const T* RTc = RT + cj * Vd * ldr;
    const T* Rc = Rs + cj * C * ldv;
    if (local) tbase = cs;
    if (cached && jh == 0)
      token_rows(cs, cs + c, ci == 0 ? A0 : sv + (h * r * nch + ci) * p.saved_block + p.saved_aoff);
    build(cs, c, hv, false);
    if (cached) load_saved(hv, ci, cs, c);
    if (c < Cp) {  // rows past the chunk enter the stacked products as zeros (padding columns stay 0)
      std::memset(dO + c * ldv, 0, size_t((Cp - c) * ldv) * sizeof(T));
      std::memset(dX + c * ldv, 0, size_t((Cp - c) * ldv) * sizeof(T));
    }
    // This chunk's dq and dk rows (one page each), written by its reverse token pass after the
    // products below: prefetched for writing first thing in this chunk (from the chunk before, most
    // lines were evicted again by then, and the token pass stalled on its stores).
    if (jh == r - 1) {
      const int64_t ts = int64_t(sizeof(T));
      if (p.dq.data) tr.prefetch(orow(p.dq, t0 + cs, h), p.dq.stride[1] * ts, c, K * ts, true);
      if (p.dk.data) tr.prefetch(orow(p.dk, t0 + cs, h), p.dk.stride[1] * ts, c, K * ts, true);
    }
    // The strided input rows (one page each) of the (head, chunk) processed next; contiguous data (the
    // per-token arrays, the saved block) is left to the hardware prefetcher (measured faster).
    if (csn >= 0) {
      const int64_t pc = csn, cn = imin(C, len - csn), ts = int64_t(sizeof(T));
      tr.prefetch(do_row(pc, hvn), p.d_o.stride[1] * ts, cn, Vd * ts);
      tr.prefetch(s.vrow(b, t0 + pc, hvn), p.v.stride[1] * ts, cn, Vd * ts);
      if (diag) tr.prefetch(s.grow(b, t0 + pc, hvn), p.g.stride[1] * ts, cn, K * ts);
      if (cached && jh == 0) {  // the rows of the next token pass
        tr.prefetch(s.qrow(b, t0 + pc, hn), p.q.stride[1] * ts, cn, K * ts);
        tr.prefetch(s.krow(b, t0 + pc, hn), p.k.stride[1] * ts, cn, K * ts);
      }
      // Output rows written next (the stores then find their lines owned).
      if (p.dv.data) tr.prefetch(orow(p.dv, t0 + pc, hvn), p.dv.stride[1] * ts, cn, Vd * ts, true);
      if (diag && p.dg.data) tr.prefetch(orow(p.dg, t0 + pc, hvn), p.dg.stride[1] * ts, cn, K * ts, true);
    }
    tr.plan(steps);
    for (int64_t i = 0; i < c; ++i) copy_row(dO + i * ldv, do_row(cs + i, hv), Vd);
    // dR = Aq^T dO + KWd dS_out; dX = (I + Akk)^{-T} dR (online) or dR (offline).
    gemm_at(c, Vp, c, Aq, Cp, dO, ldv, dX, ldv, false, true, &tr);  // Aq^T: upper-triangular
    gemm(c, Vp, K, KWd, Kp, dS, ldv, dX, ldv, true, Tri::none, &tr);
    if (online) {
      make_akk(c, Bm);
      unit_solve(c, Vp, Akk, Cp, dX, ldv, true);
    }
    // X = beta V - Kd S_in: dv = beta dX, dbeta += V . dX.
    for (int64_t i = 0; i < c; ++i) {
      const T* v = s.vrow(b, t0 + cs + i, hv);
      dbet[i] = dotv(v, dX + i * ldv, Vd);
      if (p.dv.data) {
        T* dv = orow(p.dv, t0 + cs + i, hv);
        for (int64_t e = 0; e < Vd; ++e) dv[e] = Bt[i] * dX[i * ldv + e];
      }
    }
    // dAq = dO R^T (j <= i); dAkk = -dX R^T (j < i): dbeta_i += sum_j dAkk_ij Bm_ij, dB = beta dAkk.
    if (!online) std::memset(dB, 0, size_t(Cp * Cp) * sizeof(T));  // the diagonal-decay path reads it
    gemm(c, Cp, Vd, dO, ldv, RTc, ldr, dAq, Cp, false, Tri::c_lower, &tr);
    // The diagonal of Aq carries no gate (e^0): its gradient is kept apart in ddq so that the gate
    // gradient below only sums terms with a decay factor (no cancellation of O(1) terms at g << 0).
    // Masks in vector lanes (column index j against the row i).
    split_diagonal(dAq, c, Cp, ddq);
    if (online) {
      gemm(c, Cp, Vd, dX, ldv, RTc, ldr, dB, Cp, false, Tri::c_lower, &tr);
      dakk_rows(dB, Bm, Bt, c, Cp, dbet);
    }
    // Intra-chunk backward: dQi = d(Aq)/dQ, dKi = d(Bm)/dK, dKWi = d(Aq, Bm)/dKW (row layout).
    // Scalar decay and none: the products below write every row (dKi only online); diagonal: sums.
    if (diag || !online) std::memset(dKi, 0, size_t(C * Kp) * sizeof(T));
    if (diag) {
      std::memset(dQi, 0, size_t(C * Kp) * sizeof(T));
      std::memset(dKWi, 0, size_t(C * Kp) * sizeof(T));
    }
    if (!diag) {
      if (scal)
        for (int64_t i = 0; i < c; ++i) {
          gate_row(Gam, i, Cp, tmp);
          for (int64_t j = 0; j < Cp; j += L) {
            vstore(dAq + i * Cp + j, vload(dAq + i * Cp + j) * vload(tmp + j));
            vstore(dB + i * Cp + j, vload(dB + i * Cp + j) * vload(tmp + j));
          }
        }
      gemm(c, Kp, c, dAq, Cp, KW + trow(cs), Kp, dQi, Kp, false, Tri::a_lower);
      if (online) gemm(c, Kp, c, dB, Cp, KW + trow(cs), Kp, dKi, Kp, false, Tri::a_lower);
      gemm_at(c, Kp, c, dAq, Cp, Qr + trow(cs), Kp, dKWi, Kp, false, true);
      if (online) gemm_at(c, Kp, c, dB, Cp, Kn + trow(cs), Kp, dKWi, Kp, true, true);
    } else {
      for (int64_t i0 = 0; i0 < c; i0 += kSub) {
        const int64_t nb = imin(kSub, c - i0);
        // The block's own pairs: through the product below when factorable (as in `intra`), else
        // one by one with exact exponent differences.
        const bool fact = factorable(Gam, Kp, i0, nb);
        const int64_t jn = fact ? i0 + nb : i0;
        for (int64_t i = i0; !fact && i < i0 + nb; ++i) {
          const T* gi = Gam + i * Kp;
          const T* q = Qr + trow(cs + i);
          const T* k = Kn + trow(cs + i);
          for (int64_t j = i0; j < i; ++j) {
            const T a = dAq[i * Cp + j], bq = dB[i * Cp + j];
            const T* gj = Gam + j * Kp;
            const T* w = KW + trow(cs + j);
            for (int64_t ch = 0; ch < Kp; ++ch) tmp[ch] = gi[ch] - gj[ch];
            exp_inplace(tmp, Kp);
            T* dq = dQi + i * Kp;
            T* dk = dKi + i * Kp;
            T* dw = dKWi + j * Kp;
            for (int64_t ch = 0; ch < K; ++ch) {
              const T x = tmp[ch] * w[ch];
              dq[ch] += a * x;
              dk[ch] += bq * x;
              dw[ch] += (a * q[ch] + bq * k[ch]) * tmp[ch];
            }
          }
        }
        if (jn == 0) continue;
        // Rows j < jn (dAq and dB vanish for j >= i): dLQ = dAq[block, :jn] KWt, dLK = dB[block, :jn] KWt;
        // dKWt = dAq^T LQ + dB^T LK.
        sub_block(cs, i0, nb, jn);
        std::memset(dLQK, 0, size_t(S2 * Kp) * sizeof(T));
        gemm(nb, Kp, jn, dAq + i0 * Cp, Cp, KWt, Kp, dLQK, Kp, false);
        if (online) gemm(nb, Kp, jn, dB + i0 * Cp, Cp, KWt, Kp, dLQK + kSub * Kp, Kp, false);
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t ch = 0; ch < Kp; ++ch) {
            dQi[(i0 + i) * Kp + ch] += dLQK[i * Kp + ch] * Fi[i * Kp + ch];
            dKi[(i0 + i) * Kp + ch] += dLQK[(kSub + i) * Kp + ch] * Fi[i * Kp + ch];
          }
        gemm_at(jn, Kp, nb, dAq + i0 * Cp, Cp, LQK, Kp, dKWt, Kp, false);
        if (online) gemm_at(jn, Kp, nb, dB + i0 * Cp, Cp, LQK + kSub * Kp, Kp, dKWt, Kp, true);
        for (int64_t j = 0; j < jn; ++j)
          for (int64_t ch = 0; ch < Kp; ++ch) dKWi[j * Kp + ch] += dKWt[j * Kp + ch] * Fj[j * Kp + ch];
      }
    }
    // Inter-chunk products: dQd = dO S_in^T, dKdn = dX S_in^T (dKd = -dKdn), dKWd = R dS_out^T.
    if (online && c == Cp) {  // dO and dX are adjacent in dOX, dQd and dKdn in dQK: one product
      gemm(2 * Cp, Kp, Vd, dOX, ldv, SinTc, ldk, dQd, Kp, false, Tri::none, &tr);
    } else {
      gemm(c, Kp, Vd, dO, ldv, SinTc, ldk, dQd, Kp, false);
      if (online) gemm(c, Kp, Vd, dX, ldv, SinTc, ldk, dKdn, Kp, false);
    }
    // With the cache, as dKWd^T = dS_out R^T (R^T is at hand; K x c to transpose instead of K x V).
    if (cached) {
      gemm(K, Cp, Vd, dS, ldv, RTc, ldr, dKWdT, ldr, false, Tri::none, &tr);
      transpose(K, c, dKWdT, ldr, dKWd, Kp);
    } else {
      transpose(K, Vd, dS, ldv, dST, ldk);
      gemm(c, Kp, Vd, Rc, ldv, dST, ldk, dKWd, Kp, false, Tri::none, &tr);
    }
    // Gate gradient: dgamma_i = Q ⊙ dQ - KW ⊙ dKW + K ⊙ dK over every e^{+-gamma} factor, plus the
    // chunk-total terms (S_out's decay and KWd's e^{gamma_C}) on the last row.
    if (decays) {
      for (int64_t ch = 0; ch < Kp; ++ch) acc[ch] = 0;
      if (!cached) {  // (with the cache load_saved computed sumC, from the saved rows while in cache)
        for (int64_t ch = 0; ch < Kp; ++ch) sumC[ch] = 0;
        for (int64_t e = 0; e < Vd; ++e)
          for (int64_t ch = 0; ch < Kp; ++ch) sumC[ch] += SinTc[e * ldk + ch] * dST[e * ldk + ch];
      }
      // The last row's KWd has no gate (e^0): left out here and below.
      for (int64_t j = 0; j + 1 < c; ++j)
        for (int64_t ch = 0; ch < K; ++ch) acc[ch] += KWd[j * Kp + ch] * dKWd[j * Kp + ch];
      for (int64_t ch = 0; ch < K; ++ch) sumC[ch] = eC[ch] * sumC[ch] + acc[ch];
    }
    for (int64_t i = 0; i < c; ++i) {
      const int64_t t = cs + i;
      const T* q = Qr + trow(t);
      const T* k = Kn + trow(t);
      const T* w = KW + trow(t);
      T* gq = dQr + grad_row(t);
      T* gk = dKn + grad_row(t);
      T* gw = dKW + grad_row(t);
      T* dgm = dgam + i * Kp;
      if (online) dbet[i] -= dotv(dKdn + i * Kp, Kne + i * Kp, K);
      const T dd = ddq[i], last = i + 1 < c ? T(1) : T(0), bt = Bt[i];
      const V er = diag ? V{} : vsplat(E[i]), edr = diag ? V{} : vsplat(Ed[i]);
      // Whole padded rows (padding lanes of every operand are zero or finite; only [0, K) is read
      // later); the first value head of the group initialises the token gradients.
      for (int64_t ch = 0; ch < Kp; ch += L) {
        const int64_t o = i * Kp + ch;
        const V dqd = vload(dQd + o), dkd = online ? vload(dKdn + o) : V{};
        const V dwd = vload(dKWd + o), dwi = vload(dKWi + o), dqi = vload(dQi + o), dki = vload(dKi + o);
        const V e = diag ? vload(E + o) : er, qv = vload(q + ch), kv = vload(k + ch), wv = vload(w + ch);
        const V g0q = jh ? vload(gq + ch) : V{}, g0k = jh ? vload(gk + ch) : V{}, g0w = jh ? vload(gw + ch) : V{};
        vstore(gq + ch, g0q + dqi + dqd * e + dd * wv);
        vstore(gk + ch, g0k + dki - dkd * bt * e);
        vstore(gw + ch, g0w + dwi + dwd * (diag ? vload(Ed + o) : edr) + dd * qv);
        if (decays)
          vstore(dgm + ch, qv * dqi + kv * dki - wv * dwi + dqd * vload(Qd + o) - dkd * vload(Kd + o) -
                               last * dwd * vload(KWd + o));
      }
    }
    if (jh == r - 1)  // the token gradients of the chunk are complete
      for (int64_t i = c - 1; i >= 0; --i) token_grad(cs + i);
    // dg_t = sum over the chunk's rows i >= t of dgamma_i (gamma is a within-chunk prefix sum).
    if (decays) {
      for (int64_t ch = 0; ch < K; ++ch) dgam[(c - 1) * Kp + ch] += sumC[ch];
      if (p.dg.data) {
        if (diag) {
          suffix_sums(dgam, Kp, c, K, orow(p.dg, t0 + cs, hv), p.dg.stride[1]);
        } else {
          T a = 0;
          for (int64_t i = c - 1; i >= 0; --i) {
            a += dotv(dgam + i * Kp, ones, K);
            *orow(p.dg, t0 + cs + i, hv) = a;
          }
        }
      }
    }
    if (s.gain && p.dbeta.data)
      for (int64_t i = 0; i < c; ++i) *orow(p.dbeta, t0 + cs + i, hv) = dbet[i];
    // dS_in = Diag(e^{gamma_C}) dS_out + Qd^T dO - Kd^T dX (one product over the stacked operands when
    // Qd and Kd are adjacent whole chunks, as dO and dX are; the decay applied by its row scales).
    if (online)
      for (int64_t i = 0; i < c * ldv; ++i) dX[i] = -dX[i];
    const T* ds_scale = decays ? eC : nullptr;
    if (online && c == Cp && C == Cp && Kd == Qd + Cp * Kp) {
      gemm_at(K, Vp, C2, Qd, Kp, dOX, ldv, dS, ldv, true, false, &tr, ds_scale);
    } else {
      gemm_at(K, Vp, c, Qd, Kp, dO, ldv, dS, ldv, true, false, &tr, ds_scale);
      if (online) gemm_at(K, Vp, c, Kd, Kp, dX, ldv, dS, ldv, true, false, &tr);
    }
    steps = tr.steps();
    tr.drain_all();
  };

  // Forward sweep of chunk ci of value head hv: S (the chunk's entry state) becomes its exit state;
  // with `store`, S_in^T, R^T, R, Bm and Aq are kept in slot ci - cbase of the per-chunk stores.
  auto forward_chunk = [&](int64_t ci, int64_t hv, bool store) {
    const int64_t cs = ci * C, c = imin(C, len - cs), cj = store ? ci - cbase : 0;
    T* Bm = Bms + cj * C * Cp;
    T* Aq = Aqs + cj * C * Cp;
    build(cs, c, hv, true);
    intra(cs, c, Bm, store ? Aq : nullptr);
    load_values(cs, c, hv);
    if (online) {
      gemm(c, Vp, K, Kd, Kp, S, ldv, G, ldv, false);
      for (int64_t i = 0; i < c; ++i)
        for (int64_t e = 0; e < Vp; ++e) R[i * ldv + e] = Bt[i] * Vb[i * ldv + e] - G[i * ldv + e];
      make_akk(c, Bm);
      unit_solve(c, Vp, Akk, Cp, R, ldv, false);
    } else {
      for (int64_t i = 0; i < c; ++i)
        for (int64_t e = 0; e < Vp; ++e) R[i * ldv + e] = Bt[i] * Vb[i * ldv + e];
    }
    if (store) {
      std::memcpy(Rs + cj * C * ldv, R, size_t(c * ldv) * sizeof(T));
      T* st = SinT + cj * Vd * ldk;
      T* rt = RT + cj * Vd * ldr;
      transpose(K, Vd, S, ldv, st, ldk);
      transpose(c, Vd, R, ldv, rt, ldr);
      for (int64_t e = 0; e < Vd; ++e) {
        for (int64_t ch = K; ch < Kp; ++ch) st[e * ldk + ch] = 0;
        for (int64_t i = c; i < Cp; ++i) rt[e * ldr + i] = 0;
      }
    }
    gemm(K, Vp, c, KWdT, Cp, R, ldv, S, ldv, true, Tri::none, static_cast<Trickle<T>*>(nullptr),
         decays ? eC : nullptr);  // S_out = Diag(e^{gamma_C}) S_in + KWdT R
  };

  // 2. Without a training cache: the checkpoint sweep over every segment but the last, then per
  // segment in reverse the token pass, and per value head the segment's forward sweep (storing S_in^T,
  // R^T, Bm, Aq) and its reverse sweep (which runs step 3 for the last value head).
  if (!cached) {
    auto ck = [&](int64_t sg, int64_t jh) { return Ck + (sg * r + jh) * K * ldv; };
    // The checkpoint cache's block of segment sg and value head h r + jh.
    auto saved_ck = [&](int64_t sg, int64_t jh) { return saved + ((h * r + jh) * nseg + sg) * p.saved_block; };
    // Segment sg (chunks [c0, c1)): the token pass, per value head the forward sweep from the segment's
    // checkpoint, then the reverse sweep (`back`) or the checkpoint of the next segment.
    auto segment = [&](int64_t sg, bool back) {
      const int64_t c0 = sg * seg, c1 = imin(nch, c0 + seg);
      tbase = c0 * C, cbase = c0;
      token_rows(c0 * C, imin(len, c1 * C),
                 !s.diag_pre || sg == 0 ? A0 : ckpt ? saved_ck(sg, 0) + p.saved_aoff : Ack + sg * Kp);
      if (s.diag_pre && !back) std::memcpy(Ack + (sg + 1) * Kp, At + trow(c1 * C - 1), size_t(Kp) * sizeof(T));
      for (int64_t jh = 0; jh < r; ++jh) {
        if (ckpt) {
          const T* src = saved_ck(sg, jh);
          for (int64_t c = 0; c < K; ++c) {
            std::memcpy(S + c * ldv, src + c * p.saved_ld, size_t(Vd) * sizeof(T));
            std::memset(static_cast<void*>(S + c * ldv + Vd), 0, size_t(ldv - Vd) * sizeof(T));
          }
        } else {
          std::memcpy(S, ck(sg, jh), size_t(K * ldv) * sizeof(T));
        }
        for (int64_t ci = c0; ci < c1; ++ci) forward_chunk(ci, h * r + jh, back);
        if (!back) std::memcpy(ck(sg + 1, jh), S, size_t(K * ldv) * sizeof(T));
        dS = dSg + jh * K * ldv;
        for (int64_t ci = c1 - 1; back && ci >= c0; --ci) reverse_chunk(jh, ci, h, ci > c0 ? (ci - 1) * C : -1);
      }
    };
    for (int64_t jh = 0; jh < r; ++jh) {
      if (!ckpt) {
        T* s0c = ck(0, jh);
        std::memset(s0c, 0, size_t(K * ldv) * sizeof(T));
        if (p.h0.data) {
          const T* s0 = s.state(p.h0, si, h * r + jh);
          for (int64_t c = 0; c < K; ++c) std::memcpy(s0c + c * ldv, s0 + c * p.h0.stride[2], size_t(Vd) * sizeof(T));
        }
      }
      dS = dSg + jh * K * ldv, init_ds(h * r + jh);
    }
    if (s.diag_pre && !ckpt) std::memcpy(Ack, A0, size_t(Kp) * sizeof(T));
    for (int64_t sg = 0; !ckpt && sg + 1 < nseg; ++sg) segment(sg, false);
    for (int64_t sg = nseg - 1; sg >= 0; --sg) segment(sg, true);
    for (int64_t jh = 0; jh < r; ++jh) dS = dSg + jh * K * ldv, write_dh0(h * r + jh);
  }
  // With a training cache, one key head: the reverse sweep of each value head.
  for (int64_t jh = 0; cached && nh == 1 && jh < r; ++jh) {
    init_ds(h * r + jh);
    for (int64_t ci = nch - 1; ci >= 0; --ci) reverse_chunk(jh, ci, h, ci > 0 ? (ci - 1) * C : -1);
    write_dh0(h * r + jh);
  }
  if (nh > 1) {  // training cache, r = 1: the group's heads chunk by chunk
    for (int64_t j = 0; j < nh; ++j) select_head(j), init_ds(h);
    for (int64_t ci = nch - 1; ci >= 0; --ci)
      for (int64_t j = 0; j < nh; ++j) {
        select_head(j);
        if (j + 1 < nh)
          reverse_chunk(0, ci, h + 1, ci * C);
        else
          reverse_chunk(0, ci, h0, ci > 0 ? (ci - 1) * C : -1);
      }
    for (int64_t j = 0; j < nh; ++j) select_head(j), write_dh0(h);
  }

  if (s.diag_pre && p.da0.data)
    for (int64_t j = 0; j < nh; ++j) {
      T* da0 = mptr<T>(p.da0) + si * p.da0.stride[0] + (h0 + j) * p.da0.stride[1];
      for (int64_t c = 0; c < K; ++c) da0[c] = dAg[j * Kp + c];
    }
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
