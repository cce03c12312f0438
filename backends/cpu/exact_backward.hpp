/// @brief Backward of the exact preconditioners on the CPU (ExactATK: Mesa layer, ExactATQ: ridge readout, with
/// every decay, gain and solve): the recurrence of SPEC §2 in reverse, vectorised, the inverse Gram in double.
///
/// One task per (sequence, key head) with its r = HV / H value heads. The recurrence has no chunkwise form here, so
/// the backward walks the tokens in reverse (SPEC §3.8):
///  1. a forward sweep runs the inverse Gram P over the whole sequence (ExactPre of decode.hpp, the forward's own
///     steps) and keeps, per token, y = P_{t-1} k (and w = P_{t-1} q for ExactATQ) and six scalars in double,
///     and the states S every `chunk` tokens;
///  2. per chunk, in reverse: the chunk's states are recomputed once and held, S_{t-1} of every token (when they
///     fit in kExactHoldBytes; else per sub-block of the chunk, from sub-checkpoints); the state gradient dS runs
///     back over the tokens (dv, dbeta, dg, and the gradients of the read query, read key and write key), then
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
/// Memory per task: O(L K) doubles (the y rows), O(L / chunk r K V) for the checkpoints, and the held states
/// (at most max(kExactHoldBytes, kExactSub r K V elements)).
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

/// Bytes of states S_{t-1} the backward holds at once: a chunk's states when they fit (one recomputation of the
/// chunk), else sub-blocks of this size, at least kExactSub tokens, from sub-checkpoints (a second recomputation).
constexpr int64_t kExactHoldBytes = int64_t(8) << 20;
constexpr int64_t kExactSub = 8;

/// Sum of the lanes.
template <class T>
inline T lane_sum(const typename Vec<T>::type& x) {
  return hsum<T>(x);
}

// ---------------------------------------------------------------------------------------------
// The state side (T): K rows of Vp (zero padding), one value head.

/// The residual read of one token (Online): u -= sum_c ck[c] S[c,:] (u holds v on entry; rows of Vp).
template <class T>
void state_read(const T* S, int64_t K, int64_t Vp, const T* ck, T* u) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  for (int64_t e = 0; e < Vp; e += 4 * L) {
    const int nb = int(imin(4, (Vp - e) / L));
    V acc[4] = {};
    for (int64_t c = 0; c < K; ++c) {
      const T* row = S + c * Vp + e;
      const V x = vsplat(ck[c]);
      for (int v = 0; v < nb; ++v) acc[v] += x * vload(row + v * L);
    }
    for (int v = 0; v < nb; ++v) vstore(u + e + v * L, vload(u + e + v * L) - acc[v]);
  }
}

/// Columns [e, e + NB L) of state_write.
template <class T, int NB>
inline void state_write_block(const T* Si, T* So, int64_t K, int64_t Vp, const T* fac, const T* w, const T* u,
                              const T* ckn, T* un) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V uu[NB], acc[NB];
  for (int v = 0; v < NB; ++v) uu[v] = vload(u + v * L), acc[v] = V{};
  for (int64_t c = 0; c < K; ++c) {
    const T* ri = Si + c * Vp;
    T* ro = So + c * Vp;
    const V f = vsplat(fac[c]), x = vsplat(w[c]);
    if (ckn) {
      const V y = vsplat(ckn[c]);
      for (int v = 0; v < NB; ++v) {
        const V s = f * vload(ri + v * L) + x * uu[v];
        vstore(ro + v * L, s);
        acc[v] += y * s;
      }
    } else {
      for (int v = 0; v < NB; ++v) vstore(ro + v * L, f * vload(ri + v * L) + x * uu[v]);
    }
  }
  if (ckn)
    for (int v = 0; v < NB; ++v) vstore(un + v * L, vload(un + v * L) - acc[v]);
}

/// One token's write So[c,:] = fac[c] Si[c,:] + w[c] u (w = beta kw; So may be Si), fused with the next token's
/// residual read un -= sum_c ckn[c] So[c,:] when ckn is given (Online; un holds the next v on entry).
template <class T>
void state_write(const T* Si, T* So, int64_t K, int64_t Vp, const T* fac, const T* w, const T* u, const T* ckn,
                 T* un) {
  constexpr int L = Vec<T>::L, NB = 4;
  int64_t e = 0;
  for (; e + NB * L <= Vp; e += NB * L)
    state_write_block<T, NB>(Si + e, So + e, K, Vp, fac, w, u + e, ckn, ckn ? un + e : nullptr);
  for (; e < Vp; e += L) state_write_block<T, 1>(Si + e, So + e, K, Vp, fac, w, u + e, ckn, ckn ? un + e : nullptr);
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
/// kw the token's read key, read query, write key (Kp, zero padding), bet the gain. Writes dv (Vp) and returns
/// dbeta; with dgc, the per-row decay gradient fac[c] (Sp[c,:] . dSbar[c,:]) goes there. The row sums run on L rows
/// at a time (lane_sums: one transposing reduction instead of L horizontal sums).
template <class T>
[[gnu::noinline]] T state_backward(T* dS, const T* Sp, int64_t K, int64_t Vp, const T* u, const T* dout,
                                   const T* fac, const T* kn, const T* qr, const T* kw, T bet, bool online,
                                   bool decayed, const StateGrads<T>& g, T* dv, T* dgc) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  // Pass 1: dS_t += qr do^T; su = dS_t u, sd = Sp do, dv = bet sum_c kw[c] dS_t[c,:].
  for (int64_t e = 0; e < Vp; e += L) vstore(dv + e, V{});
  const V vbu = vsplat(bet * dotv(u, dout, Vp)), vb = vsplat(bet);
  V dbv{};
  for (int64_t c0 = 0; c0 < K; c0 += L) {
    V su[L], sd[L];
    for (int l = 0; l < L; ++l) {
      const int64_t c = c0 + l;
      su[l] = sd[l] = V{};
      if (c >= K) continue;
      T* row = dS + c * Vp;
      const T* sp = Sp + c * Vp;
      const V q = vsplat(qr[c]), w = vsplat(kw[c]);
      V a{}, bb{};  // (registers: an indexed array element would carry the sum through memory)
      for (int64_t e = 0; e < Vp; e += L) {
        const V d = vload(dout + e);
        const V x = vload(row + e) + q * d;
        vstore(row + e, x);
        a += x * vload(u + e);
        bb += vload(sp + e) * d;
        vstore(dv + e, vload(dv + e) + w * x);
      }
      su[l] = a, sd[l] = bb;
    }
    const V ssu = lane_sums<T>(su), ssd = lane_sums<T>(sd), kwc = vload(kw + c0);
    vstore(g.dqr + c0, vload(g.dqr + c0) + vload(fac + c0) * ssd + vbu * kwc);
    vstore(g.dkw + c0, vload(g.dkw + c0) + vb * ssu);
    dbv += kwc * ssu;
  }
  for (int64_t e = 0; e < Vp; e += L) vstore(dv + e, vb * vload(dv + e));
  // Pass 2: dSbar = dS_t - kn dv^T (Online), dkn -= fac (Sp dv), dgc = fac (Sp . dSbar), dS_{t-1} = fac dSbar
  // (nothing to do Offline without decay).
  if (!online && !dgc && !decayed) return hsum<T>(dbv);
  for (int64_t c0 = 0; c0 < K; c0 += L) {
    V sr[L], sg[L];
    for (int l = 0; l < L; ++l) {
      const int64_t c = c0 + l;
      sr[l] = sg[l] = V{};
      if (c >= K) continue;
      T* row = dS + c * Vp;
      const T* sp = Sp + c * Vp;
      const V kc = vsplat(online ? kn[c] : T(0)), f = vsplat(fac[c]);
      V a{}, bb{};
      if (dgc) {
        for (int64_t e = 0; e < Vp; e += L) {
          const V sv = vload(sp + e);
          const V x = vload(row + e) - kc * vload(dv + e);
          a += sv * vload(dv + e);
          bb += sv * x;
          vstore(row + e, f * x);
        }
        sr[l] = a, sg[l] = bb;
      } else if (online) {
        for (int64_t e = 0; e < Vp; e += L) {
          const V x = vload(row + e) - kc * vload(dv + e);
          a += vload(sp + e) * vload(dv + e);
          vstore(row + e, f * x);
        }
        sr[l] = a;
      } else {
        for (int64_t e = 0; e < Vp; e += L) vstore(row + e, f * vload(row + e));
      }
    }
    const V fc = vload(fac + c0);
    if (online) vstore(g.dkn + c0, vload(g.dkn + c0) - fc * lane_sums<T>(sr));
    if (dgc) vstore(dgc + c0, fc * lane_sums<T>(sg));
  }
  return hsum<T>(dbv);
}

// ---------------------------------------------------------------------------------------------
// The preconditioner side (double): P and Pi, K rows of ld.

/// Token t's step of the sweep: px = P_t x; P_{t-1} = a P_t + fy y^T (fy = f y);
/// Pi_{t-1} = ia Pi_t + u1 w1^T + u2 w2^T (+ u3 w3^T): dm / a tgt^T + dy k^T + k dz^T, for ExactATK (tgt = k) the
/// rank-two (dm / a + dy) k^T + k dz^T.
struct PiStep {
  const double *x, *fy, *y, *u1, *w1, *u2, *w2, *u3, *w3;
  double* px;
  double a, ia;
};
/// Token t-1's reads on the rows the step writes: A1 = Pi y, A2 = Pi^T y, s1 = <P, Pi>, pdm = P dm. `rowacc` has
/// ld * L doubles of scratch.
struct PiReads {
  const double *y, *dm;
  double *A1, *A2, *pdm, *s1, *rowacc;
};

/// Columns [e, e + NB L) of pi_sweep: the step (ST) and the reads (RD); R3: a rank-three update of Pi. The
/// pointers are copied to locals (through the structs the compiler reloaded them after every store).
template <int NB, bool ST, bool RD, bool R3>
inline void pi_block(double* P, double* Pi, int64_t K, int64_t ld, int64_t e, const PiStep& st, const PiReads& rd,
                     typename Vec<double>::type* s1acc) {
  using V = typename Vec<double>::type;
  constexpr int L = Vec<double>::L;
  const double *x = st.x, *fy = st.fy, *u1 = st.u1, *u2 = st.u2, *u3 = st.u3, *y2s = rd.y, *dm = rd.dm;
  double* rowacc = rd.rowacc;
  V px[NB], a2[NB], pd[NB], yv[NB], w1[NB], w2[NB], w3[NB], y2[NB];
  for (int v = 0; v < NB; ++v) {
    px[v] = a2[v] = pd[v] = yv[v] = w1[v] = w2[v] = w3[v] = y2[v] = V{};
    if constexpr (ST) {
      yv[v] = vload(st.y + e + v * L), w1[v] = vload(st.w1 + e + v * L), w2[v] = vload(st.w2 + e + v * L);
      if constexpr (R3) w3[v] = vload(st.w3 + e + v * L);
    }
    if constexpr (RD) y2[v] = vload(y2s + e + v * L);
  }
  const V va = vsplat(ST ? st.a : 0.0), via = vsplat(ST ? st.ia : 0.0);
  for (int64_t i = 0; i < K; ++i) {
    double* pr = P + i * ld + e;
    double* qr = Pi + i * ld + e;
    V pn[NB], qn[NB];
    if constexpr (ST) {
      const V xi = vsplat(x[i]), fyi = vsplat(fy[i]), c1 = vsplat(u1[i]), c2 = vsplat(u2[i]);
      const V c3 = vsplat(R3 ? u3[i] : 0.0);
      for (int v = 0; v < NB; ++v) {
        const V p = vload(pr + v * L);
        px[v] += xi * p;
        pn[v] = va * p + fyi * yv[v];
        vstore(pr + v * L, pn[v]);
        qn[v] = via * vload(qr + v * L) + c1 * w1[v] + c2 * w2[v];
        if constexpr (R3) qn[v] += c3 * w3[v];
        vstore(qr + v * L, qn[v]);
      }
    } else {
      for (int v = 0; v < NB; ++v) pn[v] = vload(pr + v * L), qn[v] = vload(qr + v * L);
    }
    if constexpr (RD) {
      const V yi = vsplat(y2s[i]), di = vsplat(dm[i]);
      V ra = qn[0] * y2[0];
      for (int v = 0; v < NB; ++v) {
        a2[v] += yi * qn[v];
        pd[v] += di * pn[v];
        s1acc[v] += pn[v] * qn[v];
        if (v) ra += qn[v] * y2[v];
      }
      vstore(rowacc + i * L, vload(rowacc + i * L) + ra);
    }
  }
  for (int v = 0; v < NB; ++v) {
    if constexpr (ST) vstore(st.px + e + v * L, px[v]);
    if constexpr (RD) vstore(rd.A2 + e + v * L, a2[v]), vstore(rd.pdm + e + v * L, pd[v]);
  }
}

template <bool ST, bool RD, bool R3>
void pi_sweep_t(double* P, double* Pi, int64_t K, int64_t ld, const PiStep& st, const PiReads& rd) {
  using V = typename Vec<double>::type;
  constexpr int L = Vec<double>::L, NB = 2;
  V s1acc[NB] = {};
  if constexpr (RD) std::memset(rd.rowacc, 0, size_t(ld * L) * sizeof(double));
  int64_t e = 0;
  for (; e + NB * L <= ld; e += NB * L) pi_block<NB, ST, RD, R3>(P, Pi, K, ld, e, st, rd, s1acc);
  for (; e < ld; e += L) pi_block<1, ST, RD, R3>(P, Pi, K, ld, e, st, rd, s1acc);
  if constexpr (RD) {
    for (int64_t i = 0; i < ld; i += L) {  // the row sums, L rows at a time (rows K.. ld are zero)
      V rows[L];
      for (int l = 0; l < L; ++l) rows[l] = vload(rd.rowacc + (i + l) * L);
      vstore(rd.A1 + i, lane_sums<double>(rows));
    }
    for (int v = 1; v < NB; ++v) s1acc[0] += s1acc[v];
    *rd.s1 = hsum<double>(s1acc[0]);
  }
}

/// One sweep over P and Pi (padded columns [0, ld)): the step of `st` and the reads of `rd`, either may be null;
/// r3: Pi's update has rank three.
[[gnu::noinline]] void pi_sweep(double* P, double* Pi, int64_t K, int64_t ld, const PiStep* st, const PiReads* rd,
                                bool r3) {
  static const PiStep st0{};
  static const PiReads rd0{};
  const PiStep& s = st ? *st : st0;
  const PiReads& r = rd ? *rd : rd0;
  if (st && rd)
    r3 ? pi_sweep_t<true, true, true>(P, Pi, K, ld, s, r) : pi_sweep_t<true, true, false>(P, Pi, K, ld, s, r);
  else if (st)
    r3 ? pi_sweep_t<true, false, true>(P, Pi, K, ld, s, r) : pi_sweep_t<true, false, false>(P, Pi, K, ld, s, r);
  else if (rd)
    pi_sweep_t<false, true, false>(P, Pi, K, ld, s, r);
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
  const int64_t C1 = p.chunk > 0 ? p.chunk : 64;
  const int64_t C2 = imin(C1, std::max<int64_t>(kExactSub, kExactHoldBytes / (r * KV * int64_t(sizeof(T)))));
  const int64_t Tn = len > 0 ? len : 0, nck = (Tn + C1 - 1) / C1;
  auto grow_at = [&](const KView& x, int64_t t, int64_t hh) {
    return mptr<T>(x) + b * x.stride[0] + (t0 + t) * x.stride[1] + hh * x.stride[2];
  };

  // Per token (whole sequence, double): y (and w) rows of ld; a, beta_p, kappa, den, f, y.q. Then the state
  // checkpoints every C1 tokens, the sub-checkpoints of a chunk (every C2 tokens) and the held states of a
  // sub-block. One block kept by the thread across tasks and calls (ScratchLease), uninitialised: every element is
  // written before it is read (a fresh zeroed block per task spent a sixth of the backward in memset and page faults).
  const int64_t nyw = key_target ? 1 : 2;
  const int64_t Tr = Tn > 0 ? Tn : 1, nsubmax = (C1 + C2 - 1) / C2;
  auto dbl = [](int64_t nT) { return round_up(nT * int64_t(sizeof(T)), 64) / int64_t(sizeof(double)); };
  const int64_t n_yw = round_up(Tr * (nyw * ld + 6), 8), n_ck = dbl(std::max<int64_t>(nck, 1) * r * KV);
  const int64_t n_sub = dbl(nsubmax * r * KV + C2 * r * KV + r * KV + C2 * r * Vp);
  const ScratchLease<double> big(n_yw + n_ck + n_sub);
  double* yw = big.get();
  double* scal = yw + Tr * nyw * ld;
  auto yrow = [&](int64_t t) { return yw + t * nyw * ld; };
  auto wrow = [&](int64_t t) { return yw + t * nyw * ld + ld; };
  T* ckb = reinterpret_cast<T*>(yw + n_yw);
  T* subck = reinterpret_cast<T*>(yw + n_yw + n_ck);
  T* Sheld = subck + nsubmax * r * KV;  // the held states S_{t-1} of a sub-block but its first
  T* S = Sheld + C2 * r * KV;           // the running states (r of them)
  T* Uheld = S + r * KV;                // each held token's residual u (or v), r rows of Vp
  Scratch<T> dSm(r * KV);
  // Per token of a chunk: qn, kn, mapped (qr or kw); per value head fac, bet.
  const int64_t per_tok = 3 * Kp;
  Scratch<T> tokm(C1 * per_tok + C1 * r * Kp + C1 * r + C1 * 2 + 8 * Kp + 3 * Vp + 2 * r * Vp);
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
  T* urot = dvv + Vp;  // two rows of r residuals (in-place runs)
  // Double: P, Pi, ExactPre's vectors, the key-side vectors, per-sub-block dm, dq, dk rows.
  Scratch<double> pm(ExactPre<T, double>::elems(K) + K * ld + 16 * ld + ld * Vec<double>::L + 3 * C2 * ld);
  ExactPre<T, double> ex(pm.base, K, key_target);
  double* Pi = pm.base + ExactPre<T, double>::elems(K);
  double* dv_ = Pi + K * ld;
  auto dvec = [&](int i) { return dv_ + i * ld; };
  double *A1 = dvec(0), *A2 = dvec(1), *pdm = dvec(2), *xv = dvec(3), *px = dvec(4), *fy = dvec(5), *dma = dvec(6),
         *dyv = dvec(7), *dzv = dvec(8), *kd = dvec(9), *tgd = dvec(10), *mapd = dvec(11), *nA1 = dvec(12),
         *nA2 = dvec(13), *npdm = dvec(14);
  double* rowacc = dv_ + 16 * ld;
  double* dmS = rowacc + ld * Vec<double>::L;  // C2 rows: dm of each token of the sub-block
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
      const double ia = 1.0 / sc[0];  // as ExactPre::run rounds it
      for (int64_t c = 0; c < K; ++c) out[c] = (w[c] - sc[4] * y[c] * sc[5]) * ia;
    }
    for (int64_t c = K; c < ld; ++c) out[c] = 0;
  };
  // The value row of token t, value head j, into u (rows of Vp, zero padding).
  auto load_v = [&](int64_t t, int64_t j, T* u) {
    std::memcpy(u, s.vrow(b, t0 + t, h * r + j), size_t(Vd) * sizeof(T));
    for (int64_t e = Vd; e < Vp; ++e) u[e] = T(0);
  };
  // The state side of tokens ta + [m0, m1) of the loaded chunk (ta its first token), on every value head: token m
  // reads the r states at in_of(m) and writes them to out_of(m) (the last token only when write_last); its residual
  // u (or v) goes to u_of(m) (r rows of Vp), read by the previous token's write sweep (or a read sweep, the first).
  auto run_states = [&](int64_t ta, int64_t m0, int64_t m1, auto&& in_of, auto&& out_of, auto&& u_of,
                        bool write_last) {
    for (int64_t m = m0; m < m1; ++m) {
      const bool next = m + 1 < m1;
      const T* qn = tokv + m * per_tok;
      const T* kn = qn + Kp;
      const T* kw = key_target ? qn + 2 * Kp : kn;
      const T* kn1 = kn + per_tok;
      for (int64_t j = 0; j < r; ++j) {
        const T* fac = facs + (m * r + j) * Kp;
        T* u = u_of(m) + j * Vp;
        if (m == m0) {
          load_v(ta + m, j, u);
          if (s.online) {
            for (int64_t c = 0; c < Kp; ++c) ckv[c] = fac[c] * kn[c];
            state_read(in_of(m) + j * KV, K, Vp, ckv, u);
          }
        }
        if (!next && !write_last) continue;
        const T bt = bets[m * r + j];
        for (int64_t c = 0; c < Kp; ++c) wv[c] = bt * kw[c];
        T* un = next ? u_of(m + 1) + j * Vp : nullptr;
        if (next) {
          load_v(ta + m + 1, j, un);
          const T* fac1 = facs + ((m + 1) * r + j) * Kp;
          for (int64_t c = 0; c < Kp; ++c) ckv[c] = fac1[c] * kn1[c];
        }
        state_write(in_of(m) + j * KV, out_of(m) + j * KV, K, Vp, fac, wv, u, next && s.online ? ckv : nullptr, un);
      }
    }
  };
  auto in_place = [&](int64_t) { return S; };
  auto u_rot = [&](int64_t m) { return urot + (m & 1) * r * Vp; };
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
    std::memcpy(ckb + ci * r * KV, S, size_t(r * KV) * sizeof(T));
    load_chunk(ta, tb);
    for (int64_t t = ta; t < tb; ++t) ga[t - ta] = std::exp(s.gp(b, t0 + t, h)), gb[t - ta] = s.bp(b, t0 + t, h);
    ex.run(nt, tokv, tokv + Kp, per_tok, tokv + 2 * Kp, tokv + 2 * Kp, ga, gb, yrow(ta),
           key_target ? nullptr : wrow(ta), nyw * ld, scal + ta * 6);
    run_states(ta, 0, nt, in_place, in_place, u_rot, true);
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
  const bool need_dg = p.dg.data && s.decay != decay::Kind::none;
  bool have_reads = false;  // A1, A2, s1, pdm of the next token (in reverse) are computed
  double s1 = 0;
  for (int64_t ci = nck - 1; ci >= 0; --ci) {
    const int64_t ta = ci * C1, tb = imin(Tn, ta + C1);
    load_chunk(ta, tb);
    map_chunk(ta, tb);
    const int64_t nsub = (tb - ta + C2 - 1) / C2;
    if (nsub > 1) {  // sub-checkpoints: the chunk recomputed in place
      std::memcpy(S, ckb + ci * r * KV, size_t(r * KV) * sizeof(T));
      for (int64_t sb = 0; sb + 1 < nsub; ++sb) {
        run_states(ta, sb * C2, (sb + 1) * C2, in_place, in_place, u_rot, true);
        std::memcpy(subck + (sb + 1) * r * KV, S, size_t(r * KV) * sizeof(T));
      }
    }
    for (int64_t sb = nsub - 1; sb >= 0; --sb) {
      const int64_t sa = ta + sb * C2, se = imin(tb, sa + C2), m0 = sa - ta;
      T* src = sb > 0 ? subck + sb * r * KV : ckb + ci * r * KV;
      // The states S_{t-1} of the sub-block's tokens: its first from the checkpoint, the others recomputed.
      auto held = [&](int64_t m) { return m == m0 ? src : Sheld + (m - m0 - 1) * r * KV; };
      auto held_out = [&](int64_t m) { return Sheld + (m - m0) * r * KV; };
      auto u_held = [&](int64_t m) { return Uheld + (m - m0) * r * Vp; };
      run_states(ta, m0, se - ta, held, held_out, u_held, false);
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
          const T db = state_backward(dS + j * KV, held(i) + j * KV, K, Vp, u_held(i) + j * Vp, dov, fac, kn, qr,
                                      kw, bt, s.online, s.decay != decay::Kind::none, StateGrads<T>{dqr, dkw, dkn}, dvv,
                                      need_dg ? dgc : nullptr);
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
          pi_sweep(P, Pi, K, ld, nullptr, &rd, false);
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
          dma[c] = dm[c] * ia + (key_target ? dyv[c] : 0.0);  // ExactATK: tgt = k, (dm / a + dy) k^T
        }
        // d(mapped vector's target) += P_t^T dm.
        double* dtg = key_target ? dkS + (t - sa) * ld : dqS + (t - sa) * ld;
        for (int64_t c = 0; c < K; ++c) dtg[c] += pdm[c];
        const bool next = t > 0;
        const double* y2 = next ? yrow(t - 1) : nullptr;
        const double* dm2 = next ? (t - 1 >= sa ? dmS + (t - 1 - sa) * ld : nullptr) : nullptr;
        const PiStep st = key_target ? PiStep{xv, fy, y, dma, kd, kd, dzv, nullptr, nullptr, px, a, ia}
                                     : PiStep{xv, fy, y, dma, tgd, dyv, kd, kd, dzv, px, a, ia};
        // The reads of token t - 1 need its dm: in this sub-block, or (first token of the sub-block) the next
        // sub-block's state side has not run yet, so they are done by a reads-only sweep there.
        PiReads rd{y2, dm2, nA1, nA2, npdm, &s1, rowacc};
        pi_sweep(P, Pi, K, ld, &st, dm2 ? &rd : nullptr, !key_target);
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
