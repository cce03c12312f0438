/// @brief Preconditioner axis (SPEC §2): maps the read key k to the write key kw, or q to the read query qr.
#pragma once

#include <cmath>
#include <cstdint>

#include "dgps/detail/squash.hpp"

namespace dgps::precond {

/// Identifiers usable at run time.
enum class Kind { identity, diagonal_atk, diagonal_atq, exact_atk, exact_atq };
/// Which vector the preconditioner multiplies.
enum class Target { none, key, query };
/// The preconditioner's own recurrent state.
enum class State { none, diagonal /* A: [K] */, exact /* P: [K, K] */ };

/// kw = k, qr = q. No state, no gates.
struct Identity {
  static constexpr Kind kind = Kind::identity;
  static constexpr Target target = Target::none;
  static constexpr State state = State::none;
  static constexpr const char* name = "identity";
};
/// PDN/PGDN/PKDA (paper eq. 9): diagonal key statistics A, squashed scale M, kw = k ⊙ M.
struct DiagonalATK {
  static constexpr Kind kind = Kind::diagonal_atk;
  static constexpr Target target = Target::key;
  static constexpr State state = State::diagonal;
  static constexpr const char* name = "diag-atk";
};
/// P-Mamba-2: the same statistics and M applied to the query, qr = q ⊙ M.
struct DiagonalATQ {
  static constexpr Kind kind = Kind::diagonal_atq;
  static constexpr Target target = Target::query;
  static constexpr State state = State::diagonal;
  static constexpr const char* name = "diag-atq";
};
/// Mesa layer / RLS: inverse Gram P kept by Sherman-Morrison, kw = P k.
struct ExactATK {
  static constexpr Kind kind = Kind::exact_atk;
  static constexpr Target target = Target::key;
  static constexpr State state = State::exact;
  static constexpr const char* name = "exact-atk";
};
/// Exact ridge readout: same P, qr = P q.
struct ExactATQ {
  static constexpr Kind kind = Kind::exact_atq;
  static constexpr Target target = Target::query;
  static constexpr State state = State::exact;
  static constexpr const char* name = "exact-atq";
};

/// True when the preconditioner needs g_p and beta_p.
template <class P>
inline constexpr bool needs_gates = P::state != State::none;
/// True when the preconditioner needs `center` (the diagonal squash).
template <class P>
inline constexpr bool needs_center = P::state == State::diagonal;

/// Number of scalars in one head's preconditioner state (0, K or K*K).
template <class P>
constexpr int64_t state_size(int64_t K) {
  return P::state == State::none ? 0 : (P::state == State::diagonal ? K : K * K);
}

/// Scalar options of the squash and the exact solve.
template <class Acc>
struct Constants {
  Acc log_x;   ///< log of the squash bound x
  Acc eps;     ///< added inside log(A + eps)
  Acc lambda;  ///< ridge: P_0 = I / lambda when no a0 is given
};

/// Initial state of one key head: a copy of `a0` (row-major, K or K*K values, may be null) or the
/// default (A = 0, P = I / lambda).
template <class P, class Acc, class In>
inline void init_state(Acc* st, const In* a0, int64_t a0_row_stride, int64_t K, const Constants<Acc>& c) {
  if constexpr (P::state == State::diagonal) {
    for (int64_t i = 0; i < K; ++i) st[i] = a0 ? Acc(a0[i]) : Acc(0);
  } else if constexpr (P::state == State::exact) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j)
        st[i * K + j] = a0 ? Acc(a0[i * a0_row_stride + j]) : (i == j ? Acc(1) / c.lambda : Acc(0));
  } else {
    (void)st, (void)a0, (void)a0_row_stride, (void)K, (void)c;
  }
}

/// The squash of SPEC §2 (maths::squash): r = log(A + eps) - center, s = r / (1 + |r|), M = exp(-log(x) s).
/// Also returns dM/dA in `dmda` (0 where A + eps is 0).
template <class Acc>
inline Acc squash(Acc A, Acc center, const Constants<Acc>& c, Acc* dmda = nullptr) {
  const Acc m = maths::squash(A, center, c.log_x, c.eps);
  if (dmda) *dmda = maths::squash_slope(A, m, center, c.log_x, c.eps);
  return m;
}

/// One token of the statistics: updates `st` in place (A or P) with the normalised key `kn`, the
/// decay a = exp(g_p) and gain b = beta_p; for the diagonal kinds also fills the scale `M` [K].
template <class P, class Acc>
inline void update(Acc* st, Acc* M, const Acc* kn, Acc a, Acc b, Acc center, int64_t K, const Constants<Acc>& c,
                   Acc* work /* 2K scratch */) {
  if constexpr (P::state == State::diagonal) {
    for (int64_t i = 0; i < K; ++i) {
      st[i] = maths::stats_step(st[i], a, b, kn[i]);
      M[i] = maths::squash(st[i], center, c.log_x, c.eps);
    }
  } else if constexpr (P::state == State::exact) {
    // P_t = (P - b y z^T / (a + b k^T y)) / a with y = P k, z = P^T k (SPEC §2, Sherman-Morrison).
    Acc* y = work;
    Acc* z = work + K;
    for (int64_t i = 0; i < K; ++i) {
      Acc sy = 0, sz = 0;
      for (int64_t j = 0; j < K; ++j) {
        sy += st[i * K + j] * kn[j];
        sz += st[j * K + i] * kn[j];
      }
      y[i] = sy;
      z[i] = sz;
    }
    Acc kty = 0;
    for (int64_t i = 0; i < K; ++i) kty += kn[i] * y[i];
    const Acc f = b / (a + b * kty);
    const Acc ia = Acc(1) / a;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) st[i * K + j] = (st[i * K + j] - f * y[i] * z[j]) * ia;
  } else {
    (void)st, (void)M, (void)kn, (void)a, (void)b, (void)center, (void)K, (void)c, (void)work;
  }
}

/// out = the preconditioned vector: in ⊙ M (diagonal) or P in (exact); a copy for Identity.
template <class P, class Acc>
inline void apply(const Acc* st, const Acc* M, const Acc* in, Acc* out, int64_t K) {
  if constexpr (P::state == State::diagonal) {
    for (int64_t i = 0; i < K; ++i) out[i] = in[i] * M[i];
  } else if constexpr (P::state == State::exact) {
    for (int64_t i = 0; i < K; ++i) {
      Acc s = 0;
      for (int64_t j = 0; j < K; ++j) s += st[i * K + j] * in[j];
      out[i] = s;
    }
  } else {
    (void)st, (void)M;
    for (int64_t i = 0; i < K; ++i) out[i] = in[i];
  }
}

/// Gradients of the preconditioner's inputs for one token.
template <class Acc>
struct TokenGrads {
  Acc g_p = 0, beta_p = 0, center = 0;
};

/// Backward of one token of `update` followed by `apply` (SPEC §3.8, App. D).
///
/// `prev` is the state before the token, `cur` after it, `tgt` the vector that was mapped (kn or qn)
/// and `d_mapped` the gradient of the mapped vector (dkw or dqr). On entry `dst` holds dL/d(cur); on
/// exit dL/d(prev). Adds to `d_tgt` (the mapped vector's own gradient) and `dkn` (through the
/// statistics), and returns the gate gradients. `work` has room for 4K + K*K scalars.
template <class P, class Acc>
inline TokenGrads<Acc> backward(const Acc* prev, const Acc* cur, const Acc* kn, const Acc* tgt, const Acc* d_mapped,
                                Acc* dst, Acc* d_tgt, Acc* dkn, Acc a, Acc b, Acc center, int64_t K,
                                const Constants<Acc>& c, Acc* work) {
  TokenGrads<Acc> out;
  if constexpr (P::state == State::diagonal) {
    for (int64_t i = 0; i < K; ++i) {
      Acc dmda = 0;
      const Acc m = squash(cur[i], center, c, &dmda);
      d_tgt[i] += d_mapped[i] * m;
      const Acc dm = d_mapped[i] * tgt[i];
      // dM/dcenter = -dM/dr and dM/dA = dM/dr / (A + eps): recover dM/dr from dmda.
      const Acc dr = dm * dmda * (cur[i] + c.eps);
      const Acc dA = dst[i] + dm * dmda;
      out.center -= dr;
      out.g_p += a * dA * prev[i];
      out.beta_p += dA * kn[i] * kn[i];
      dkn[i] += Acc(2) * b * kn[i] * dA;
      dst[i] = a * dA;
    }
  } else if constexpr (P::state == State::exact) {
    // mapped = P_t tgt: dP_t += d_mapped tgt^T, d_tgt += P_t^T d_mapped.
    for (int64_t i = 0; i < K; ++i) {
      Acc s = 0;
      for (int64_t j = 0; j < K; ++j) {
        dst[i * K + j] += d_mapped[i] * tgt[j];
        s += cur[j * K + i] * d_mapped[j];
      }
      d_tgt[i] += s;
    }
    // P_t = Z / a, Z = P - b y z^T / den, y = P k, z = P^T k, den = a + b k^T y.
    Acc* y = work;
    Acc* z = work + K;
    Acc* dy = work + 2 * K;
    Acc* dz = work + 3 * K;
    for (int64_t i = 0; i < K; ++i) {
      Acc sy = 0, sz = 0;
      for (int64_t j = 0; j < K; ++j) {
        sy += prev[i * K + j] * kn[j];
        sz += prev[j * K + i] * kn[j];
      }
      y[i] = sy;
      z[i] = sz;
    }
    Acc kty = 0;
    for (int64_t i = 0; i < K; ++i) kty += kn[i] * y[i];
    const Acc den = a + b * kty;
    Acc da = 0, GP = 0;
    for (int64_t i = 0; i < K * K; ++i) GP += dst[i] * cur[i];
    da -= GP / a;
    const Acc ia = Acc(1) / a;
    // dZ = G / a (stored back into dst, which becomes dP_{t-1} after the terms below).
    for (int64_t i = 0; i < K * K; ++i) dst[i] *= ia;
    Acc ydz = 0;
    for (int64_t i = 0; i < K; ++i) {
      Acc sy = 0, sz = 0;
      for (int64_t j = 0; j < K; ++j) {
        sy += dst[i * K + j] * z[j];
        sz += dst[j * K + i] * y[j];
      }
      dy[i] = -(b / den) * sy;
      dz[i] = -(b / den) * sz;
      ydz += y[i] * sy;
    }
    Acc dbp = -ydz / den;
    const Acc dden = b * ydz / (den * den);
    da += dden;
    dbp += dden * kty;
    for (int64_t i = 0; i < K; ++i) {
      dkn[i] += dden * b * y[i];
      dy[i] += dden * b * kn[i];
    }
    // y = P k: dP += dy k^T, dk += P^T dy;  z = P^T k: dP += k dz^T, dk += P dz.
    for (int64_t i = 0; i < K; ++i) {
      Acc s = 0;
      for (int64_t j = 0; j < K; ++j) s += prev[j * K + i] * dy[j] + prev[i * K + j] * dz[j];
      dkn[i] += s;
    }
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) dst[i * K + j] += dy[i] * kn[j] + kn[i] * dz[j];
    out.g_p = a * da;
    out.beta_p = dbp;
  } else {
    (void)prev, (void)cur, (void)kn, (void)a, (void)b, (void)center, (void)c, (void)work, (void)dst, (void)dkn;
    for (int64_t i = 0; i < K; ++i) d_tgt[i] += d_mapped[i];
  }
  return out;
}

}  // namespace dgps::precond
