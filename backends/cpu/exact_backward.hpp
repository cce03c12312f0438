/// @brief Backward of the exact preconditioners on the CPU (ExactATK: Mesa layer, ExactATQ: ridge readout, with
/// every decay, gain and solve): the recurrence of SPEC §2 in reverse, vectorised, the inverse Gram in double.
///
/// One task per (sequence, key head) with its r = HV / H value heads. The recurrence has no chunkwise form here, so
/// the backward walks the tokens in reverse (SPEC §3.8):
///  1. a forward sweep runs the inverse Gram P over the whole sequence (ExactPre of decode.hpp, the forward's own
///     steps) and keeps, per token, y = P_{t-1} k (and w = P_{t-1} q for ExactATQ) and four scalars in double,
///     and the states S every `chunk` tokens;
///  2. per chunk, in reverse: the chunk's states are recomputed with sub-checkpoints every kExactSub tokens, and
///     per sub-block the states S_{t-1} of its tokens are held; the state gradient dS runs back over the tokens
///     (dv, dbeta, dg, and the gradients of the read query, read key and write key), then
///  3. the preconditioner's gradient runs back over the same tokens. P_{t-1} = a P_t + f y y^T undoes the
///     Sherman-Morrison step exactly (a sum of two positive semi-definite terms, no cancellation), so P is never
///     stored per token. The gradient Pi = dL/dP (raw: of the update as written, y = P k and z = P^T k apart, as
///     the reference) runs back with it: with G = Pi_t + dm tgt^T (the mapped vector's own term),
///       dc = -y^T G y / a, dy = -c G y / a + dden b k, dz = -c G^T y / a, dden = -dc c / den,
///       Pi_{t-1} = G / a + dy k^T + k dz^T,  dk += dden b y + P_{t-1} (dy + dz),
///       dbeta_p = dc / den + dden kappa,  dg_p = a (dden - <G, P_t> / a),
///     (c = f = beta_p / den, den = a + beta_p kappa, kappa = k^T y). One sweep over P and Pi per token does the
///     step of token t and the reads of token t - 1 (G y, G^T y, <G, P>, P dm; P is symmetric, so products with it
///     are column sums).
/// Memory per task: O(L K) doubles (the y rows), O(L / chunk r K V) for the checkpoints, O(kExactSub r K V).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "backward_steps.hpp"
#include "convert.hpp"
#include "decode.hpp"
#include "gemm.hpp"
#include "scratch.hpp"
#include "setup.hpp"
#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Tokens whose states S_{t-1} the backward holds at once (kExactSub r K V elements).
constexpr int64_t kExactSub = 8;

/// Sum of the lanes.
template <class T>
inline T lane_sum(const typename Vec<T>::type& x) {
  return hsum<T>(x);
}

// ---------------------------------------------------------------------------------------------
// The state side (T): K rows of Vp (zero padding), one value head.

/// One token: u = v - sum_c ck[c] S[c,:] (Online) or v, then S[c,:] = fac[c] S[c,:] + w[c] u (w = beta kw). The
/// state before the token is copied to `keep` when given. `u` holds v on entry (Vp, zero padding).
template <class T>
void state_step(T* S, int64_t K, int64_t Vp, const T* fac, const T* ck, const T* w, bool online, T* u, T* keep) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  if (online || keep) {
    for (int64_t e = 0; e < Vp; e += 4 * L) {
      const int nb = int(imin(4, (Vp - e) / L));
      V acc[4] = {};
      for (int64_t c = 0; c < K; ++c) {
        const T* row = S + c * Vp + e;
        const V x = vsplat(-ck[c]);
        for (int v = 0; v < nb; ++v) {
          const V s = vload(row + v * L);
          if (keep) vstore(keep + c * Vp + e + v * L, s);
          acc[v] += x * s;
        }
      }
      if (online)
        for (int v = 0; v < nb; ++v) vstore(u + e + v * L, vload(u + e + v * L) + acc[v]);
    }
  }
  for (int64_t c = 0; c < K; ++c) {
    T* row = S + c * Vp;
    const V f = vsplat(fac[c]), x = vsplat(w[c]);
    for (int64_t e = 0; e < Vp; e += L) vstore(row + e, f * vload(row + e) + x * vload(u + e));
  }
}

/// What the state side of one token's backward gives the key side.
template <class T>
struct StateGrads {
  T* dqr;  ///< += dL/d(read query), K
  T* dkw;  ///< += dL/d(write key), K
  T* dkn;  ///< += dL/d(read key) (Online), K
};

/// Backward of one token on one value head. dS (rows of Vp) holds dL/dS_t on entry, dL/dS_{t-1} on exit. Sp is
/// S_{t-1}, u the residual (or v), dout the output's cotangent (Vp, zero padding); fac the decay factors, kn, qr,
/// kw the token's read key, read query, write key, bet the gain. Writes dv (Vp) and returns dbeta; the per-row
/// decay gradient fac[c] (Sp[c,:] . dSbar[c,:]) goes to dgc.
template <class T>
T state_backward(T* dS, const T* Sp, int64_t K, int64_t Vp, const T* u, const T* dout, const T* fac, const T* kn,
                 const T* qr, const T* kw, T bet, bool online, const StateGrads<T>& g, T* dv, T* dgc) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  // Pass 1: dS_t += qr do^T; su = dS_t u, sd = Sp do, du = sum_c kw[c] dS_t[c,:].
  for (int64_t e = 0; e < Vp; e += L) vstore(dv + e, V{});
  const T udo = dotv(u, dout, Vp);
  T db = 0;
  for (int64_t c = 0; c < K; ++c) {
    T* row = dS + c * Vp;
    const T* sp = Sp + c * Vp;
    const V q = vsplat(qr[c]), w = vsplat(kw[c]);
    V su{}, sd{};
    for (int64_t e = 0; e < Vp; e += L) {
      const V d = vload(dout + e);
      const V x = vload(row + e) + q * d;
      vstore(row + e, x);
      su += x * vload(u + e);
      sd += vload(sp + e) * d;
      vstore(dv + e, vload(dv + e) + w * x);
    }
    const T suc = lane_sum<T>(su);
    g.dqr[c] += fac[c] * lane_sum<T>(sd) + bet * kw[c] * udo;
    g.dkw[c] += bet * suc;
    db += kw[c] * suc;
  }
  const V vb = vsplat(bet);
  for (int64_t e = 0; e < Vp; e += L) vstore(dv + e, vb * vload(dv + e));
  // Pass 2: dSbar = dS_t - kn du^T (Online), dkn -= Sbar du, dgc = fac (Sp . dSbar), dS_{t-1} = fac dSbar.
  for (int64_t c = 0; c < K; ++c) {
    T* row = dS + c * Vp;
    const T* sp = Sp + c * Vp;
    const V kc = vsplat(online ? kn[c] : T(0)), f = vsplat(fac[c]);
    V sr{}, sg{};
    for (int64_t e = 0; e < Vp; e += L) {
      const V s = vload(sp + e);
      const V x = vload(row + e) - kc * vload(dv + e);
      sr += s * vload(dv + e);
      sg += s * x;
      vstore(row + e, f * x);
    }
    if (online) g.dkn[c] -= fac[c] * lane_sum<T>(sr);
    dgc[c] = fac[c] * lane_sum<T>(sg);
  }
  return db;
}

// ---------------------------------------------------------------------------------------------
// The preconditioner side (double): P and Pi, K rows of ld.

/// Token t's step of the sweep (null when the sweep only reads): px = P_t x; P_{t-1} = a P_t + fy y^T (fy = f y);
/// Pi_{t-1} = ia Pi_t + dma tgt^T + dy k^T + k dz^T (dma = dm / a).
struct PiStep {
  const double* x;
  double* px;
  double a, ia;
  const double *fy, *y, *dma, *tgt, *dy, *k, *dz;
};
/// Token t-1's reads on the rows the step writes (null y when none): A1 = Pi y, A2 = Pi^T y, s1 = <P, Pi>,
/// pdm = P dm. `rowacc` has K * L doubles of scratch.
struct PiReads {
  const double *y, *dm;
  double *A1, *A2, *pdm, *s1, *rowacc;
};

template <int NB>
inline void pi_block(double* P, double* Pi, int64_t K, int64_t ld, int64_t e, const PiStep* st, const PiReads* rd,
                     typename Vec<double>::type& s1acc) {
  using V = typename Vec<double>::type;
  constexpr int L = Vec<double>::L;
  V px[NB], a2[NB], pd[NB], yv[NB], tg[NB], kv[NB], dz[NB], y2[NB];
  for (int v = 0; v < NB; ++v) {
    px[v] = a2[v] = pd[v] = yv[v] = tg[v] = kv[v] = dz[v] = y2[v] = V{};
    if (st) yv[v] = vload(st->y + e + v * L), tg[v] = vload(st->tgt + e + v * L), kv[v] = vload(st->k + e + v * L),
    dz[v] = vload(st->dz + e + v * L);
    if (rd) y2[v] = vload(rd->y + e + v * L);
  }
  const V va = vsplat(st ? st->a : 0.0), via = vsplat(st ? st->ia : 0.0);
  for (int64_t i = 0; i < K; ++i) {
    double* pr = P + i * ld + e;
    double* qr = Pi + i * ld + e;
    V pn[NB], qn[NB];
    if (st) {
      const V xi = vsplat(st->x[i]), fyi = vsplat(st->fy[i]), dmi = vsplat(st->dma[i]), dyi = vsplat(st->dy[i]),
              ki = vsplat(st->k[i]);
      for (int v = 0; v < NB; ++v) {
        const V p = vload(pr + v * L);
        px[v] += xi * p;
        pn[v] = va * p + fyi * yv[v];
        vstore(pr + v * L, pn[v]);
        qn[v] = via * vload(qr + v * L) + dmi * tg[v] + dyi * kv[v] + ki * dz[v];
        vstore(qr + v * L, qn[v]);
      }
    } else {
      for (int v = 0; v < NB; ++v) pn[v] = vload(pr + v * L), qn[v] = vload(qr + v * L);
    }
    if (rd) {
      const V yi = vsplat(rd->y[i]), di = vsplat(rd->dm[i]);
      V ra = qn[0] * y2[0];
      for (int v = 0; v < NB; ++v) {
        a2[v] += yi * qn[v];
        pd[v] += di * pn[v];
        s1acc += pn[v] * qn[v];
        if (v) ra += qn[v] * y2[v];
      }
      double* acc = rd->rowacc + i * L;
      vstore(acc, vload(acc) + ra);
    }
  }
  for (int v = 0; v < NB; ++v) {
    if (st) vstore(st->px + e + v * L, px[v]);
    if (rd) vstore(rd->A2 + e + v * L, a2[v]), vstore(rd->pdm + e + v * L, pd[v]);
  }
}

/// One sweep over P and Pi (padded columns [0, ld)): the step of `st` and the reads of `rd`, either may be null.
inline void pi_sweep(double* P, double* Pi, int64_t K, int64_t ld, const PiStep* st, const PiReads* rd) {
  using V = typename Vec<double>::type;
  constexpr int L = Vec<double>::L, NB = 2;
  V s1acc{};
  if (rd) std::memset(rd->rowacc, 0, size_t(K * L) * sizeof(double));
  int64_t e = 0;
  for (; e + NB * L <= ld; e += NB * L) pi_block<NB>(P, Pi, K, ld, e, st, rd, s1acc);
  for (; e < ld; e += L) pi_block<1>(P, Pi, K, ld, e, st, rd, s1acc);
  if (rd) {
    for (int64_t i = 0; i < K; ++i) rd->A1[i] = lane_sum<double>(vload(rd->rowacc + i * L));
    *rd->s1 = lane_sum<double>(s1acc);
  }
}

// ---------------------------------------------------------------------------------------------

template <class T>
void exact_backward_task_t(const KernelParams& p, int64_t task) {
  const Setup<T, T> s(p);
  const int64_t n = task / p.H, h = task % p.H;
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), len = seq_len(p, n);
  const int64_t si = state_index(p, n);
  const int64_t K = s.K, Vd = s.V, Kp = s.Kp, Vp = s.Vp, r = s.r, KV = K * Vp;
  const bool key_target = p.spec.precond == precond::Kind::exact_atk;
  const int64_t ld = ExactPre<T, double>::padded(K);
  const int64_t C1 = p.chunk > 0 ? p.chunk : 64, C2 = kExactSub;
  const int64_t Tn = len > 0 ? len : 0, nck = (Tn + C1 - 1) / C1;
  auto grow_at = [&](const KView& x, int64_t t, int64_t hh) {
    return mptr<T>(x) + b * x.stride[0] + (t0 + t) * x.stride[1] + hh * x.stride[2];
  };

  // Per token (whole sequence, double): y (and w) rows of ld; a, beta_p, kappa, den, f, y.q.
  const int64_t nyw = key_target ? 1 : 2;
  // (Scratch, not std::vector: no standard-library inline code is instantiated in a per-ISA unit.)
  Scratch<double> ywm((Tn > 0 ? Tn : 1) * (nyw * ld + 6));
  double* yw = ywm.base;
  double* scal = yw + (Tn > 0 ? Tn : 1) * nyw * ld;
  auto yrow = [&](int64_t t) { return yw + t * nyw * ld; };
  auto wrow = [&](int64_t t) { return yw + t * nyw * ld + ld; };
  // State checkpoints every C1 tokens (and every C2 inside a chunk), the held states of a sub-block.
  Scratch<T> ck(std::max<int64_t>(nck, 1) * r * KV);
  Scratch<T> sub(((C1 + C2 - 1) / C2) * r * KV + C2 * r * KV + r * KV + C2 * r * Vp);
  T* subck = sub.base;
  T* Sheld = subck + ((C1 + C2 - 1) / C2) * r * KV;
  T* S = Sheld + C2 * r * KV;  // the running states (r of them); then dS in the reverse sweep
  T* Uheld = S + r * KV;
  Scratch<T> dSm(r * KV);
  // Per token of a chunk: qn, kn, mapped (qr or kw); per value head fac, bet.
  const int64_t per_tok = 3 * Kp;
  Scratch<T> tokm(C1 * per_tok + C1 * r * Kp + C1 * r + C1 * 2 + 8 * Kp + 3 * Vp);
  T* tokv = tokm.base;
  T* facs = tokv + C1 * per_tok;
  T* bets = facs + C1 * r * Kp;
  T* rstd = bets + C1 * r;  // rq, rk of each token
  T* ckv = rstd + C1 * 2;   // fac ⊙ kn
  T* wv = ckv + Kp;         // bet kw
  T* dgc = wv + Kp;
  T* dqr = dgc + Kp;
  T* dkw = dqr + Kp;
  T* dkn = dkw + Kp;
  T* dtmp = dkn + Kp;
  T* dtmp2 = dtmp + Kp;
  T* uv = dtmp2 + Kp;
  T* dov = uv + Vp;
  T* dvv = dov + Vp;
  // Double: P, Pi, ExactPre's vectors, the key-side vectors, per-sub-block dm, dq, dk rows.
  Scratch<double> pm(ExactPre<T, double>::elems(K) + K * ld + 16 * ld + K * Vec<double>::L + 3 * C2 * ld);
  ExactPre<T, double> ex(pm.base, K, key_target);
  double* Pi = pm.base + ExactPre<T, double>::elems(K);
  double* dv_ = Pi + K * ld;
  auto dvec = [&](int i) { return dv_ + i * ld; };
  double *A1 = dvec(0), *A2 = dvec(1), *pdm = dvec(2), *xv = dvec(3), *px = dvec(4), *fy = dvec(5), *dma = dvec(6),
         *dyv = dvec(7), *dzv = dvec(8), *kd = dvec(9), *tgd = dvec(10), *mapd = dvec(11), *nA1 = dvec(12),
         *nA2 = dvec(13), *npdm = dvec(14);
  double* rowacc = dv_ + 16 * ld;
  double* dmS = rowacc + K * Vec<double>::L;  // C2 rows: dm of each token of the sub-block
  double* dqS = dmS + C2 * ld;                 // C2 rows: dq (normalised) of each token
  double* dkS = dqS + C2 * ld;                 // C2 rows: dk (normalised) of each token

  // Loads the token vectors of chunk [ta, tb): qn, kn, rstd; per value head fac and bet. The mapped vector from y/w.
  auto load_chunk = [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t) {
      const int64_t i = t - ta, ti = t0 + t;
      T* qn = tokv + i * per_tok;
      T* kn = qn + Kp;
      load_row(s.qrow(b, ti, h), K, p.l2norm, s.scale, qn, rstd + 2 * i);
      load_row(s.krow(b, ti, h), K, p.l2norm, T(1), kn, rstd + 2 * i + 1);
      for (int64_t j = 0; j < r; ++j) {
        const int64_t hvj = h * r + j;
        T* fac = facs + (i * r + j) * Kp;
        if (s.decay == decay::Kind::diagonal) {
          load_cvt(s.grow(b, ti, hvj), K, fac);
          for (int64_t c = K; c < Kp; ++c) fac[c] = T(0);
          exp_inplace(fac, Kp);
        } else {
          const T f = s.decay == decay::Kind::scalar ? std::exp(to_c<T>(s.grow(b, ti, hvj)[0])) : T(1);
          for (int64_t c = 0; c < Kp; ++c) fac[c] = f;
        }
        bets[i * r + j] = s.beta(b, ti, hvj);
      }
    }
  };
  // The mapped vector of token t (qr for ExactATQ, kw for ExactATK) from the forward's y / w, in double.
  auto mapped = [&](int64_t t, double* out) {
    const double* y = yrow(t);
    const double* sc = scal + t * 6;
    if (key_target) {
      const double inv = 1.0 / sc[3];
      for (int64_t c = 0; c < K; ++c) out[c] = y[c] * inv;
    } else {
      const double* w = wrow(t);
      for (int64_t c = 0; c < K; ++c) out[c] = (w[c] - sc[4] * y[c] * sc[5]) / sc[0];
    }
    for (int64_t c = K; c < ld; ++c) out[c] = 0;
  };
  // The state side of token t of the current chunk on every value head (the state S_{t-1} in S, advanced).
  auto advance = [&](int64_t t, int64_t ta, T* keep, T* ukeep) {
    const int64_t i = t - ta, ti = t0 + t;
    const T* qn = tokv + i * per_tok;
    const T* kn = qn + Kp;
    const T* kw = key_target ? qn + 2 * Kp : kn;
    for (int64_t j = 0; j < r; ++j) {
      const T* fac = facs + (i * r + j) * Kp;
      const T bt = bets[i * r + j];
      for (int64_t c = 0; c < Kp; ++c) ckv[c] = fac[c] * kn[c], wv[c] = bt * kw[c];
      T* u = ukeep ? ukeep + j * Vp : uv;
      std::memcpy(u, s.vrow(b, ti, h * r + j), size_t(Vd) * sizeof(T));
      for (int64_t e = Vd; e < Vp; ++e) u[e] = T(0);
      state_step(S + j * KV, K, Vp, fac, ckv, wv, s.online, u, keep ? keep + j * KV : nullptr);
    }
  };
  // The T rows of the mapped vectors of a loaded chunk.
  auto map_chunk = [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t) {
      T* qn = tokv + (t - ta) * per_tok;
      T* m = qn + 2 * Kp;
      mapped(t, mapd);
      for (int64_t c = 0; c < Kp; ++c) m[c] = c < K ? T(mapd[c]) : T(0);
    }
  };

  // The r value-head states of state si of `x` (h0 or dhT; zero when absent) into rows of Vp at dst.
  auto load_states = [&](const KView& x, T* dst) {
    for (int64_t j = 0; j < r; ++j)
      for (int64_t c = 0; c < K; ++c) {
        T* row = dst + j * KV + c * Vp;
        for (int64_t e = 0; e < Vp; ++e) row[e] = T(0);
        if (x.data) std::memcpy(row, s.state(x, si, h * r + j) + c * x.stride[2], size_t(Vd) * sizeof(T));
      }
  };

  // 1. Forward: P over the sequence (y, w and scalars kept), states checkpointed every C1 tokens.
  const bool a0_in = p.a0.data != nullptr;
  ex.init(a0_in ? cptr<T>(p.a0) + si * p.a0.stride[0] + h * p.a0.stride[1] : nullptr, p.a0.stride[2], p.lambda);
  load_states(p.h0, S);
  Scratch<T> gam(2 * C1);
  T* ga = gam.base;
  T* gb = ga + C1;
  for (int64_t ci = 0; ci < nck; ++ci) {
    const int64_t ta = ci * C1, tb = imin(Tn, ta + C1), nt = tb - ta;
    std::memcpy(ck.base + ci * r * KV, S, size_t(r * KV) * sizeof(T));
    load_chunk(ta, tb);
    for (int64_t t = ta; t < tb; ++t) ga[t - ta] = std::exp(s.gp(b, t0 + t, h)), gb[t - ta] = s.bp(b, t0 + t, h);
    ex.run(nt, tokv, tokv + Kp, per_tok, tokv + 2 * Kp, tokv + 2 * Kp, ga, gb, yrow(ta),
           key_target ? nullptr : wrow(ta), nyw * ld, scal + ta * 6);
    for (int64_t t = ta; t < tb; ++t) advance(t, ta, nullptr, nullptr);
  }

  // 2-3. Reverse: dS from dhT, Pi from daT.
  T* dS = dSm.base;
  load_states(p.dhT, dS);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t jj = 0; jj < ld; ++jj)
      Pi[i * ld + jj] = p.daT.data && jj < K ? double(cptr<T>(p.daT)[si * p.daT.stride[0] + h * p.daT.stride[1] +
                                                                    i * p.daT.stride[2] + jj])
                                             : 0.0;
  double* P = ex.P;
  bool have_reads = false;  // A1, A2, s1, pdm of the next token (in reverse) are computed
  double s1 = 0;
  for (int64_t ci = nck - 1; ci >= 0; --ci) {
    const int64_t ta = ci * C1, tb = imin(Tn, ta + C1);
    load_chunk(ta, tb);
    map_chunk(ta, tb);
    std::memcpy(S, ck.base + ci * r * KV, size_t(r * KV) * sizeof(T));
    for (int64_t t = ta; t < tb; ++t) {
      if ((t - ta) % C2 == 0) std::memcpy(subck + ((t - ta) / C2) * r * KV, S, size_t(r * KV) * sizeof(T));
      advance(t, ta, nullptr, nullptr);
    }
    const int64_t nsub = (tb - ta + C2 - 1) / C2;
    for (int64_t sb = nsub - 1; sb >= 0; --sb) {
      const int64_t sa = ta + sb * C2, se = imin(tb, sa + C2);
      std::memcpy(S, subck + sb * r * KV, size_t(r * KV) * sizeof(T));
      for (int64_t t = sa; t < se; ++t) advance(t, ta, Sheld + (t - sa) * r * KV, Uheld + (t - sa) * r * Vp);
      // The state side, tokens in reverse: dm (dL/d mapped), the direct dq / dk terms.
      for (int64_t t = se - 1; t >= sa; --t) {
        const int64_t i = t - ta, ti = t0 + t;
        const T* qn = tokv + i * per_tok;
        const T* kn = qn + Kp;
        const T* qr = key_target ? qn : qn + 2 * Kp;
        const T* kw = key_target ? qn + 2 * Kp : kn;
        for (int64_t c = 0; c < Kp; ++c) dqr[c] = dkw[c] = dkn[c] = T(0);
        for (int64_t j = 0; j < r; ++j) {
          const int64_t hvj = h * r + j;
          const T* dor = cptr<T>(p.d_o) + b * p.d_o.stride[0] + ti * p.d_o.stride[1] + hvj * p.d_o.stride[2];
          std::memcpy(dov, dor, size_t(Vd) * sizeof(T));
          for (int64_t e = Vd; e < Vp; ++e) dov[e] = T(0);
          const T* fac = facs + (i * r + j) * Kp;
          const T bt = bets[i * r + j];
          const T db = state_backward(dS + j * KV, Sheld + (t - sa) * r * KV + j * KV, K, Vp,
                                      Uheld + (t - sa) * r * Vp + j * Vp, dov, fac, kn, qr, kw, bt, s.online,
                                      StateGrads<T>{dqr, dkw, dkn}, dvv, dgc);
          if (p.dv.data) std::memcpy(grow_at(p.dv, t, hvj), dvv, size_t(Vd) * sizeof(T));
          if (s.gain && p.dbeta.data) *grow_at(p.dbeta, t, hvj) = db;
          if (p.dg.data && s.decay == decay::Kind::diagonal) {
            std::memcpy(grow_at(p.dg, t, hvj), dgc, size_t(K) * sizeof(T));
          } else if (p.dg.data && s.decay == decay::Kind::scalar) {
            T sum = 0;
            for (int64_t c = 0; c < K; ++c) sum += dgc[c];
            *grow_at(p.dg, t, hvj) = sum;
          }
        }
        double* dm = dmS + (t - sa) * ld;
        double* dq = dqS + (t - sa) * ld;
        double* dk = dkS + (t - sa) * ld;
        for (int64_t c = 0; c < ld; ++c) {
          const bool in = c < K;
          dm[c] = in ? double(key_target ? dkw[c] : dqr[c]) : 0.0;
          dq[c] = in && key_target ? double(dqr[c]) : 0.0;
          dk[c] = in ? double(dkn[c]) + (key_target ? 0.0 : double(dkw[c])) : 0.0;
        }
      }
      // The preconditioner side, tokens in reverse (one sweep over P and Pi each).
      for (int64_t t = se - 1; t >= sa; --t) {
        const int64_t i = t - ta, ti = t0 + t;
        const T* qn = tokv + i * per_tok;
        const T* kn = qn + Kp;
        const double* y = yrow(t);
        const double* sc = scal + t * 6;
        const double a = sc[0], bp = sc[1], kappa = sc[2], den = sc[3], f = sc[4];
        double* dm = dmS + (t - sa) * ld;
        for (int64_t c = 0; c < ld; ++c) {
          kd[c] = c < K ? double(kn[c]) : 0.0;
          tgd[c] = c < K ? double(key_target ? kn[c] : qn[c]) : 0.0;
        }
        mapped(t, mapd);
        if (!have_reads) {  // the last token, or the last of a sub-block: a reads-only sweep on P_t, Pi_t
          PiReads rd{y, dm, A1, A2, pdm, &s1, rowacc};
          pi_sweep(P, Pi, K, ld, nullptr, &rd);
        }
        double ty = 0, dmy = 0, dmm = 0;
        for (int64_t c = 0; c < K; ++c) ty += tgd[c] * y[c], dmy += dm[c] * y[c], dmm += dm[c] * mapd[c];
        const double ia = 1.0 / a, sG = s1 + dmm;
        double dc = 0;
        for (int64_t c = 0; c < ld; ++c) {
          A1[c] = (A1[c] + dm[c] * ty) * ia;    // G y / a
          A2[c] = (A2[c] + tgd[c] * dmy) * ia;  // G^T y / a
          dc -= y[c] * A1[c];
        }
        const double dden = -dc * f / den, db = dc / den + dden * kappa, da = -sG * ia + dden;
        for (int64_t c = 0; c < ld; ++c) {
          dyv[c] = -f * A1[c] + dden * bp * kd[c];
          dzv[c] = -f * A2[c];
          xv[c] = dyv[c] + dzv[c];
          fy[c] = f * y[c];
          dma[c] = dm[c] * ia;
        }
        // d(mapped vector's target) += P_t^T dm.
        double* dtg = key_target ? dkS + (t - sa) * ld : dqS + (t - sa) * ld;
        for (int64_t c = 0; c < K; ++c) dtg[c] += pdm[c];
        const bool next = t > 0;
        const double* y2 = next ? yrow(t - 1) : nullptr;
        const double* dm2 = next ? (t - 1 >= sa ? dmS + (t - 1 - sa) * ld : nullptr) : nullptr;
        PiStep st{xv, px, a, ia, fy, y, dma, tgd, dyv, kd, dzv};
        // The reads of token t - 1 need its dm: in this sub-block, or (first token of the sub-block) the next
        // sub-block's state side has not run yet, so they are done by a reads-only sweep there.
        PiReads rd{y2, dm2, nA1, nA2, npdm, &s1, rowacc};
        pi_sweep(P, Pi, K, ld, &st, dm2 ? &rd : nullptr);
        have_reads = dm2 != nullptr;
        if (have_reads) std::swap(A1, nA1), std::swap(A2, nA2), std::swap(pdm, npdm);
        // dk += dden b y + P_{t-1} x, P_{t-1} x = a P_t x + f y (y . x).
        double yx = 0;
        for (int64_t c = 0; c < K; ++c) yx += y[c] * xv[c];
        double* dk = dkS + (t - sa) * ld;
        for (int64_t c = 0; c < K; ++c) dk[c] += dden * bp * y[c] + a * px[c] + f * y[c] * yx;
        if (p.dg_p.data) *grow_at(p.dg_p, t, h) = T(a * da);
        if (p.dbeta_p.data) *grow_at(p.dbeta_p, t, h) = T(db);
        // The L2 norm and scale.
        T* xh = dtmp;
        T* dy = dtmp2;
        if (p.dq.data) {
          load_row(s.qrow(b, ti, h), K, p.l2norm, T(1), xh);
          for (int64_t c = 0; c < K; ++c) dy[c] = T(dqS[(t - sa) * ld + c]);
          norm_backward(xh, rstd[2 * i], K, p.l2norm, s.scale, dy, grow_at(p.dq, t, h));
        }
        if (p.dk.data) {
          for (int64_t c = 0; c < K; ++c) dy[c] = T(dk[c]);
          norm_backward(kn, rstd[2 * i + 1], K, p.l2norm, T(1), dy, grow_at(p.dk, t, h));
        }
      }
    }
  }
  if (p.dh0.data)
    for (int64_t j = 0; j < r; ++j)
      for (int64_t c = 0; c < K; ++c)
        std::memcpy(s.state(p.dh0, si, h * r + j) + c * p.dh0.stride[2], dS + j * KV + c * Vp,
                    size_t(Vd) * sizeof(T));
  if (p.da0.data) {
    T* da0 = mptr<T>(p.da0) + si * p.da0.stride[0] + h * p.da0.stride[1];
    for (int64_t i = 0; i < K; ++i)
      for (int64_t jj = 0; jj < K; ++jj) da0[i * p.da0.stride[2] + jj] = T(Pi[i * ld + jj]);
  }
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
