/// @brief Decode of the CPU leaf kernels (SPEC §2 token by token): the state sweeps and the per-head task.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.hpp"
#include "gemm.hpp"
#include "scratch.hpp"
#include "setup.hpp"
#include "simd.hpp"
#include "squash_simd.hpp"
#include "transpose.hpp"
#include "vmath.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// ---------------------------------------------------------------------------------------------
// Decode sweeps over one K x V state (rows of stride ds), columns in register blocks of NB vectors.

/// Columns [e0, e0 + NB*L) of: y1 = sum_c a1[c] S[c,:] and y2 = sum_c a2[c] S[c,:].
template <class T, int NB>
inline void read2_block(const T* S, int64_t ds, int64_t K, const T* a1, const T* a2, T* y1, T* y2) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V r1[NB], r2[NB];
  for (int v = 0; v < NB; ++v) r1[v] = r2[v] = V{};
  for (int64_t c = 0; c < K; ++c) {
    const T* row = S + c * ds;
    const T x1 = a1[c], x2 = a2[c];
    for (int v = 0; v < NB; ++v) {
      const V s = vload(row + v * L);
      r1[v] += x1 * s;
      r2[v] += x2 * s;
    }
  }
  for (int v = 0; v < NB; ++v) {
    vstore(y1 + v * L, r1[v]);
    vstore(y2 + v * L, r2[v]);
  }
}

/// What a decode write sweep reads besides writing: nothing, the rows it writes (the next token's
/// reads, of the new values), or the same rows of another column block (the first token's reads of
/// the next block: one sweep streams both blocks, about 13% faster than a write sweep then a read one).
enum class SweepRead { none, written, other };

/// Columns [S, S + NB*L) of the write S[c,:] = f[c] S[c,:] + w[c] u and, unless RD is none, the reads
/// y1 = sum_c a1[c] X[c,:], y2 = sum_c a2[c] X[c,:] of X = the new S (written) or of R (other).
template <class T, int NB, SweepRead RD>
inline void write_block(T* S, const T* R, int64_t ds, int64_t K, const T* f, const T* w, const T* u, const T* a1,
                        const T* a2, T* y1, T* y2) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V uu[NB], r1[NB], r2[NB];
  for (int v = 0; v < NB; ++v) {
    uu[v] = vload(u + v * L);
    r1[v] = r2[v] = V{};
  }
  if constexpr (RD == SweepRead::none) {
    // Last rows first: the read sweep just left them in L1, while its first rows may have been
    // evicted (with 512-byte rows a 128-row block puts 16 lines in each cache set it uses, more
    // than L1's ways). Elementwise, so the order changes no result.
    for (int64_t c = K - 1; c >= 0; --c) {
      T* row = S + c * ds;
      const T fc = f[c], wc = w[c];
      for (int v = 0; v < NB; ++v) vstore(row + v * L, fc * vload(row + v * L) + wc * uu[v]);
    }
  } else {
    for (int64_t c = 0; c < K; ++c) {
      T* row = S + c * ds;
      const T fc = f[c], wc = w[c], x1 = a1[c], x2 = a2[c];
      for (int v = 0; v < NB; ++v) {
        const V x = fc * vload(row + v * L) + wc * uu[v];
        vstore(row + v * L, x);
        const V rd = RD == SweepRead::written ? x : vload(R + c * ds + v * L);
        r1[v] += x1 * rd;
        r2[v] += x2 * rd;
      }
    }
    for (int v = 0; v < NB; ++v) {
      vstore(y1 + v * L, r1[v]);
      vstore(y2 + v * L, r2[v]);
    }
  }
}

constexpr int kDecodeNB = 4;
/// Columns per decode block: kDecodeNB vectors.
template <class T>
constexpr int64_t kDecodeCols = kDecodeNB* Vec<T>::L;

/// read2_block over columns [e0, e1): register blocks, then single vectors, then a scalar tail.
template <class T>
void read2(const T* S, int64_t ds, int64_t K, int64_t e0, int64_t e1, const T* a1, const T* a2, T* y1, T* y2) {
  constexpr int L = Vec<T>::L;
  int64_t e = e0;
  for (; e + kDecodeNB * L <= e1; e += kDecodeNB * L) read2_block<T, kDecodeNB>(S + e, ds, K, a1, a2, y1 + e, y2 + e);
  for (; e + L <= e1; e += L) read2_block<T, 1>(S + e, ds, K, a1, a2, y1 + e, y2 + e);
  for (; e < e1; ++e) {
    T s1 = 0, s2 = 0;
    for (int64_t c = 0; c < K; ++c) {
      s1 += a1[c] * S[c * ds + e];
      s2 += a2[c] * S[c * ds + e];
    }
    y1[e] = s1;
    y2[e] = s2;
  }
}

/// write_block over columns [e0, e1) (see there); a1 == nullptr skips the fused reads.
template <class T>
void write2(T* S, int64_t ds, int64_t K, int64_t e0, int64_t e1, const T* f, const T* w, const T* u, const T* a1,
            const T* a2, T* y1, T* y2) {
  constexpr int L = Vec<T>::L;
  int64_t e = e0;
  for (; e + kDecodeNB * L <= e1; e += kDecodeNB * L) {
    if (a1)
      write_block<T, kDecodeNB, SweepRead::written>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
    else
      write_block<T, kDecodeNB, SweepRead::none>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
  }
  for (; e + L <= e1; e += L) {
    if (a1)
      write_block<T, 1, SweepRead::written>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
    else
      write_block<T, 1, SweepRead::none>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
  }
  for (; e < e1; ++e) {
    T s1 = 0, s2 = 0;
    for (int64_t c = 0; c < K; ++c) {
      const T x = f[c] * S[c * ds + e] + w[c] * u[e];
      S[c * ds + e] = x;
      if (a1) {
        s1 += a1[c] * x;
        s2 += a2[c] * x;
      }
    }
    if (a1) {
      y1[e] = s1;
      y2[e] = s2;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode (SPEC §2 token by token), one task per (sequence n, key head h) with its HV/H value heads.
// Per token and value head the state is read once (residual S̄^T k and readout S̄^T qr together) and
// written once (decay and rank-1 write together); the read of token t+1 is fused into the write of
// token t, and the last write of a column block reads the next block, so T tokens cost about T sweeps
// over the state (plus one block). o_t = S̄^T qr + b (kw . qr) u.

/// Tokens per block of the decode task: the per-token vectors of one block are held at a time, so a
/// forward over a long sequence (the exact preconditioners' forward runs this kernel) needs
/// O(block (K + r K)) memory besides the state.
constexpr int64_t kDecodeTokenBlock = 256;

/// Writes the preconditioner state of key head h (diagonal K values of `A`, or the exact K x K `P`) to slot `slot`.
template <class T, class In, class PT>
void store_precond(const KernelParams& p, const Setup<T, In>& s, int64_t slot, int64_t h, const T* A, const PT* P) {
  T* a = mptr<T>(p.aT) + slot * p.aT.stride[0] + h * p.aT.stride[1];
  if (!P) {
    for (int64_t c = 0; c < s.K; ++c) a[c] = A[c];
    return;
  }
  const int64_t ld = round_up(s.K, int64_t(Vec<PT>::L));  // ExactPre::padded
  for (int64_t i = 0; i < s.K; ++i)
    for (int64_t j = 0; j < s.K; ++j) a[i * p.aT.stride[2] + j] = static_cast<T>(P[i * ld + j]);
}

/// Columns [e, e + NB*L) of the inverse Gram's step (ExactPre): P[c,:] = ia P[c,:] - sg s[c] s (all rows
/// c < K) and, with a1, the reads y1 = sum_c a1[c] P_new[c,:], y2 = sum_c a2[c] P_new[c,:]; without s only
/// the reads of P. Every element goes through the same vector operations (rows padded to whole vectors):
/// the two products of P[c,e] and P[e,c] are the same numbers, so P stays exactly symmetric.
template <class PT, int NB>
inline void pgram_block(PT* P, int64_t ld, int64_t K, int64_t e, PT ia, PT sg, const PT* s, const PT* a1,
                        const PT* a2, PT* y1, PT* y2) {
  using V = typename Vec<PT>::type;
  constexpr int L = Vec<PT>::L;
  V ss[NB], r1[NB], r2[NB];
  for (int v = 0; v < NB; ++v) {
    ss[v] = s ? vload(s + e + v * L) : V{};
    r1[v] = r2[v] = V{};
  }
  const V via = vsplat(ia);
  for (int64_t c = 0; c < K; ++c) {
    PT* row = P + c * ld + e;
    const PT x1 = a1 ? a1[c] : PT(0), x2 = a1 ? a2[c] : PT(0);
    if (s) {
      const V ns = vsplat(-sg * s[c]);
      for (int v = 0; v < NB; ++v) {
        const V x = vfma<PT>(ns, ss[v], via * vload(row + v * L));
        vstore(row + v * L, x);
        r1[v] += x1 * x;
        r2[v] += x2 * x;
      }
    } else {
      for (int v = 0; v < NB; ++v) {
        const V x = vload(row + v * L);
        r1[v] += x1 * x;
        r2[v] += x2 * x;
      }
    }
  }
  if (a1)
    for (int v = 0; v < NB; ++v) {
      vstore(y1 + v * L, r1[v]);
      vstore(y2 + v * L, r2[v]);
    }
}

/// pgram_block over the padded columns [0, ld) (ld a multiple of the vector length).
template <class PT>
inline void pgram(PT* P, int64_t ld, int64_t K, PT ia, PT sg, const PT* s, const PT* a1, const PT* a2, PT* y1,
                  PT* y2) {
  constexpr int L = Vec<PT>::L, NB = 4;
  int64_t e = 0;
  for (; e + NB * L <= ld; e += NB * L) pgram_block<PT, NB>(P, ld, K, e, ia, sg, s, a1, a2, y1 + e, y2 + e);
  for (; e < ld; e += L) pgram_block<PT, 1>(P, ld, K, e, ia, sg, s, a1, a2, y1 + e, y2 + e);
}

/// The exact preconditioner (SPEC §2, ExactATK / ExactATQ) of one key head over the tokens of a block, in
/// double: the inverse Gram P (K x K, rows padded to ld) from token to token by Sherman-Morrison,
///   y = P_{t-1} k, w = P_{t-1} q, kappa = k . y, f = beta_p / (a + beta_p kappa), P_t = (P_{t-1} - f y y^T) / a,
/// and the write key kw = P_t k = y / (a + beta_p kappa) (ExactATK) or the read query
/// qr = P_t q = (w - f y (y . q)) / a (ExactATQ). The update is written as P / a - sg s s^T with
/// s = sqrt(|f| / a) y, sg = sign(f): exactly symmetric in floating point, so P^T k = P k and the
/// step stays the Sherman-Morrison step of the (symmetric) matrix P^{-1}, whose rounding errors decay
/// with the forgetting; an update only symmetric up to rounding let the antisymmetric part grow as
/// exp(-sum g_p). The sweep that writes P_t also reads y and w of the next token (one pass over P per
/// token). Float32 kept P drifting (about 2e-4 relative at fast forgetting); double holds it to rounding.
template <class T, class PT>
struct ExactPre {
  PT* P;  // K x ld
  PT* y;  // P k, P q of the current token; kd, qd the token's rows; sv the update's s
  PT* w;
  PT* kd;
  PT* qd;
  PT* kd2;
  PT* qd2;
  PT* sv;
  int64_t K, ld;
  bool key_target;

  static int64_t padded(int64_t K) { return round_up(K, int64_t(Vec<PT>::L)); }
  static int64_t elems(int64_t K) { return K * padded(K) + 7 * padded(K); }
  ExactPre(PT* base, int64_t K_, bool key) : P(base), K(K_), ld(padded(K_)), key_target(key) {
    PT* v = base + K * ld;
    for (PT** x : {&y, &w, &kd, &qd, &kd2, &qd2, &sv}) *x = v, v += ld;
  }
  /// P_0 from the a0 rows (row stride lda) or lambda^{-1} I; padding zero.
  void init(const T* a0, int64_t lda, double lambda) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < ld; ++j)
        P[i * ld + j] = j >= K ? PT(0) : a0 ? PT(a0[i * lda + j]) : (i == j ? PT(1.0 / lambda) : PT(0));
  }
  /// Tokens [0, nt) of a block: rows qn, kn of stride `rs` in; kw (ExactATK) or qr (ExactATQ) out; a and
  /// bb the gates of each token (a = exp(g_p), bb = beta_p). For the backward (exact_backward.hpp), when given:
  /// each token's y = P_{t-1} k and w = P_{t-1} q (rows of stride `yld`) and six scalars
  /// (a, beta_p, kappa, den, f, y . q).
  void run(int64_t nt, const T* qn, const T* kn, int64_t rs, T* qr, T* kw, const T* a, const T* bb,
           PT* ys = nullptr, PT* ws = nullptr, int64_t yld = 0, double* scal = nullptr) {
    auto cvt = [&](const T* x, PT* d) {
      for (int64_t c = 0; c < ld; ++c) d[c] = c < K ? PT(x[c]) : PT(0);
    };
    if (nt <= 0) return;
    cvt(kn, kd), cvt(qn, qd);
    pgram<PT>(P, ld, K, PT(1), PT(0), nullptr, kd, qd, y, w);
    for (int64_t t = 0; t < nt; ++t) {
      double kappa = 0, yq = 0;
      for (int64_t c = 0; c < K; ++c) kappa += double(kd[c]) * double(y[c]), yq += double(y[c]) * double(qd[c]);
      const double at = a[t], bt = bb[t], den = at + bt * kappa, f = bt / den, ia = 1.0 / at;
      if (scal) {
        double* sc = scal + t * 6;
        sc[0] = at, sc[1] = bt, sc[2] = kappa, sc[3] = den, sc[4] = f, sc[5] = yq;
        std::memcpy(ys + t * yld, y, size_t(ld) * sizeof(PT));
        if (ws) std::memcpy(ws + t * yld, w, size_t(ld) * sizeof(PT));
      }
      if (key_target) {
        const double sc = 1.0 / den;
        for (int64_t c = 0; c < K; ++c) kw[t * rs + c] = static_cast<T>(double(y[c]) * sc);
      } else {
        for (int64_t c = 0; c < K; ++c) qr[t * rs + c] = static_cast<T>((double(w[c]) - f * double(y[c]) * yq) * ia);
      }
      const double r = std::sqrt(std::fabs(f) * ia), sg = f < 0 ? -1.0 : 1.0;
      for (int64_t c = 0; c < ld; ++c) sv[c] = PT(r * double(y[c]));
      const bool next = t + 1 < nt;
      if (next) cvt(kn + (t + 1) * rs, kd2), cvt(qn + (t + 1) * rs, qd2);
      pgram<PT>(P, ld, K, PT(ia), PT(sg), sv, next ? kd2 : nullptr, next ? qd2 : nullptr, y, w);
      std::swap(kd, kd2), std::swap(qd, qd2);
    }
  }
};

template <class T, class In = T>
void decode_task_t(const KernelParams& p, int64_t task) {
  const Setup<T, In> s(p);
  // The exact preconditioners' inverse Gram: double (float measured as fast on two threads, but P drifted
  // 1.9e-6 and the outputs up to 2e-4 at fast forgetting; docs/performance-cpu.md).
  using PGram = double;
  const int64_t n = task / p.H, h = task % p.H;
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), len = seq_len(p, n);
  const int64_t ri = read_index(p, n), wi = write_index(p, n);
  const int64_t K = s.K, Vd = s.V, Kp = s.Kp, Vp = s.Vp, r = s.r;
  if (is_padded(p, n)) {  // a padding sequence: zero outputs, the pool untouched
    for (int64_t t = 0; t < len; ++t)
      for (int64_t j = 0; j < r; ++j)
        std::memset(static_cast<void*>(s.orow(b, t0 + t, h * r + j)), 0, size_t(Vd) * sizeof(In));
    return;
  }
  // Speculative verification (token_slots), or no state written (a forward without hT): the states run
  // in scratch (copied out after every token for verification); otherwise each is updated in place in
  // its output slot. A K-last pool (h0 / hT strided in V: rows of K per value column) keeps its layout in
  // place and in scratch, and runs the row sweep below (sweep_k_last).
  const int64_t* tslots = p.token_slots ? p.token_slots + n * p.token_ld : nullptr;
  auto k_last_view = [](const KView& x) { return x.data && x.stride[3] != 1 && x.stride[2] == 1; };
  const bool k_last = k_last_view(p.h0) || k_last_view(p.hT);
  const bool exact = p.spec.precond == precond::Kind::exact_atk || p.spec.precond == precond::Kind::exact_atq;
  const bool key_target = p.spec.precond == precond::Kind::diagonal_atk || p.spec.precond == precond::Kind::exact_atk;
  const bool query_target = p.spec.precond == precond::Kind::diagonal_atq || p.spec.precond == precond::Kind::exact_atq;
  const bool scratch_state = tslots || !p.hT.data || wi < 0;
  const int64_t Tn = len > 0 ? len : 0, TB = imin(Tn > 0 ? Tn : 1, kDecodeTokenBlock);
  // Per token: qn, kn, qr, kw (K each), then per value head: fac (K), the two read coefficients (K each).
  const int64_t per_tok = 4 * Kp, per_head = 3 * Kp;
  // bf16/f16: the value rows converted to float (TB * r rows) and one output row staged for rounding.
  constexpr bool half = !std::is_same_v<In, T>;
  const int64_t nvc = half ? TB * r * Vp + Vp : 0;
  const int64_t nsc1 = k_last ? Vp * Kp : K * Vp;  // one value head's state in scratch
  const int64_t nsc = scratch_state ? r * nsc1 : 0;
  constexpr int L = Vec<T>::L;
  const int64_t nxr = k_last ? L * Kp + 3 * L : 0;  // K-last: one group of L state rows, staged v, o and u
  SmallScratch<T> mem(Kp + 4 * Kp + TB * per_tok + TB * r * per_head + 3 * Vp + TB * r + 3 * TB + nvc + nsc + nxr);
  T* Ast = mem.base;  // diagonal statistics A
  T* work = Ast + Kp;
  T* tokv = work + 4 * Kp;
  T* headv = tokv + TB * per_tok;
  T* y1 = headv + TB * r * per_head;
  T* y2 = y1 + Vp;
  T* u = y2 + Vp;
  T* bet = u + Vp;
  T* kqv = bet + TB * r;  // kw . qr of each token
  T* ga = kqv + TB;       // exact: exp(g_p) and beta_p of each token
  T* gb = ga + TB;
  T* vcv = gb + TB;  // half inputs: v rows as float, then the staged o row
  T* ocv = vcv + TB * r * Vp;
  T* Ssc = vcv + nvc;  // scratch states: r of K rows of Vp (K-last: Vp rows of Kp)
  T* Xg = Ssc + nsc;   // K-last: L state rows of Kp, then v, o and u of the group (L each)
  SmallScratch<PGram> pmem(exact ? ExactPre<T, PGram>::elems(K) : 0);
  ExactPre<T, PGram> ex(pmem.base, K, key_target);

  // Preconditioner state (diagonal A or inverse Gram P), from a0 or the default (A = 0, P = I / lambda).
  const bool a0_in = p.a0.data && ri >= 0;
  if (s.diag_pre && a0_in) {
    const T* a0 = cptr<T>(p.a0) + ri * p.a0.stride[0] + h * p.a0.stride[1];
    for (int64_t c = 0; c < K; ++c) Ast[c] = a0[c];
  } else if (exact) {
    ex.init(a0_in ? cptr<T>(p.a0) + ri * p.a0.stride[0] + h * p.a0.stride[1] : nullptr, p.a0.stride[2], p.lambda);
  }
  const T ctr = s.diag_pre ? s.center(h) : T(0);
  const PGram* Pout = exact ? ex.P : nullptr;

  // The states: each value head's from h0 (or zero), in its output slot or in scratch.
  auto state_of = [&](int64_t j) { return scratch_state ? Ssc + j * nsc1 : s.state(p.hT, wi, h * r + j); };
  const int64_t ds = scratch_state ? Vp : p.hT.stride[2];
  const int64_t lde = scratch_state ? Kp : p.hT.stride[3];  // K-last: row stride of the state
  for (int64_t j = 0; k_last && j < r; ++j) {
    const T* src = p.h0.data && ri >= 0 ? s.state(p.h0, ri, h * r + j) : nullptr;
    T* S = state_of(j);
    for (int64_t e = 0; e < Vd && src != S; ++e) {
      if (src)
        std::memcpy(S + e * lde, src + e * p.h0.stride[3], size_t(K) * sizeof(T));
      else
        std::memset(static_cast<void*>(S + e * lde), 0, size_t(K) * sizeof(T));
    }
  }
  for (int64_t j = 0; !k_last && j < r; ++j) {
    const T* src = p.h0.data && ri >= 0 ? s.state(p.h0, ri, h * r + j) : nullptr;
    T* S = state_of(j);
    if (!src)
      for (int64_t c = 0; c < K; ++c) std::memset(static_cast<void*>(S + c * ds), 0, size_t(Vd) * sizeof(T));
    else if (src != S)
      state_in(src, p.h0.stride[2], p.h0.stride[3], K, Vd, S, ds);
  }

  // K-last state sweep of value head j over the block's tokens [tb0, tb0 + nt): value columns (state rows of K)
  // are independent (SPEC §2), so groups of L rows run every token of the block while they stay in L1: per
  // token, the two reads S^T ck and S^T cq as L dot products reduced together (lane_sums), then u, o and the
  // write S_t = Diag(fac) S + kw u^T row by row. The pool is read and written once per block, as in place.
  auto sweep_k_last = [&](int64_t j, int64_t tb0, int64_t nt) {
    using VT = typename Vec<T>::type;
    const int64_t hvj = h * r + j, nv = Kp / L;
    T* S = state_of(j);
    T* vs = Xg + L * Kp;
    T* os = vs + L;
    T* us = os + L;
    // With K a whole number of vectors the rows are swept where they are; otherwise through Xg, zero-padded.
    const bool direct = K == Kp;
    T* rows[L];
    for (int64_t e0 = 0; e0 < Vd; e0 += L) {
      const int64_t nl = imin(L, Vd - e0);
      for (int64_t l = 0; l < L; ++l) {  // rows past Vd read zeros and are not written
        rows[l] = direct && l < nl ? S + (e0 + l) * lde : Xg + l * Kp;
        if (direct && l < nl) continue;
        if (l < nl) std::memcpy(Xg + l * Kp, S + (e0 + l) * lde, size_t(K) * sizeof(T));
        else std::memset(static_cast<void*>(Xg + l * Kp), 0, size_t(Kp) * sizeof(T));
      }
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t ti = t0 + tb0 + i;
        const T* fac = headv + (i * r + j) * per_head;
        const T* ck = fac + Kp;
        const T* cq = ck + Kp;
        const T* kw = tokv + i * per_tok + 3 * Kp;
        // RB rows at a time, the key vectors outer: 2 RB independent accumulation chains.
        constexpr int RB = L < 4 ? L : 4;
        VT a1[L], a2[L];
        for (int l0 = 0; l0 < L; l0 += RB) {
          VT s1[RB], s2[RB];
          for (int l = 0; l < RB; ++l) s1[l] = s2[l] = VT{};
          for (int64_t v = 0; v < nv; ++v) {
            const VT cv = vload(ck + v * L), qv = vload(cq + v * L);
            for (int l = 0; l < RB; ++l) {
              const VT x = vload(rows[l0 + l] + v * L);
              s1[l] = vfma<T>(x, cv, s1[l]);
              s2[l] = vfma<T>(x, qv, s2[l]);
            }
          }
          for (int l = 0; l < RB; ++l) a1[l0 + l] = s1[l], a2[l0 + l] = s2[l];
        }
        const VT y1 = lane_sums<T>(a1), y2 = lane_sums<T>(a2);
        if constexpr (half)
          std::memcpy(vs, vcv + (i * r + j) * Vp + e0, size_t(nl) * sizeof(T));
        else
          std::memcpy(vs, s.vrow(b, ti, hvj) + e0, size_t(nl) * sizeof(T));
        for (int64_t l = nl; l < L; ++l) vs[l] = 0;
        const VT u = vsplat(bet[i * r + j]) * (vload(vs) - (s.online ? y1 : VT{}));
        vstore(us, u);
        vstore(os, y2 + vsplat(kqv[i]) * u);
        if constexpr (half)
          store_cvt(os, nl, s.orow(b, ti, hvj) + e0);
        else
          std::memcpy(s.orow(b, ti, hvj) + e0, os, size_t(nl) * sizeof(T));
        for (int64_t l = 0; l < nl; ++l) {
          const VT ul = vsplat(us[l]);
          for (int64_t v = 0; v < nv; ++v) {
            T* x = rows[l] + v * L;
            vstore(x, vfma<T>(vload(fac + v * L), vload(x), ul * vload(kw + v * L)));
          }
        }
        if (tslots && tslots[tb0 + i] >= 0) {  // the state after token t, rows [e0, e0 + nl)
          T* dst = s.state(p.hT, tslots[tb0 + i], hvj);
          for (int64_t l = 0; l < nl; ++l)
            std::memcpy(dst + (e0 + l) * p.hT.stride[3], rows[l], size_t(K) * sizeof(T));
        }
      }
      for (int64_t l = 0; l < nl && !direct; ++l) std::memcpy(S + (e0 + l) * lde, Xg + l * Kp, size_t(K) * sizeof(T));
    }
  };

  for (int64_t tb0 = 0; tb0 < Tn; tb0 += TB) {
    const int64_t nt = imin(TB, Tn - tb0);
    // Token vectors of the block, shared by the group's value heads (SPEC §2 preconditioner axis).
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t ti = t0 + tb0 + i;
      T* qn = tokv + i * per_tok;
      T* kn = qn + Kp;
      T* qr = kn + Kp;
      T* kw = qr + Kp;
      load_row(s.qrow(b, ti, h), K, p.l2norm, s.scale, qn);
      load_row(s.krow(b, ti, h), K, p.l2norm, T(1), kn);
      std::memcpy(qr, qn, size_t(K) * sizeof(T));
      std::memcpy(kw, kn, size_t(K) * sizeof(T));
      if (s.diag_pre) {
        const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
        T* m = work;
        for (int64_t c = 0; c < K; ++c) m[c] = Ast[c] = stats1(Ast[c], a, bb, kn[c]);
        squash_inplace(m, Kp, ctr, s.log_x, s.eps);
        for (int64_t c = 0; c < K; ++c) {
          if (key_target) kw[c] = kn[c] * m[c];
          if (query_target) qr[c] = qn[c] * m[c];
        }
        if (tslots && tslots[tb0 + i] >= 0 && p.aT.data) store_precond(p, s, tslots[tb0 + i], h, Ast, Pout);
      } else if (exact) {
        ga[i] = std::exp(s.gp(b, ti, h)), gb[i] = s.bp(b, ti, h);
      }
    }
    if (exact && !tslots) {  // the block's tokens in one run (P_t depends on every earlier token)
      ex.run(nt, tokv, tokv + Kp, per_tok, tokv + 2 * Kp, tokv + 3 * Kp, ga, gb);
    } else if (exact) {  // verification: P stored after each token
      for (int64_t i = 0; i < nt; ++i) {
        T* row = tokv + i * per_tok;
        ex.run(1, row, row + Kp, per_tok, row + 2 * Kp, row + 3 * Kp, ga + i, gb + i);
        if (tslots[tb0 + i] >= 0 && p.aT.data) store_precond(p, s, tslots[tb0 + i], h, Ast, Pout);
      }
    }
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t ti = t0 + tb0 + i;
      const T* qr = tokv + i * per_tok + 2 * Kp;
      kqv[i] = dot_padded(qr + Kp, qr, Kp);
      for (int64_t j = 0; j < r; ++j) {
        const int64_t hvj = h * r + j;
        T* fac = headv + (i * r + j) * per_head;
        T* ck = fac + Kp;  // fac ⊙ kn: residual read coefficients
        T* cq = ck + Kp;   // fac ⊙ qr: readout coefficients
        if (s.decay == decay::Kind::diagonal) {
          load_cvt(s.grow(b, ti, hvj), K, fac);
          exp_inplace(fac, Kp);  // padding lanes become 1; they only meet zero padding of kn and qr
        } else {
          const T f = s.decay == decay::Kind::scalar ? std::exp(to_c<T>(s.grow(b, ti, hvj)[0])) : T(1);
          for (int64_t c = 0; c < K; ++c) fac[c] = f;
        }
        if constexpr (half) load_cvt(s.vrow(b, ti, hvj), Vd, vcv + (i * r + j) * Vp);
        const T* kn = tokv + i * per_tok + Kp;
        for (int64_t c = 0; c < K; ++c) {
          ck[c] = fac[c] * kn[c];
          cq[c] = fac[c] * qr[c];
        }
        bet[i * r + j] = s.beta(b, ti, hvj);
      }
    }

    for (int64_t j = 0; k_last && j < r; ++j) sweep_k_last(j, tb0, nt);
    for (int64_t j = 0; !k_last && j < r; ++j) {
      const int64_t hvj = h * r + j;
      T* S = state_of(j);
      // Value columns are independent (SPEC §2): run the block's tokens on one block of kDecodeCols
      // columns (32 KB of a 128-row float state) at a time, so the write sweep finds the block in L1.
      // The last token's write sweep of a block also reads the next block for the first token.
      constexpr int64_t BC = kDecodeCols<T>;
      const T* f0 = headv + j * per_head;
      bool read_ahead = false;  // the block's first reads were done by the previous block's last write
      for (int64_t e0 = 0; e0 < Vd; e0 += BC) {
        const int64_t e1 = imin(Vd, e0 + BC);
        if (!read_ahead) read2(S, ds, K, e0, e1, f0 + Kp, f0 + 2 * Kp, y1, y2);
        read_ahead = false;
        for (int64_t i = 0; i < nt; ++i) {
          const int64_t ti = t0 + tb0 + i;
          const T* kw = tokv + i * per_tok + 3 * Kp;
          const T* fac = headv + (i * r + j) * per_head;
          const T bt = bet[i * r + j];
          const T* v;
          if constexpr (half)
            v = vcv + (i * r + j) * Vp;
          else
            v = s.vrow(b, ti, hvj);
          for (int64_t e = e0; e < e1; ++e) u[e] = bt * (v[e] - (s.online ? y1[e] : T(0)));
          const T kq = kqv[i];
          if constexpr (half) {
            for (int64_t e = e0; e < e1; ++e) ocv[e] = y2[e] + kq * u[e];
            store_cvt(ocv + e0, e1 - e0, s.orow(b, ti, hvj) + e0);
          } else {
            T* o = s.orow(b, ti, hvj);
            for (int64_t e = e0; e < e1; ++e) o[e] = y2[e] + kq * u[e];
          }
          // Write sweep S_t = Diag(fac) S + kw u^T, fused with the read sweep of token t + 1, or for
          // the last token with the first token's reads of the next (whole) block.
          const T* nf = i + 1 < nt ? headv + ((i + 1) * r + j) * per_head : nullptr;
          if (!nf && e1 - e0 == BC && e1 + BC <= Vd) {
            write_block<T, kDecodeNB, SweepRead::other>(S + e0, S + e1, ds, K, fac, kw, u + e0, f0 + Kp, f0 + 2 * Kp,
                                                        y1 + e1, y2 + e1);
            read_ahead = true;
          } else {
            write2(S, ds, K, e0, e1, fac, kw, u, nf ? nf + Kp : nullptr, nf ? nf + 2 * Kp : nullptr, y1, y2);
          }
          if (tslots && tslots[tb0 + i] >= 0) {  // the state after token t, columns [e0, e1)
            T* dst = s.state(p.hT, tslots[tb0 + i], hvj) + e0 * p.hT.stride[3];
            state_out(S + e0, ds, K, e1 - e0, dst, p.hT.stride[2], p.hT.stride[3]);
          }
        }
      }
    }
  }
  if ((s.diag_pre || exact) && p.aT.data && !tslots && wi >= 0) store_precond(p, s, wi, h, Ast, Pout);
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
