/// @brief SPEC §3 identities: Theorem 3.1, the squash example, x = 1 reduction, eigenvalue bound, edge inputs.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// Removes the inputs that model `spec` does not take (to reuse one case for two models).
Case restrict_to(Case c, const dgps::ModelSpec& spec) {
  c.spec = spec;
  if (!has_precond_state(spec))
    for (const char* n : {"g_p", "beta_p", "a0", "daT"}) c.arr.erase(n);
  if (!is_diagonal_precond(spec)) c.arr.erase("center");
  return c;
}

template <class P, class I>
void check_reduction(const char* label, uint64_t seed) {
  const dgps::Shape shape{.batch = 2, .time = 37, .heads = 2, .v_heads = 4, .key_dim = 8, .value_dim = 5};
  Case cp = random_case(dgps::spec_of<P>(), shape, {}, seed);
  cp.arr.erase("daT");  // aT itself depends on the gates; the loss must not see it
  const Case ci = restrict_to(cp, dgps::spec_of<I>());
  dgps::Options opt = on(dgps::Backend::reference);
  opt.x = 1.0;
  const Arrays fp = run_forward<double, P>(cp, opt), fi = run_forward<double, I>(ci, opt);
  for (const char* n : {"o", "hT"}) {
    INFO(label << " " << n << " max|diff| " << rel_err(fp.at(n), fi.at(n)));
    CHECK(fp.at(n) == fi.at(n));  // bitwise: M = exp(-log(1) s) = 1 exactly
  }
  const Arrays gp = run_backward<double, P>(cp, opt), gi = run_backward<double, I>(ci, opt);
  for (const auto& kv : gi) {
    const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& v = kv.second;
    INFO(label << " " << n << " rel err " << rel_err(gp.at(n), v));
    CHECK(gp.at(n) == v);
  }
  // The preconditioner's own gates have no influence at x = 1.
  CHECK(max_abs(gp.at("dg_p")) == 0.0);
  CHECK(max_abs(gp.at("dbeta_p")) == 0.0);
  CHECK(max_abs(gp.at("dcenter")) == 0.0);
  // The CPU backend (float32) within the forward tolerance of SPEC §5.
  dgps::Options cpu = on(dgps::Backend::cpu);
  cpu.x = 1.0;
  const Arrays fc = run_forward<float, P>(cp, cpu);
  INFO(label << " cpu o err " << rel_err(fc.at("o"), fi.at("o")));
  CHECK(rel_err(fc.at("o"), fi.at("o")) < 1e-4);
}

/// Runs the model on T = 20000 tokens with unit keys and beta * x <= 2 (SPEC §3.7).
template <class R>
Arrays long_run(double beta_lo, double beta_max, double g_lo, double g_hi, int64_t T, uint64_t seed,
                dgps::Backend backend, bool as_float) {
  const dgps::Shape shape{.batch = 1, .time = T, .heads = 1, .v_heads = 1, .key_dim = 8, .value_dim = 8};
  Gen gen;
  gen.h0 = gen.a0 = gen.final_grads = false;
  gen.beta_lo = beta_lo;
  gen.beta_hi = beta_max;
  gen.g_lo = g_lo;
  gen.g_hi = g_hi;
  const Case c = random_case(dgps::spec_of<R>(), shape, {}, seed, gen);
  return as_float ? run_forward<float, R>(c, on(backend)) : run_forward<double, R>(c, on(backend));
}

/// Max |x| over the tokens [t0, t1) of o [1, T, 1, V].
double max_abs_range(const std::vector<double>& o, int64_t V, int64_t t0, int64_t t1) {
  double m = 0;
  for (int64_t i = t0 * V; i < t1 * V; ++i) m = std::max(m, std::fabs(o[static_cast<size_t>(i)]));
  return m;
}

template <class R>
void check_bounded(const char* label, double beta_max, uint64_t seed) {
  const int64_t T = 20000, V = 8;
  for (double g_lo : {-0.02, 0.0}) {
    const Arrays ref = long_run<R>(0.0, beta_max, g_lo, 0.0, T, seed, dgps::Backend::reference, false);
    const Arrays cpu = long_run<R>(0.0, beta_max, g_lo, 0.0, T, seed, dgps::Backend::cpu, true);
    const double first = max_abs_range(ref.at("o"), V, 0, T / 4), last = max_abs_range(ref.at("o"), V, 3 * T / 4, T);
    INFO(label << " g in [" << g_lo << ", 0]: max|o| first quarter " << first << ", last quarter " << last
               << ", max|hT| " << max_abs(ref.at("hT")) << ", cpu err " << rel_err(cpu.at("o"), ref.at("o")));
    CHECK(all_finite(ref.at("o")));
    CHECK(all_finite(cpu.at("o")));
    // |v| < ~5 (normal): a contraction keeps the state of the order of the values, no growth.
    CHECK(max_abs(ref.at("hT")) < 50.0);
    CHECK(last < 2.0 * first + 1.0);
    CHECK(rel_err(cpu.at("o"), ref.at("o")) < 1e-4);
    CHECK(rel_err(cpu.at("hT"), ref.at("hT")) < 1e-4);
  }
}

}  // namespace

TEST_CASE("identity 3.1: Mesa (Online+ExactATK) == ridge readout (Offline+ExactATQ) == direct ridge solve") {
  const dgps::Shape shape{.batch = 2, .time = 12, .heads = 2, .v_heads = 2, .key_dim = 5, .value_dim = 3};
  Gen gen;
  gen.h0 = gen.a0 = gen.final_grads = false;
  Case c = random_case(dgps::spec_of<dgps::MesaLayer>(), shape, {}, 7, gen);
  for (auto& x : c.arr["g_p"]) x = 0.0;
  for (auto& x : c.arr["beta_p"]) x = 1.0;
  const double lambda = 0.7;
  dgps::Options opt = on(dgps::Backend::reference);
  opt.l2norm_qk = false;
  opt.scale = 1.0;
  opt.lambda = lambda;
  const auto direct = ridge_direct(c, lambda);
  const Arrays mesa = run_forward<double, dgps::MesaLayer>(c, opt);
  Case cr = c;
  cr.spec = dgps::spec_of<dgps::RidgeReadout>();
  const Arrays ridge = run_forward<double, dgps::RidgeReadout>(cr, opt);
  INFO("|mesa-direct|/|direct| = " << rel_err(mesa.at("o"), direct) << ", |ridge-direct|/|direct| = "
                                   << rel_err(ridge.at("o"), direct) << ", max|direct| = " << max_abs(direct));
  CHECK(max_abs(direct) > 0.1);
  CHECK(rel_err(mesa.at("o"), direct) < 1e-9);
  CHECK(rel_err(ridge.at("o"), direct) < 1e-9);
  CHECK(rel_err(mesa.at("aT"), ridge.at("aT")) < 1e-12);  // the same P_T
  // The CPU backend: float64 inputs within 1e-9, float32 within 1e-4 (same metric).
  dgps::Options cpu = opt;
  cpu.backend = dgps::Backend::cpu;
  CHECK(rel_err(run_forward<double, dgps::MesaLayer>(c, cpu).at("o"), direct) < 1e-9);
  CHECK(rel_err(run_forward<double, dgps::RidgeReadout>(cr, cpu).at("o"), direct) < 1e-9);
  CHECK(rel_err(run_forward<float, dgps::MesaLayer>(c, cpu).at("o"), direct) < 1e-4);
  CHECK(rel_err(run_forward<float, dgps::RidgeReadout>(cr, cpu).at("o"), direct) < 1e-4);
}

TEST_CASE("identity 3.2: squash worked example, directly and through a PDN forward") {
  const dgps::precond::Constants<double> cst{std::log(1.5), 0.0, 1.0};
  const double m0 = dgps::precond::squash(16.0, std::log(4.0), cst);
  const double m1 = dgps::precond::squash(1.0, std::log(4.0), cst);
  CHECK(std::fabs(m0 - 0.7901) < 5e-5);
  CHECK(std::fabs(m1 - 1.2656) < 5e-5);
  CHECK(std::fabs(m0 * m1 - 1.0) < 1e-15);  // r = +-log 4 gives reciprocal scales
  // Zero statistics with eps = 0: log(0) is guarded, M = x (the largest scale), not NaN.
  CHECK(dgps::precond::squash(0.0, std::log(4.0), cst) == doctest::Approx(1.5).epsilon(1e-15));

  // PDN, K = 2, two key heads reading one component each: a0 = (12, 0) and one token k = (2, 1)
  // with g_p = 0, beta_p = 1 give A = (16, 1). With v = 1, beta = 1 and S0 = 0 the output is
  // o = kw . q = k[c] M[c] for q = e_c.
  const dgps::Shape shape{.batch = 1, .time = 1, .heads = 2, .v_heads = 2, .key_dim = 2, .value_dim = 1};
  const std::vector<double> q{1, 0, 0, 1}, k{2, 1, 2, 1}, v{1, 1}, beta{1, 1}, g_p{0, 0}, beta_p{1, 1};
  const std::vector<double> center{std::log(4.0), std::log(4.0)}, a0{12, 0, 12, 0};
  std::vector<double> o(2, NAN), aT(4, NAN);
  dgps::Options opt = on(dgps::Backend::reference);
  opt.l2norm_qk = false;
  opt.scale = 1.0;
  opt.x = 1.5;
  opt.eps = 0.0;
  auto in = dgps::inputs<double>(shape, q.data(), k.data(), v.data())
                .gain(beta.data())
                .precond(g_p.data(), beta_p.data(), center.data())
                .initial_state(nullptr, a0.data());
  dgps::forward<dgps::PDN>(in, dgps::outputs<double>(o.data()).final_state(nullptr, aT.data()), opt);
  CHECK(aT == std::vector<double>{16, 1, 16, 1});
  CHECK(std::fabs(o[0] / 2.0 - m0) < 1e-15);
  CHECK(std::fabs(o[1] / 1.0 - m1) < 1e-15);
  CHECK(std::fabs(o[0] / 2.0 - 0.7901) < 5e-5);
  CHECK(std::fabs(o[1] - 1.2656) < 5e-5);
}

TEST_CASE("identity 3.3: DiagonalATK / DiagonalATQ with x = 1 equal Identity exactly (reference, bitwise)") {
  check_reduction<dgps::PDN, dgps::DeltaNet>("pdn/dn", 11);
  check_reduction<dgps::PGDN, dgps::GDN>("pgdn/gdn", 12);
  check_reduction<dgps::PKDA, dgps::KDA>("pkda/kda", 13);
  check_reduction<dgps::PMamba2, dgps::Mamba2>("pmamba2/mamba2", 14);
}

TEST_CASE("identity 3.7: unit keys and beta * x <= 2 keep 20000-token runs bounded (GDN, PGDN, PKDA)") {
  check_bounded<dgps::GDN>("gdn beta in [0, 2]", 2.0, 21);
  check_bounded<dgps::PGDN>("pgdn beta in [0, 2/1.5]", 2.0 / 1.5, 22);
  check_bounded<dgps::PKDA>("pkda beta in [0, 2/1.5]", 2.0 / 1.5, 23);
  // Sensitivity of the check: beta in [2.5, 2.7] (outside the bound) does blow up.
  const Arrays bad = long_run<dgps::GDN>(2.5, 2.7, 0.0, 0.0, 2000, 24, dgps::Backend::reference, false);
  INFO("beta in [2.5, 2.7]: max|hT| " << max_abs(bad.at("hT")));
  CHECK(!(max_abs(bad.at("hT")) < 1e6));
}

TEST_CASE("edge inputs: g = -50, g = 0, zero keys, zero-length sequences: finite and equal to the reference") {
  // Every named model; cpu float32 vs reference float64: forward 1e-4, gradients 1e-3
  // (max|diff| / max|ref| per tensor).
  const dgps::Shape shape{.batch = 1, .time = 24, .heads = 2, .v_heads = 4, .key_dim = 8, .value_dim = 4};
  const std::vector<int64_t> cu{0, 0, 7, 7, 24, 24};
  struct Variant {
    const char* name;
    double g, g_p, eps;
    std::vector<int64_t> zero_keys;
  };
  const Variant variants[] = {
      {"g = -50", -50.0, -50.0, 1e-6, {}},
      {"g = 0", 0.0, 0.0, 1e-6, {}},
      {"zero keys, eps = 0", -0.1, -0.1, 0.0, {0, 1, 2, 7, 8, 20}},
  };
  uint64_t seed = 300;
  for (const auto& var : variants)
    for (const auto& kv : dgps::kNamedModels) {
      const auto& name = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
      const auto& spec = kv.second;
      Gen gen;
      gen.g_lo = gen.g_hi = var.g;
      // Exact preconditioners: g_p = -50 makes the Gram matrix singular (not a valid input there).
      gen.gp_lo = gen.gp_hi = is_exact(spec) ? -0.1 : var.g_p;
      gen.zero_key_tokens = var.zero_keys;
      gen.a0 = var.zero_keys.empty();  // zero statistics exercise log(0 + eps) with eps = 0
      const Case c = random_case(spec, shape, cu, seed++, gen);
      dgps::Options ref = on(dgps::Backend::reference), cpu = on(dgps::Backend::cpu);
      ref.eps = cpu.eps = var.eps;
      ref.chunk_size = cpu.chunk_size = 4;
      const Arrays fr = run_forward<double>(c, ref), fc = run_forward<float>(c, cpu);
      const Arrays gr = run_backward<double>(c, ref), gc = run_backward<float>(c, cpu);
      for (const auto& kv : fr) {
        const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
        const auto& v = kv.second;
        INFO(var.name << " " << name << " " << n << " err " << rel_err(fc.at(n), v));
        CHECK(all_finite(v));
        CHECK(rel_err(fc.at(n), v) < 1e-4);
      }
      for (const auto& kv : gr) {
        const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
        const auto& v = kv.second;
        INFO(var.name << " " << name << " " << n << " err " << rel_err(gc.at(n), v));
        CHECK(all_finite(v));
        CHECK(rel_err(gc.at(n), v) < 1e-3);
      }
      // Zero-length sequences keep their initial state: hT = h0 for sequences 0, 2 and 4.
      const int64_t HKV = 4 * 8 * 4;
      for (int64_t n : {0, 2, 4}) {
        bool same = true;
        for (int64_t i = 0; i < HKV; ++i)
          same =
              same && fr.at("hT")[static_cast<size_t>(n * HKV + i)] == c.arr.at("h0")[static_cast<size_t>(n * HKV + i)];
        CHECK(same);
      }
    }
}
