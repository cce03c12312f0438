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

/// Writes the preconditioner state `Pst` of key head h (diagonal K values, or the exact K x K) to slot `slot`.
template <class T, class In>
void store_precond(const KernelParams& p, const Setup<T, In>& s, int64_t slot, int64_t h, const T* Pst, bool exact) {
  T* a = mptr<T>(p.aT) + slot * p.aT.stride[0] + h * p.aT.stride[1];
  if (!exact) {
    for (int64_t c = 0; c < s.K; ++c) a[c] = Pst[c];
    return;
  }
  for (int64_t i = 0; i < s.K; ++i)
    for (int64_t j = 0; j < s.K; ++j) a[i * p.aT.stride[2] + j] = Pst[i * s.K + j];
}

template <class T, class In = T>
void decode_task_t(const KernelParams& p, int64_t task) {
  const Setup<T, In> s(p);
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
  // Speculative verification (token_slots): the state runs in scratch and is copied out after every
  // token; otherwise it is updated in place in its output slot.
  const int64_t* tslots = p.token_slots ? p.token_slots + n * p.token_ld : nullptr;
  const bool exact = p.spec.precond == precond::Kind::exact_atk || p.spec.precond == precond::Kind::exact_atq;
  const bool key_target = p.spec.precond == precond::Kind::diagonal_atk || p.spec.precond == precond::Kind::exact_atk;
  const bool query_target = p.spec.precond == precond::Kind::diagonal_atq || p.spec.precond == precond::Kind::exact_atq;
  const int64_t Tn = len > 0 ? len : 0;
  const int64_t PS = exact ? K * K : Kp;
  // Per token: qn, kn, qr, kw (K each), then per value head: fac (K), the two read coefficients (K each).
  const int64_t per_tok = 4 * Kp, per_head = 3 * Kp;
  // bf16/f16: the value rows converted to float (Tn * r rows) and one output row staged for rounding.
  constexpr bool half = !std::is_same_v<In, T>;
  const int64_t nvc = half ? Tn * r * Vp + Vp : 0;
  const int64_t nsc = tslots ? K * Vp : 0;
  SmallScratch<T> mem(PS + 4 * Kp + Tn * per_tok + Tn * r * per_head + 3 * Vp + Tn * r + Tn + nvc + nsc);
  T* Pst = mem.base;
  T* work = Pst + PS;
  T* tokv = work + 4 * Kp;
  T* headv = tokv + Tn * per_tok;
  T* y1 = headv + Tn * r * per_head;
  T* y2 = y1 + Vp;
  T* u = y2 + Vp;
  T* bet = u + Vp;
  T* kqv = bet + Tn * r;  // kw . qr of each token
  T* vcv = kqv + Tn;      // half inputs: v rows as float, then the staged o row
  T* ocv = vcv + Tn * r * Vp;
  T* Ssc = vcv + nvc;  // verification: the running state, K rows of Vp

  // Preconditioner state (diagonal A or inverse Gram P), from a0 or the default (A = 0, P = I / lambda).
  if (s.diag_pre) {
    if (p.a0.data && ri >= 0) {
      const T* a0 = cptr<T>(p.a0) + ri * p.a0.stride[0] + h * p.a0.stride[1];
      for (int64_t c = 0; c < K; ++c) Pst[c] = a0[c];
    }
  } else if (exact) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j)
        Pst[i * K + j] = p.a0.data && ri >= 0
                             ? cptr<T>(p.a0)[ri * p.a0.stride[0] + h * p.a0.stride[1] + i * p.a0.stride[2] + j]
                             : (i == j ? T(1) / T(p.lambda) : T(0));
  }
  const T ctr = s.diag_pre ? s.center(h) : T(0);

  // Token vectors, shared by the group's value heads (SPEC §2 preconditioner axis).
  for (int64_t t = 0; t < Tn; ++t) {
    const int64_t ti = t0 + t;
    T* qn = tokv + t * per_tok;
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
      for (int64_t c = 0; c < K; ++c) m[c] = Pst[c] = stats1(Pst[c], a, bb, kn[c]);
      squash_inplace(m, Kp, ctr, s.log_x, s.eps);
      for (int64_t c = 0; c < K; ++c) {
        if (key_target) kw[c] = kn[c] * m[c];
        if (query_target) qr[c] = qn[c] * m[c];
      }
    } else if (exact) {
      // P_t = (P - f y z^T) / a, y = P k, z = P^T k, f = beta_p / (a + beta_p k^T y) (Sherman-Morrison).
      const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
      T* y = work;
      T* z = work + Kp;
      for (int64_t i = 0; i < K; ++i) y[i] = z[i] = 0;
      for (int64_t i = 0; i < K; ++i) {
        T sy = 0;
        const T* pr = Pst + i * K;
        for (int64_t j = 0; j < K; ++j) {
          sy += pr[j] * kn[j];
          z[j] += pr[j] * kn[i];
        }
        y[i] = sy;
      }
      T kty = 0;
      for (int64_t i = 0; i < K; ++i) kty += kn[i] * y[i];
      const T f = bb / (a + bb * kty), ia = T(1) / a;
      for (int64_t i = 0; i < K; ++i) {
        T* pr = Pst + i * K;
        const T fy = f * y[i];
        for (int64_t j = 0; j < K; ++j) pr[j] = (pr[j] - fy * z[j]) * ia;
      }
      const T* src = key_target ? kn : qn;
      T* dst = key_target ? kw : qr;
      for (int64_t i = 0; i < K; ++i) {
        T acc = 0;
        const T* pr = Pst + i * K;
        for (int64_t j = 0; j < K; ++j) acc += pr[j] * src[j];
        dst[i] = acc;
      }
    }
    if (tslots && tslots[t] >= 0 && (s.diag_pre || exact) && p.aT.data) store_precond(p, s, tslots[t], h, Pst, exact);
    kqv[t] = dot_padded(kw, qr, Kp);
    for (int64_t j = 0; j < r; ++j) {
      const int64_t hvj = h * r + j;
      T* fac = headv + (t * r + j) * per_head;
      T* ck = fac + Kp;  // fac ⊙ kn: residual read coefficients
      T* cq = ck + Kp;   // fac ⊙ qr: readout coefficients
      if (s.decay == decay::Kind::diagonal) {
        load_cvt(s.grow(b, ti, hvj), K, fac);
        exp_inplace(fac, Kp);  // padding lanes become 1; they only meet zero padding of kn and qr
      } else {
        const T f = s.decay == decay::Kind::scalar ? std::exp(to_c<T>(s.grow(b, ti, hvj)[0])) : T(1);
        for (int64_t c = 0; c < K; ++c) fac[c] = f;
      }
      if constexpr (half) load_cvt(s.vrow(b, ti, hvj), Vd, vcv + (t * r + j) * Vp);
      for (int64_t c = 0; c < K; ++c) {
        ck[c] = fac[c] * kn[c];
        cq[c] = fac[c] * qr[c];
      }
      bet[t * r + j] = s.beta(b, ti, hvj);
    }
  }

  for (int64_t j = 0; j < r; ++j) {
    const int64_t hvj = h * r + j;
    const T* src = ri >= 0 ? s.state(p.h0, ri, hvj) : nullptr;
    T* S = tslots ? Ssc : s.state(p.hT, wi, hvj);
    const int64_t ss = p.h0.stride[2], ds = tslots ? Vp : p.hT.stride[2];
    if (!src)
      for (int64_t c = 0; c < K; ++c) std::memset(static_cast<void*>(S + c * ds), 0, size_t(Vd) * sizeof(T));
    else if (src != S)
      for (int64_t c = 0; c < K; ++c) std::memcpy(S + c * ds, src + c * ss, size_t(Vd) * sizeof(T));
    if (Tn == 0) continue;
    // Value columns are independent (SPEC §2): run all tokens on one block of kDecodeCols columns
    // (32 KB of a 128-row float state) at a time, so the write sweep finds the block in L1. The
    // last token's write sweep of a block also reads the next block for the first token.
    constexpr int64_t BC = kDecodeCols<T>;
    const T* f0 = headv + j * per_head;
    bool read_ahead = false;  // the block's first reads were done by the previous block's last write
    for (int64_t e0 = 0; e0 < Vd; e0 += BC) {
      const int64_t e1 = imin(Vd, e0 + BC);
      if (!read_ahead) read2(S, ds, K, e0, e1, f0 + Kp, f0 + 2 * Kp, y1, y2);
      read_ahead = false;
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t ti = t0 + t;
        const T* qr = tokv + t * per_tok + 2 * Kp;
        const T* kw = qr + Kp;
        const T* fac = headv + (t * r + j) * per_head;
        const T bt = bet[t * r + j];
        const T* v;
        if constexpr (half)
          v = vcv + (t * r + j) * Vp;
        else
          v = s.vrow(b, ti, hvj);
        for (int64_t e = e0; e < e1; ++e) u[e] = bt * (v[e] - (s.online ? y1[e] : T(0)));
        const T kq = kqv[t];
        if constexpr (half) {
          for (int64_t e = e0; e < e1; ++e) ocv[e] = y2[e] + kq * u[e];
          store_cvt(ocv + e0, e1 - e0, s.orow(b, ti, hvj) + e0);
        } else {
          T* o = s.orow(b, ti, hvj);
          for (int64_t e = e0; e < e1; ++e) o[e] = y2[e] + kq * u[e];
        }
        // Write sweep S_t = Diag(fac) S + kw u^T, fused with the read sweep of token t + 1, or for
        // the last token with the first token's reads of the next (whole) block.
        const T* nf = t + 1 < Tn ? headv + ((t + 1) * r + j) * per_head : nullptr;
        if (!nf && e1 - e0 == BC && e1 + BC <= Vd) {
          write_block<T, kDecodeNB, SweepRead::other>(S + e0, S + e1, ds, K, fac, kw, u + e0, f0 + Kp, f0 + 2 * Kp,
                                                      y1 + e1, y2 + e1);
          read_ahead = true;
        } else {
          write2(S, ds, K, e0, e1, fac, kw, u, nf ? nf + Kp : nullptr, nf ? nf + 2 * Kp : nullptr, y1, y2);
        }
        if (tslots && tslots[t] >= 0) {  // the state after token t, columns [e0, e1)
          T* dst = s.state(p.hT, tslots[t], hvj);
          for (int64_t c = 0; c < K; ++c)
            std::memcpy(dst + c * p.hT.stride[2] + e0, S + c * ds + e0, size_t(e1 - e0) * sizeof(T));
        }
      }
    }
  }
  if ((s.diag_pre || exact) && p.aT.data && !tslots && wi >= 0) store_precond(p, s, wi, h, Pst, exact);
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
