/// @brief Random problems (seeds, shapes and layouts unlike the conformance data): CPU float32 vs the float64
/// reference.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

// Metric for every tensor: max|cpu - ref| / max|ref|. SPEC §5: forward < 1e-4 for float32 at
// T <= 4096; gradients (longer chains of float32 rounding) < 1e-3.
constexpr double kTolForward = 1e-4;
constexpr double kTolGrad = 1e-3;

/// Base seed: DGPS_TEST_SEED when set (to try fresh seeds), else a fixed value.
uint64_t base_seed() {
  const char* s = std::getenv("DGPS_TEST_SEED");
  return s && *s ? std::strtoull(s, nullptr, 10) : 20261130;
}

/// Input ranges for `spec`: the exact preconditioners forget slowly (g_p in [-0.05, 0]). With fast
/// forgetting (g_p ~ -0.4 per token) the inverse Gram P grows as exp(-sum g_p) along directions
/// that few keys excite, and float32 Sherman-Morrison then drifts past 1e-4 on some seeds.
Gen ranges_for(const dgps::ModelSpec& spec, Gen gen) {
  if (is_exact(spec)) {
    gen.gp_lo = -0.05;
    gen.gp_hi = 0.0;
  }
  return gen;
}

void compare(const std::string& label, const Case& c, bool grads) {
  dgps::Options ref = on(dgps::Backend::reference), cpu = on(dgps::Backend::cpu, 0);
  const Arrays fr = run_forward<double>(c, ref), fc = run_forward<float>(c, cpu);
  for (const auto& kv : fr) {
    const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& v = kv.second;
    INFO(label << " " << n << ": err " << rel_err(fc.at(n), v) << " (max|ref| " << max_abs(v) << ")");
    CHECK(max_abs(v) > 0);
    CHECK(rel_err(fc.at(n), v) < kTolForward);
  }
  if (!grads) return;
  const Arrays gr = run_backward<double>(c, ref), gc = run_backward<float>(c, cpu);
  for (const auto& kv : gr) {
    const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& v = kv.second;
    INFO(label << " " << n << ": err " << rel_err(gc.at(n), v) << " (max|ref| " << max_abs(v) << ")");
    CHECK(rel_err(gc.at(n), v) < kTolGrad);
  }
}

}  // namespace

TEST_CASE("random: every named model, varlen with an empty sequence, GVA, zero keys") {
  const uint64_t seed = base_seed();
  INFO("seed " << seed);
  const std::vector<int64_t> cu{0, 5, 5, 40, 97};
  const dgps::Shape shape{.batch = 1, .time = 97, .heads = 2, .v_heads = 4, .key_dim = 16, .value_dim = 12};
  Gen gen;
  gen.zero_key_tokens = {0, 6, 7, 50};
  uint64_t s = seed;
  for (const auto& [name, spec] : dgps::kNamedModels)
    compare(std::string(name), random_case(spec, shape, cu, s++, ranges_for(spec, gen)), true);
}

TEST_CASE("random: batched fixed-length, no initial states, beta in [0, 2]") {
  const uint64_t seed = base_seed() + 100;
  INFO("seed " << seed);
  const dgps::Shape shape{.batch = 3, .time = 33, .heads = 1, .v_heads = 2, .key_dim = 12, .value_dim = 20};
  Gen gen;
  gen.h0 = gen.a0 = gen.final_grads = false;
  gen.beta_lo = 0.0;
  gen.beta_hi = 2.0 / 1.5;
  uint64_t s = seed;
  for (const auto& [name, spec] : dgps::kNamedModels)
    compare(std::string(name), random_case(spec, shape, {}, s++, ranges_for(spec, gen)), true);
}

TEST_CASE("random: K = V = 128, GVA + varlen (PGDN, KDA, Mesa layer)") {
  const uint64_t seed = base_seed() + 200;
  INFO("seed " << seed);
  const std::vector<int64_t> cu{0, 70, 70, 160};
  const dgps::Shape shape{.batch = 1, .time = 160, .heads = 1, .v_heads = 2, .key_dim = 128, .value_dim = 128};
  Gen gen;
  gen.zero_key_tokens = {3, 100};
  compare("pgdn K=V=128", random_case(dgps::spec_of<dgps::PGDN>(), shape, cu, seed, gen), true);
  compare("kda K=V=128", random_case(dgps::spec_of<dgps::KDA>(), shape, cu, seed + 1, gen), true);
  // K = 128 exceeds the number of tokens: most directions are never excited, so forget slowly.
  gen.gp_lo = -0.01;
  gen.gp_hi = 0.0;
  compare("mesa K=V=128", random_case(dgps::spec_of<dgps::MesaLayer>(), shape, cu, seed + 2, gen), true);
}

TEST_CASE("random: long sequence T = 4096 (PGDN, K = V = 64)") {
  const uint64_t seed = base_seed() + 300;
  INFO("seed " << seed);
  const dgps::Shape shape{.batch = 1, .time = 4096, .heads = 1, .v_heads = 1, .key_dim = 64, .value_dim = 64};
  Gen gen;
  gen.g_lo = -0.05;
  gen.g_hi = 0.0;
  compare("pgdn T=4096", random_case(dgps::spec_of<dgps::PGDN>(), shape, {}, seed, gen), true);
}

namespace {

/// SPEC §2 written out independently of the library (float64, one (sequence, value head) at a
/// time): returns o, hT and (when the model has one) aT of case `c` under options `opt`.
Arrays spec_forward(const Case& c, const dgps::Options& opt) {
  using dgps::ModelSpec;
  const ModelSpec& m = c.spec;
  const int64_t B = c.shape.batch, T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim,
                V = c.shape.value_dim, N = c.N, r = HV / H;
  const bool exact = is_exact(m), diag = is_diagonal_precond(m);
  const bool key_target = m.precond == dgps::precond::Kind::diagonal_atk || m.precond == dgps::precond::Kind::exact_atk;
  const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(double(K));
  const int64_t ps = exact ? K * K : K;
  Arrays out;
  out["o"].assign(static_cast<size_t>(B * T * HV * V), 0.0);
  out["hT"].assign(static_cast<size_t>(N * HV * K * V), 0.0);
  if (has_precond_state(m)) out["aT"].assign(static_cast<size_t>(N * H * ps), 0.0);
  auto at = [&](const char* n, int64_t i) { return c.arr.at(n)[static_cast<size_t>(i)]; };
  auto normed = [&](const char* n, int64_t row, double mul) {
    std::vector<double> x(static_cast<size_t>(K));
    double ss = 0;
    for (int64_t i = 0; i < K; ++i) ss += at(n, row * K + i) * at(n, row * K + i);
    const double rs = opt.l2norm_qk ? 1.0 / std::sqrt(ss + 1e-6) : 1.0;
    for (int64_t i = 0; i < K; ++i) x[i] = at(n, row * K + i) * rs * mul;
    return x;
  };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / r, b = c.cu.empty() ? n : 0, t0 = c.cu.empty() ? 0 : c.cu[n],
                    L = c.cu.empty() ? T : c.cu[n + 1] - c.cu[n];
      std::vector<double> S(static_cast<size_t>(K * V), 0.0), A(static_cast<size_t>(ps), 0.0);
      if (c.has("h0"))
        for (int64_t i = 0; i < K * V; ++i) S[i] = at("h0", (n * HV + hv) * K * V + i);
      if (exact && !c.has("a0"))
        for (int64_t i = 0; i < K; ++i) A[i * K + i] = 1.0 / opt.lambda;
      if (has_precond_state(m) && c.has("a0"))
        for (int64_t i = 0; i < ps; ++i) A[i] = at("a0", (n * H + h) * ps + i);
      for (int64_t t = t0; t < t0 + L; ++t) {
        const int64_t row = b * T + t;
        std::vector<double> q = normed("q", row * H + h, scale), k = normed("k", row * H + h, 1.0);
        std::vector<double> kw = k, qr = q;
        if (diag) {
          const double a = std::exp(at("g_p", row * H + h)), bp = at("beta_p", row * H + h);
          for (int64_t i = 0; i < K; ++i) {
            A[i] = a * A[i] + bp * k[i] * k[i];
            // log(0) = -inf: the squash's limit s = -1, M = x (SPEC §5 guard).
            const double rr = std::log(A[i] + opt.eps) - at("center", h);
            const double sq = A[i] + opt.eps > 0 ? rr / (1 + std::fabs(rr)) : -1.0;
            const double M = std::exp(-std::log(opt.x) * sq);
            (key_target ? kw : qr)[i] *= M;
          }
        } else if (exact) {
          const double a = std::exp(at("g_p", row * H + h)), bp = at("beta_p", row * H + h);
          std::vector<double> y(static_cast<size_t>(K), 0.0), z(static_cast<size_t>(K), 0.0);
          double kPk = 0;
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) {
              y[i] += A[i * K + j] * k[j];
              z[i] += A[j * K + i] * k[j];
            }
          for (int64_t i = 0; i < K; ++i) kPk += k[i] * y[i];
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) A[i * K + j] = (A[i * K + j] - bp * y[i] * z[j] / (a + bp * kPk)) / a;
          std::vector<double>& tgt = key_target ? kw : qr;
          const std::vector<double> src = tgt;
          for (int64_t i = 0; i < K; ++i) {
            double s = 0;
            for (int64_t j = 0; j < K; ++j) s += A[i * K + j] * src[j];
            tgt[i] = s;
          }
        }
        for (int64_t i = 0; i < K; ++i) {
          double f = 1.0;
          if (m.decay == dgps::decay::Kind::scalar) f = std::exp(at("g", row * HV + hv));
          if (m.decay == dgps::decay::Kind::diagonal) f = std::exp(at("g", (row * HV + hv) * K + i));
          for (int64_t e = 0; e < V; ++e) S[i * V + e] *= f;
        }
        const double gain = m.gain == dgps::gain::Kind::scalar ? at("beta", row * HV + hv) : 1.0;
        std::vector<double> u(static_cast<size_t>(V));
        for (int64_t e = 0; e < V; ++e) {
          u[e] = at("v", (row * HV + hv) * V + e);
          if (m.solve == dgps::solve::Kind::online)
            for (int64_t i = 0; i < K; ++i) u[e] -= S[i * V + e] * k[i];
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t e = 0; e < V; ++e) S[i * V + e] += gain * kw[i] * u[e];
        for (int64_t e = 0; e < V; ++e) {
          double s = 0;
          for (int64_t i = 0; i < K; ++i) s += S[i * V + e] * qr[i];
          out["o"][static_cast<size_t>((row * HV + hv) * V + e)] = s;
        }
      }
      for (int64_t i = 0; i < K * V; ++i) out["hT"][static_cast<size_t>((n * HV + hv) * K * V + i)] = S[i];
      if (has_precond_state(m) && hv % r == 0)
        for (int64_t i = 0; i < ps; ++i) out["aT"][static_cast<size_t>((n * H + h) * ps + i)] = A[i];
    }
  return out;
}

}  // namespace

TEST_CASE("random: all 60 policy combinations vs an independent SPEC §2 implementation (float64)") {
  // Reference backend (float64) within 1e-12, CPU float32 within 1e-4 (max|diff| / max|spec|).
  const uint64_t seed = base_seed() + 400;
  INFO("seed " << seed);
  const std::vector<int64_t> cu{0, 9, 9, 40};
  const dgps::Shape shape{.batch = 1, .time = 40, .heads = 2, .v_heads = 4, .key_dim = 8, .value_dim = 6};
  dgps::Options alt;
  alt.scale = 0.7;
  alt.x = 2.5;
  alt.eps = 0.0;
  alt.lambda = 0.5;
  namespace dk = dgps::decay;
  namespace gk = dgps::gain;
  namespace pk = dgps::precond;
  namespace sk = dgps::solve;
  uint64_t s = seed;
  int combos = 0;
  for (auto d : {dk::Kind::none, dk::Kind::scalar, dk::Kind::diagonal})
    for (auto g : {gk::Kind::unit, gk::Kind::scalar})
      for (auto p : {pk::Kind::identity, pk::Kind::diagonal_atk, pk::Kind::diagonal_atq, pk::Kind::exact_atk,
                     pk::Kind::exact_atq})
        for (auto sv : {sk::Kind::online, sk::Kind::offline}) {
          const dgps::ModelSpec spec{d, g, p, sv};
          Gen gen;
          gen.zero_key_tokens = {0, 10};
          gen.a0 = (combos % 2) == 0;  // half the combinations start from the default A = 0 / P = I / lambda
          const Case c = random_case(spec, shape, cu, s++, ranges_for(spec, gen));
          for (const dgps::Options& base : {dgps::Options{}, alt}) {
            dgps::Options ref = base, cpu = base;
            ref.backend = dgps::Backend::reference;
            cpu.backend = dgps::Backend::cpu;
            const Arrays want = spec_forward(c, base);
            const Arrays fr = run_forward<double>(c, ref), fc = run_forward<float>(c, cpu);
            for (const auto& kv : want) {
              const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
              const auto& v = kv.second;
              INFO(dgps::to_string(spec) << " x = " << base.x << " " << n << ": reference err " << rel_err(fr.at(n), v)
                                         << ", cpu err " << rel_err(fc.at(n), v));
              CHECK(max_abs(v) > 0);
              CHECK(rel_err(fr.at(n), v) < 1e-12);
              CHECK(rel_err(fc.at(n), v) < kTolForward);
            }
          }
          ++combos;
        }
  CHECK(combos == 60);
}
