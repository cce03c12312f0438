/// @brief The token-by-token recurrence of SPEC §2 and its exact backward, generic over the policies.
///
/// This is the oracle: `Acc = double` on the reference backend. The CPU backend runs the same code
/// with `Acc = T` as its recurrent algorithm for every policy combination.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dgps/detail/problem.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/tensor.hpp"
#include "dgps/types.hpp"

namespace dgps::reference {

namespace detail_rec {

/// L2 norm of SPEC §1 (x / sqrt(sum x^2 + 1e-6)) times `mul`; returns rstd (1 when `norm` is off).
template <class Acc, class In>
inline Acc load_normalised(const In* x, int64_t K, bool norm, Acc mul, Acc* out) {
  Acc rstd = 1;
  if (norm) {
    Acc ss = 0;
    for (int64_t i = 0; i < K; ++i) ss += Acc(x[i]) * Acc(x[i]);
    rstd = Acc(1) / std::sqrt(ss + Acc(1e-6));
  }
  for (int64_t i = 0; i < K; ++i) out[i] = Acc(x[i]) * rstd * mul;
  return rstd;
}

/// Backward of load_normalised: dx = mul * rstd * (dy - y (y . dy)) with y the normalised x.
template <class Acc, class In>
inline void normalised_backward(const In* x, Acc rstd, bool norm, Acc mul, const Acc* dy, Acc* dx, int64_t K) {
  if (!norm) {
    for (int64_t i = 0; i < K; ++i) dx[i] = mul * dy[i];
    return;
  }
  Acc ydy = 0;
  for (int64_t i = 0; i < K; ++i) ydy += Acc(x[i]) * rstd * dy[i];
  for (int64_t i = 0; i < K; ++i) dx[i] = mul * rstd * (dy[i] - Acc(x[i]) * rstd * ydy);
}

}  // namespace detail_rec

/// Runs the recurrence for one (sequence n, key head h) group: the key head's preconditioner state
/// and the HV/H value heads that read it. Workspace is allocated per call.
template <class R, class T, class Acc>
class GroupKernel {
  using D = typename R::decay_type;
  using G = typename R::gain_type;
  using P = typename R::precond_type;
  using S = state_t<T>;
  static constexpr bool kOnline = R::solve_type::kind == solve::Kind::online;
  static constexpr bool kKeyTarget = P::target == precond::Target::key;
  static constexpr bool kQueryTarget = P::target == precond::Target::query;

 public:
  GroupKernel(const dgps::detail::Problem<T>& p, int64_t n, int64_t h)
      : p_(p), n_(n), h_(h), r_(p.HV / p.H), K_(p.K), V_(p.V), KV_(p.K * p.V), PS_(precond::state_size<P>(p.K)),
        b_(p.seq_batch(n)), t0_(p.seq_begin(n)), L_(p.seq_len(n)), si_(p.state_index(n)),
        ri_(p.read_index(n)), wi_(p.write_index(n)),
        c_{Acc(std::log(p.x)), Acc(p.eps), Acc(p.lambda)} {}

  /// Forward pass: writes o for every token of the sequence, and hT / aT when requested.
  /// Through a state pool (decode): a padding sequence only zeroes its outputs; with token slots the
  /// state after every token is stored to its slot instead of a final state.
  void forward() {
    if (p_.is_padded(n_)) {
      for (int64_t t = 0; t < L_; ++t)
        for (int64_t j = 0; j < r_; ++j)
          for (int64_t e = 0; e < V_; ++e) p_.o(b_, t0_ + t, hv(j), e) = T_out(0);
      return;
    }
    std::vector<Acc> S(r_ * KV_), A(PS_);
    load_initial(S.data(), A.data());
    Token tok(K_, V_);
    const int64_t* ts = p_.token_slots ? p_.token_slots + n_ * p_.token_ld : nullptr;
    for (int64_t t = 0; t < L_; ++t) {
      step(t, S.data(), A.data(), tok);
      for (int64_t j = 0; j < r_; ++j) write_o(t, j, S.data() + j * KV_, tok.qr.data());
      if (ts && ts[t] >= 0) store_state(ts[t], S.data(), A.data());
    }
    if (!ts && wi_ >= 0) store_state(wi_, S.data(), A.data());
  }

  /// Backward pass with checkpoints every `chunk` tokens (memory O(L / chunk * K * V) per head):
  /// recomputes each chunk forward, then runs it in reverse. Writes every requested gradient.
  /// `dcenter_out` receives this group's contribution to dcenter[h] (summed over sequences by the caller).
  void backward(Acc* dcenter_out) {
    const int64_t C = std::max<int64_t>(1, p_.chunk);
    const int64_t nchunks = (L_ + C - 1) / C;
    const int64_t stride = r_ * KV_ + PS_;
    std::vector<Acc> ckpt(std::max<int64_t>(1, nchunks) * stride);
    std::vector<Acc> S(r_ * KV_), A(PS_);
    load_initial(S.data(), A.data());
    Token tok(K_, V_);
    for (int64_t t = 0; t < L_; ++t) {
      if (t % C == 0) save(ckpt.data() + (t / C) * stride, S.data(), A.data());
      step(t, S.data(), A.data(), tok);
    }
    // Reverse sweep. dS: gradient w.r.t. the state after the current token; dA likewise.
    std::vector<Acc> dS(r_ * KV_, Acc(0)), dA(PS_, Acc(0));
    if (p_.dhT.data)
      for (int64_t j = 0; j < r_; ++j)
        for (int64_t c = 0; c < K_; ++c)
          for (int64_t e = 0; e < V_; ++e) dS[j * KV_ + c * V_ + e] = Acc(p_.dhT(si_, hv(j), c, e));
    if constexpr (P::state != precond::State::none)
      if (p_.daT.data) load_precond(p_.daT, dA.data(), si_);
    Acc dcenter = 0;
    std::vector<Acc> Sprev(C * r_ * KV_), Aprev(C * std::max<int64_t>(PS_, 1));
    Grad gr(K_, V_, PS_);
    for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
      const int64_t ta = ci * C, tb = std::min(L_, ta + C);
      restore(ckpt.data() + ci * stride, S.data(), A.data());
      for (int64_t t = ta; t < tb; ++t) {
        std::copy(S.begin(), S.end(), Sprev.begin() + (t - ta) * r_ * KV_);
        std::copy(A.begin(), A.end(), Aprev.begin() + (t - ta) * PS_);
        step(t, S.data(), A.data(), tok);
      }
      for (int64_t t = tb - 1; t >= ta; --t)
        dcenter += step_backward(t, Sprev.data() + (t - ta) * r_ * KV_, Aprev.data() + (t - ta) * PS_, dS.data(),
                                 dA.data(), tok, gr);
    }
    if (p_.dh0.data)
      for (int64_t j = 0; j < r_; ++j)
        for (int64_t c = 0; c < K_; ++c)
          for (int64_t e = 0; e < V_; ++e) p_.dh0(si_, hv(j), c, e) = S_out(dS[j * KV_ + c * V_ + e]);
    if constexpr (P::state != precond::State::none)
      if (p_.da0.data) store_precond(p_.da0, dA.data(), si_);
    *dcenter_out = dcenter;
  }

 private:
  struct Token {
    std::vector<Acc> qn, kn, qr, kw, M, u, fac, work;
    Acc rq = 1, rk = 1;
    Token(int64_t K, int64_t V) : qn(K), kn(K), qr(K), kw(K), M(K), u(V), fac(K), work(4 * K) {}
  };
  struct Grad {
    std::vector<Acc> dqr, dkw, dqn, dkn, dSbar, du, dx, dgv, Sbar, Scur, Pcur, work;
    Grad(int64_t K, int64_t V, int64_t PS)
        : dqr(K), dkw(K), dqn(K), dkn(K), dSbar(K * V), du(V), dx(K), dgv(K), Sbar(K * V), Scur(K * V),
          Pcur(std::max<int64_t>(PS, 1)), work(4 * K) {}
  };

  int64_t hv(int64_t j) const { return h_ * r_ + j; }
  int64_t tok_index(int64_t t) const { return t0_ + t; }
  static S S_out(Acc v) { return static_cast<S>(v); }
  static T T_out(Acc v) { return static_cast<T>(v); }

  template <class V>
  void load_precond(const TensorView<V>& a, Acc* dst, int64_t si) const {
    if constexpr (P::state == precond::State::diagonal) {
      for (int64_t c = 0; c < K_; ++c) dst[c] = Acc(a(si, h_, c));
    } else {
      for (int64_t c = 0; c < K_; ++c)
        for (int64_t e = 0; e < K_; ++e) dst[c * K_ + e] = Acc(a(si, h_, c, e));
    }
  }
  template <class V>
  void store_precond(const TensorView<V>& a, const Acc* src, int64_t si) const {
    if constexpr (P::state == precond::State::diagonal) {
      for (int64_t c = 0; c < K_; ++c) a(si, h_, c) = static_cast<V>(src[c]);
    } else {
      for (int64_t c = 0; c < K_; ++c)
        for (int64_t e = 0; e < K_; ++e) a(si, h_, c, e) = static_cast<V>(src[c * K_ + e]);
    }
  }

  /// The initial states of state ri_ (zeros / the default preconditioner state when absent or ri_ < 0).
  void load_initial(Acc* S, Acc* A) const {
    const bool h0 = p_.h0.data && ri_ >= 0;
    for (int64_t j = 0; j < r_; ++j)
      for (int64_t c = 0; c < K_; ++c)
        for (int64_t e = 0; e < V_; ++e) S[j * KV_ + c * V_ + e] = h0 ? Acc(p_.h0(ri_, hv(j), c, e)) : Acc(0);
    if constexpr (P::state != precond::State::none) {
      if (p_.a0.data && ri_ >= 0)
        load_precond(p_.a0, A, ri_);
      else
        precond::init_state<P, Acc, Acc>(A, static_cast<const Acc*>(nullptr), 0, K_, c_);
    }
  }

  /// Stores the states to state `si` of hT / aT (when given).
  void store_state(int64_t si, const Acc* S, const Acc* A) const {
    if (p_.hT.data)
      for (int64_t j = 0; j < r_; ++j)
        for (int64_t c = 0; c < K_; ++c)
          for (int64_t e = 0; e < V_; ++e) p_.hT(si, hv(j), c, e) = S_out(S[j * KV_ + c * V_ + e]);
    if constexpr (P::state != precond::State::none)
      if (p_.aT.data) store_precond(p_.aT, A, si);
  }

  void save(Acc* dst, const Acc* S, const Acc* A) const {
    std::copy(S, S + r_ * KV_, dst);
    std::copy(A, A + PS_, dst + r_ * KV_);
  }
  void restore(const Acc* src, Acc* S, Acc* A) const {
    std::copy(src, src + r_ * KV_, S);
    std::copy(src + r_ * KV_, src + r_ * KV_ + PS_, A);
  }

  /// Loads and preconditions the token's q and k (shared by the group's value heads): tok.qn, kn, qr, kw.
  /// Advances the preconditioner state A.
  void prepare(int64_t t, Acc* A, Token& tok) const {
    const int64_t ti = tok_index(t);
    tok.rq = detail_rec::load_normalised(p_.q.row(b_, ti, h_), K_, p_.l2norm, Acc(p_.scale), tok.qn.data());
    tok.rk = detail_rec::load_normalised(p_.k.row(b_, ti, h_), K_, p_.l2norm, Acc(1), tok.kn.data());
    if constexpr (P::state != precond::State::none) {
      const Acc a = std::exp(Acc(p_.g_p(b_, ti, h_)));
      const Acc bp = Acc(p_.beta_p(b_, ti, h_));
      const Acc ctr = precond::needs_center<P> ? Acc(p_.center(h_)) : Acc(0);
      precond::update<P>(A, tok.M.data(), tok.kn.data(), a, bp, ctr, K_, c_, tok.work.data());
    }
    precond::apply<P>(A, tok.M.data(), kKeyTarget ? tok.kn.data() : tok.qn.data(),
                      kKeyTarget ? tok.kw.data() : tok.qr.data(), K_);
    if constexpr (!kKeyTarget) std::copy(tok.kn.begin(), tok.kn.end(), tok.kw.begin());
    if constexpr (!kQueryTarget) std::copy(tok.qn.begin(), tok.qn.end(), tok.qr.begin());
  }

  /// One value head's state update S_{t-1} -> S_t (in place): decay, then the write.
  void update_state(int64_t t, int64_t j, Acc* S, const Token& tok, Acc* fac, Acc* u) const {
    const int64_t ti = tok_index(t);
    const int64_t hvj = hv(j);
    if constexpr (D::needs_g) decay::row_factors<D, Acc>(D::per_channel ? p_.g.row(b_, ti, hvj) : &p_.g(b_, ti, hvj), K_, fac);
    if constexpr (D::kind != decay::Kind::none)
      for (int64_t c = 0; c < K_; ++c)
        for (int64_t e = 0; e < V_; ++e) S[c * V_ + e] *= fac[c];
    const Acc bgain = gain::value<G, Acc>(G::needs_beta ? &p_.beta(b_, ti, hvj) : static_cast<const T*>(nullptr));
    const T* v = p_.v.row(b_, ti, hvj);
    for (int64_t e = 0; e < V_; ++e) u[e] = Acc(v[e]);
    if constexpr (kOnline)
      for (int64_t c = 0; c < K_; ++c)
        for (int64_t e = 0; e < V_; ++e) u[e] -= S[c * V_ + e] * tok.kn[c];
    for (int64_t c = 0; c < K_; ++c) {
      const Acc w = bgain * tok.kw[c];
      for (int64_t e = 0; e < V_; ++e) S[c * V_ + e] += w * u[e];
    }
  }

  void step(int64_t t, Acc* S, Acc* A, Token& tok) const {
    prepare(t, A, tok);
    for (int64_t j = 0; j < r_; ++j) update_state(t, j, S + j * KV_, tok, tok.fac.data(), tok.u.data());
  }

  void write_o(int64_t t, int64_t j, const Acc* S, const Acc* qr) const {
    T* o = p_.o.row(b_, tok_index(t), hv(j));
    for (int64_t e = 0; e < V_; ++e) {
      Acc s = 0;
      for (int64_t c = 0; c < K_; ++c) s += S[c * V_ + e] * qr[c];
      o[e] = T_out(s);
    }
  }

  /// Backward of one token. `Sp`/`Ap`: states before the token. On entry dS/dA hold the gradients
  /// w.r.t. the states after it; on exit w.r.t. the states before it. Returns the dcenter term.
  Acc step_backward(int64_t t, const Acc* Sp, const Acc* Ap, Acc* dS, Acc* dA, Token& tok, Grad& gr) {
    const int64_t ti = tok_index(t);
    std::copy(Ap, Ap + PS_, gr.Pcur.begin());
    prepare(t, gr.Pcur.data(), tok);  // gr.Pcur: state after the token
    std::fill(gr.dqr.begin(), gr.dqr.end(), Acc(0));
    std::fill(gr.dkw.begin(), gr.dkw.end(), Acc(0));
    std::fill(gr.dkn.begin(), gr.dkn.end(), Acc(0));
    std::fill(gr.dqn.begin(), gr.dqn.end(), Acc(0));
    for (int64_t j = 0; j < r_; ++j) {
      const int64_t hvj = hv(j);
      Acc* dSj = dS + j * KV_;
      // Recompute Sbar and S_t of this value head.
      std::copy(Sp + j * KV_, Sp + (j + 1) * KV_, gr.Sbar.begin());
      if constexpr (D::needs_g) decay::row_factors<D, Acc>(D::per_channel ? p_.g.row(b_, ti, hvj) : &p_.g(b_, ti, hvj), K_, tok.fac.data());
      if constexpr (D::kind != decay::Kind::none)
        for (int64_t c = 0; c < K_; ++c)
          for (int64_t e = 0; e < V_; ++e) gr.Sbar[c * V_ + e] *= tok.fac[c];
      std::copy(Sp + j * KV_, Sp + (j + 1) * KV_, gr.Scur.begin());
      update_state(t, j, gr.Scur.data(), tok, tok.fac.data(), tok.u.data());  // tok.u = residual / v
      const Acc bgain = gain::value<G, Acc>(G::needs_beta ? &p_.beta(b_, ti, hvj) : static_cast<const T*>(nullptr));
      // o = S_t^T qr: dS_t += qr do^T, dqr += S_t do.
      const T* dout = p_.d_o.row(b_, ti, hvj);
      for (int64_t c = 0; c < K_; ++c) {
        Acc s = 0;
        for (int64_t e = 0; e < V_; ++e) {
          const Acc de = Acc(dout[e]);
          dSj[c * V_ + e] += tok.qr[c] * de;
          s += gr.Scur[c * V_ + e] * de;
        }
        gr.dqr[c] += s;
      }
      // S_t = Sbar + b kw u^T.
      std::vector<Acc>& du = gr.du;
      std::fill(du.begin(), du.end(), Acc(0));
      Acc db = 0;
      for (int64_t c = 0; c < K_; ++c) {
        Acc su = 0;
        for (int64_t e = 0; e < V_; ++e) {
          su += dSj[c * V_ + e] * tok.u[e];
          du[e] += bgain * tok.kw[c] * dSj[c * V_ + e];
        }
        db += tok.kw[c] * su;
        gr.dkw[c] += bgain * su;
      }
      // dv = du; online: u = v - Sbar^T kn, so dSbar = dS - kn du^T and dkn -= Sbar du.
      if (p_.dv.data) {
        T* dv = p_.dv.row(b_, ti, hvj);
        for (int64_t e = 0; e < V_; ++e) dv[e] = T_out(du[e]);
      }
      if constexpr (G::needs_beta)
        if (p_.dbeta.data) p_.dbeta(b_, ti, hvj) = T_out(db);
      std::copy(dSj, dSj + KV_, gr.dSbar.begin());
      if constexpr (kOnline) {
        for (int64_t c = 0; c < K_; ++c) {
          Acc s = 0;
          for (int64_t e = 0; e < V_; ++e) {
            gr.dSbar[c * V_ + e] -= tok.kn[c] * du[e];
            s += gr.Sbar[c * V_ + e] * du[e];
          }
          gr.dkn[c] -= s;
        }
      }
      // Sbar = Diag(fac) S_{t-1}.
      if constexpr (D::needs_g) {
        std::fill(gr.dgv.begin(), gr.dgv.end(), Acc(0));
        decay::gate_grad<D, Acc>(gr.dSbar.data(), gr.Sbar.data(), K_, V_, gr.dgv.data());
        if (p_.dg.data) {
          if constexpr (D::per_channel) {
            T* dg = p_.dg.row(b_, ti, hvj);
            for (int64_t c = 0; c < K_; ++c) dg[c] = T_out(gr.dgv[c]);
          } else {
            p_.dg(b_, ti, hvj) = T_out(gr.dgv[0]);
          }
        }
      }
      if constexpr (D::kind == decay::Kind::none)
        std::copy(gr.dSbar.begin(), gr.dSbar.end(), dSj);
      else
        for (int64_t c = 0; c < K_; ++c)
          for (int64_t e = 0; e < V_; ++e) dSj[c * V_ + e] = gr.dSbar[c * V_ + e] * tok.fac[c];
    }
    // Preconditioner: mapped = kw (key target) or qr (query target).
    Acc dctr = 0;
    if constexpr (P::state != precond::State::none) {
      const Acc a = std::exp(Acc(p_.g_p(b_, ti, h_)));
      const Acc bp = Acc(p_.beta_p(b_, ti, h_));
      const Acc ctr = precond::needs_center<P> ? Acc(p_.center(h_)) : Acc(0);
      const Acc* tgt = kKeyTarget ? tok.kn.data() : tok.qn.data();
      const Acc* dmapped = kKeyTarget ? gr.dkw.data() : gr.dqr.data();
      Acc* dtgt = kKeyTarget ? gr.dkn.data() : gr.dqn.data();
      const auto pg = precond::backward<P, Acc>(Ap, gr.Pcur.data(), tok.kn.data(), tgt, dmapped, dA, dtgt,
                                                gr.dkn.data(), a, bp, ctr, K_, c_, gr.work.data());
      if (p_.dg_p.data) p_.dg_p(b_, ti, h_) = T_out(pg.g_p);
      if (p_.dbeta_p.data) p_.dbeta_p(b_, ti, h_) = T_out(pg.beta_p);
      dctr = pg.center;
      if constexpr (kKeyTarget)
        for (int64_t c = 0; c < K_; ++c) gr.dqn[c] += gr.dqr[c];
      else
        for (int64_t c = 0; c < K_; ++c) gr.dkn[c] += gr.dkw[c];
    } else {
      for (int64_t c = 0; c < K_; ++c) {
        gr.dqn[c] += gr.dqr[c];
        gr.dkn[c] += gr.dkw[c];
      }
    }
    // L2 norm and scale.
    Acc* dx = gr.dx.data();
    if (p_.dq.data) {
      detail_rec::normalised_backward(p_.q.row(b_, ti, h_), tok.rq, p_.l2norm, Acc(p_.scale), gr.dqn.data(), dx, K_);
      T* dq = p_.dq.row(b_, ti, h_);
      for (int64_t c = 0; c < K_; ++c) dq[c] = T_out(dx[c]);
    }
    if (p_.dk.data) {
      detail_rec::normalised_backward(p_.k.row(b_, ti, h_), tok.rk, p_.l2norm, Acc(1), gr.dkn.data(), dx, K_);
      T* dk = p_.dk.row(b_, ti, h_);
      for (int64_t c = 0; c < K_; ++c) dk[c] = T_out(dx[c]);
    }
    return dctr;
  }

  const dgps::detail::Problem<T>& p_;
  int64_t n_, h_, r_, K_, V_, KV_, PS_, b_, t0_, L_, si_, ri_, wi_;
  precond::Constants<Acc> c_;
};

}  // namespace dgps::reference
