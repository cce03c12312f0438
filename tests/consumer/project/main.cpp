/// @brief Consumer of the installed dgps: PGDN on the automatic backend vs the reference, and GDN via dgps::dynamic
/// (when DGPS_CONSUMER_DYNAMIC is 1: an install with dgps::dynamic).
#include <dgps/dgps.hpp>
#ifndef DGPS_CONSUMER_DYNAMIC
#define DGPS_CONSUMER_DYNAMIC 1
#endif
#if DGPS_CONSUMER_DYNAMIC
#include <dgps/dynamic.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

/// max|a - b| / max|b|
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

bool finite(const std::vector<float>& a) {
  return std::all_of(a.begin(), a.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

int main() {
  const dgps::Shape shape{.batch = 2, .time = 37, .heads = 2, .v_heads = 4, .key_dim = 16, .value_dim = 8};
  const int64_t B = shape.batch, T = shape.time, H = shape.heads, HV = shape.v_heads;
  const int64_t K = shape.key_dim, V = shape.value_dim;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  auto fill = [&](int64_t n, auto gen) {
    std::vector<float> x(n);
    for (auto& e : x) e = gen();
    return x;
  };
  const auto q = fill(B * T * H * K, [&] { return normal(rng); });
  const auto k = fill(B * T * H * K, [&] { return normal(rng); });
  const auto v = fill(B * T * HV * V, [&] { return normal(rng); });
  const auto g = fill(B * T * HV, [&] { return -0.5f * unit(rng); });
  const auto beta = fill(B * T * HV, [&] { return unit(rng); });
  const auto g_p = fill(B * T * H, [&] { return -0.1f * unit(rng); });
  const auto beta_p = fill(B * T * H, [&] { return unit(rng); });
  const std::vector<float> center(H, -0.2f);

  const auto in = dgps::inputs<float>(shape, q.data(), k.data(), v.data())
                      .decay(g.data())
                      .gain(beta.data())
                      .precond(g_p.data(), beta_p.data(), center.data());
  auto run = [&](auto&& call) {
    std::vector<float> o(B * T * HV * V, NAN);
    call(dgps::outputs<float>(o.data()));
    return o;
  };

  int failures = 0;
  auto check = [&](const char* what, const std::vector<float>& got, const std::vector<float>& ref) {
    const double d = rel_diff(got, ref);
    const bool ok = finite(got) && d < 1e-4;
    std::printf("%-42s max rel diff %.3g %s\n", what, d, ok ? "ok" : "FAILED");
    failures += !ok;
  };

  try {
    dgps::RunInfo info;
    const auto o_pgdn = run([&](const auto& out) { info = dgps::forward<dgps::PGDN>(in, out); });
    const auto o_pgdn_ref = run([&](const auto& out) {
      dgps::forward<dgps::PGDN>(in, out, {.backend = dgps::Backend::reference});
    });
    std::printf("dgps %s, PGDN ran on %s\n", dgps::version_string, info.impl.c_str());
    check("dgps::forward<PGDN> vs reference", o_pgdn, o_pgdn_ref);
#if DGPS_CONSUMER_DYNAMIC

    const dgps::ModelSpec gdn = dgps::model_by_name("gdn");
    const auto in_gdn = dgps::inputs<float>(shape, q.data(), k.data(), v.data()).decay(g.data()).gain(beta.data());
    const auto o_gdn = run([&](const auto& out) { info = dgps::dynamic::forward(gdn, in_gdn, out); });
    const auto o_gdn_ref = run([&](const auto& out) {
      dgps::forward<dgps::GDN>(in_gdn, out, {.backend = dgps::Backend::reference});
    });
    std::printf("GDN through dgps::dynamic ran on %s\n", info.impl.c_str());
    check("dgps::dynamic::forward(gdn) vs reference", o_gdn, o_gdn_ref);
#endif
    // A bad call throws dgps::Error across the library boundary (a shared build exports its type).
    bool threw = false;
    try {
      dgps::forward<dgps::PGDN>(dgps::inputs<float>(shape, q.data(), nullptr, v.data()), dgps::outputs<float>(nullptr));
    } catch (const dgps::Error&) {
      threw = true;
    }
    std::printf("%-42s %s\n", "a bad call throws dgps::Error", threw ? "ok" : "FAILED");
    failures += !threw;
  } catch (const dgps::Error& e) {
    std::fprintf(stderr, "dgps error: %s\n", e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
