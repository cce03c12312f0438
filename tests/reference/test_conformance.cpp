/// @brief Every conformance case (tests/data) on every backend: forward outputs and all gradients.
#include <doctest/doctest.h>

#include <dgps/dynamic.hpp>

#include "support.hpp"

using namespace dgps_test;

namespace {

struct Result {
  std::map<std::string, double> err;
};

template <class T>
Result run_case(const Case& c, dgps::Backend backend, int threads,
                dgps::Algorithm algorithm = dgps::Algorithm::automatic) {
  using S = dgps::state_t<T>;
  CaseTensors<T> ct(c);
  const int64_t B = c.shape.batch, Tn = c.shape.time, HV = c.shape.v_heads, V = c.shape.value_dim;
  const int64_t K = c.shape.key_dim;
  std::vector<T> o(B * Tn * HV * V, T(NAN));
  std::vector<S> hT(c.N * HV * K * V, S(NAN));
  std::vector<S> aT(c.has("aT") ? c.arr.at("aT").size() : 0, S(NAN));
  dgps::Options opt = c.opt;
  opt.backend = backend;
  opt.threads = threads;
  opt.algorithm = algorithm;
  opt.chunk_size = 16;  // several checkpoints per sequence in backward
  Result r;
  {
    auto in = ct.inputs(c);
    auto out = dgps::outputs<T>(o.data()).final_state(hT.data(), aT.empty() ? nullptr : aT.data());
    dgps::dynamic::forward(c.spec, in, out, opt);
    r.err["o"] = rel_err(o, c.arr.at("o"), c.denom.at("o"));
    r.err["hT"] = rel_err(hT, c.arr.at("hT"), c.denom.at("hT"));
    if (!aT.empty()) r.err["aT"] = rel_err(aT, c.arr.at("aT"), c.denom.at("aT"));

    std::map<std::string, std::vector<T>> gt;
    std::map<std::string, std::vector<S>> gs;
    dgps::Grads<T> g;
    auto want = [&](const char* name, dgps::TensorView<T>& dst) {
      const std::string n = std::string("d") + name;
      if (!c.has(n)) return;
      gt[n].assign(c.arr.at(n).size(), T(NAN));
      dst = dgps::TensorView<T>(gt[n].data(), {});
      dst.rank = dgps::detail::kImplicitRank;
    };
    want("q", g.dq); want("k", g.dk); want("v", g.dv); want("g", g.dg); want("beta", g.dbeta);
    want("g_p", g.dg_p); want("beta_p", g.dbeta_p); want("center", g.dcenter);
    for (const char* n : {"dh0", "da0"}) {
      if (!c.has(n)) continue;
      gs[n].assign(c.arr.at(n).size(), S(NAN));
      auto& dst = std::string(n) == "dh0" ? g.dh0 : g.da0;
      dst = dgps::Out<S>(gs[n].data()).view;
    }
    auto gi = dgps::grads_in<T>(ct.p("do"), ct.ps("dhT"), ct.ps("daT"));
    dgps::dynamic::backward(c.spec, in, gi, g, opt);
    for (auto& [n, v] : gt) r.err[n] = rel_err(v, c.arr.at(n), c.denom.at(n));
    for (auto& [n, v] : gs) {
      const bool exact = c.spec.precond == dgps::precond::Kind::exact_atk || c.spec.precond == dgps::precond::Kind::exact_atq;
      r.err[n] = rel_err(n == "da0" && exact ? symmetrise(v, K) : v, c.arr.at(n), c.denom.at(n));
    }
  }
  return r;
}

void check_all(const char* label, dgps::Backend backend, bool f32, double tol, int threads,
               dgps::Algorithm algorithm = dgps::Algorithm::automatic) {
  for (const auto& name : case_names()) {
    const Case c = load_case(name);
    const Result r =
        f32 ? run_case<float>(c, backend, threads, algorithm) : run_case<double>(c, backend, threads, algorithm);
    for (const auto& kv : r.err) {
      const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
      const auto& e = kv.second;
      INFO(label << " case " << name << " tensor " << n << " err " << e);
      CHECK(e < tol);
    }
  }
}

}  // namespace

// Metric (tests/data/README.md): max|x - gold| / denominator, the denominator from case.json.
TEST_CASE("conformance: reference backend, float64 inputs, within 1e-9") {
  check_all("reference/f64", dgps::Backend::reference, false, 1e-9, 1);
}
TEST_CASE("conformance: reference backend, float32 inputs, within 1e-4") {
  check_all("reference/f32", dgps::Backend::reference, true, 1e-4, 1);
}
TEST_CASE("conformance: cpu recurrent, float64, within 1e-9 (2 threads)") {
  check_all("cpu/f64", dgps::Backend::cpu, false, 1e-9, 2, dgps::Algorithm::recurrent);
}
TEST_CASE("conformance: cpu recurrent, float32, within 1e-4 (2 threads)") {
  check_all("cpu/f32", dgps::Backend::cpu, true, 1e-4, 2, dgps::Algorithm::recurrent);
}
TEST_CASE("conformance: cpu automatic (chunkwise where covered), float64 within 1e-9, float32 within 1e-4") {
  check_all("cpu/auto/f64", dgps::Backend::cpu, false, 1e-9, 2);
  check_all("cpu/auto/f32", dgps::Backend::cpu, true, 1e-4, 2);
}
