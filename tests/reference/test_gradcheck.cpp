/// @brief SPEC §3.8: backward == central finite differences of the float64 reference forward, every input.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

using dgps::ModelSpec;
namespace dk = dgps::decay;
namespace gk = dgps::gain;
namespace pk = dgps::precond;
namespace sk = dgps::solve;

// Central differences with step h on a loss of order 10: truncation ~h^2 and rounding ~1e-16/h
// both stay below 1e-8 of the largest gradient entry, far under the 1e-6 tolerance.
constexpr double kStep = 1e-5;
// Metric for every tensor: max|analytic - fd| / max|fd|.
constexpr double kTolFd = 1e-6;
// CPU backend (double inputs) against the reference backend's gradients: same metric.
constexpr double kTolCpu = 1e-9;

const char* const kInputs[] = {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0"};

double loss(const Case& c) {
  dgps::Options opt = on(dgps::Backend::reference);
  opt.chunk_size = 4;
  return loss_of(c, run_forward<double>(c, opt));
}

/// Finite-difference gradient of the loss w.r.t. input `name`. For the exact preconditioners'
/// a0 the perturbation is symmetric ((i,j) and (j,i) together): the result is then the symmetric
/// part of the gradient (off-diagonal derivative divided by two).
std::vector<double> fd_grad(const Case& c, const std::string& name) {
  const auto& base = c.arr.at(name);
  std::vector<double> out(base.size(), 0.0);
  const bool sym = name == "a0" && is_exact(c.spec);
  const int64_t K = c.shape.key_dim;
  Case w = c;
  auto& x = w.arr.at(name);
  for (size_t i = 0; i < base.size(); ++i) {
    size_t j = i;
    if (sym) {
      const size_t m = i / size_t(K * K), r = (i / size_t(K)) % size_t(K), col = i % size_t(K);
      j = m * size_t(K * K) + col * size_t(K) + r;
      if (j < i) {  // already computed from the transposed entry
        out[i] = out[j];
        continue;
      }
    }
    x[i] = base[i] + kStep;
    if (j != i) x[j] = base[j] + kStep;
    const double lp = loss(w);
    x[i] = base[i] - kStep;
    if (j != i) x[j] = base[j] - kStep;
    const double lm = loss(w);
    x[i] = base[i];
    x[j] = base[j];
    out[i] = (lp - lm) / (2 * kStep) / (j != i ? 2.0 : 1.0);
  }
  return out;
}

/// max|a - b| / max|b|.
double rel(const std::vector<double>& a, const std::vector<double>& b) { return rel_err(a, b); }

void check_model(const std::string& label, const ModelSpec& spec, const dgps::Shape& shape,
                 const std::vector<int64_t>& cu, uint64_t seed) {
  const Case c = random_case(spec, shape, cu, seed);
  dgps::Options ref = on(dgps::Backend::reference), cpu = on(dgps::Backend::cpu);
  ref.chunk_size = cpu.chunk_size = 4;  // several checkpoints per sequence in backward
  const Arrays an = run_backward<double>(c, ref);
  const Arrays ac = run_backward<double>(c, cpu);
  int checked = 0;
  for (const char* name : kInputs) {
    if (!c.has(name)) continue;
    const std::string dn = std::string("d") + name;
    REQUIRE(an.count(dn));
    const std::vector<double> fd = fd_grad(c, name);
    const bool sym = std::string(name) == "a0" && is_exact(spec);
    const auto& a_ref = sym ? symmetrise(an.at(dn), shape.key_dim) : an.at(dn);
    const auto& a_cpu = sym ? symmetrise(ac.at(dn), shape.key_dim) : ac.at(dn);
    const double e_ref = rel(a_ref, fd), e_cpu = rel(a_cpu, fd), e_cr = rel(a_cpu, a_ref);
    INFO(label << " d" << name << ": |ref-fd|/|fd| = " << e_ref << ", |cpu-fd|/|fd| = " << e_cpu
               << ", |cpu-ref|/|ref| = " << e_cr << ", max|fd| = " << max_abs(fd));
    CHECK(max_abs(fd) > 0);  // every input influences the loss
    CHECK(e_ref < kTolFd);
    CHECK(e_cpu < kTolFd);
    CHECK(e_cr < kTolCpu);
    ++checked;
  }
  CHECK(checked >= 4);
}

struct Named {
  const char* name;
  ModelSpec spec;
};

}  // namespace

TEST_CASE("gradcheck: every named model, every input, GVA (H=1, HV=2), reference and cpu vs finite differences") {
  const dgps::Shape shape{.batch = 2, .time = 9, .heads = 1, .v_heads = 2, .key_dim = 4, .value_dim = 3};
  uint64_t seed = 1000;
  for (const auto& [name, spec] : dgps::kNamedModels) check_model(std::string(name), spec, shape, {}, seed++);
}

TEST_CASE("gradcheck: custom combinations") {
  const dgps::Shape shape{.batch = 2, .time = 9, .heads = 1, .v_heads = 2, .key_dim = 4, .value_dim = 3};
  const Named customs[] = {
      {"diagonal/scalar/exact-atk/offline",
       {dk::Kind::diagonal, gk::Kind::scalar, pk::Kind::exact_atk, sk::Kind::offline}},
      {"none/scalar/diag-atq/online", {dk::Kind::none, gk::Kind::scalar, pk::Kind::diagonal_atq, sk::Kind::online}},
  };
  for (const auto& m : customs) check_model(m.name, m.spec, shape, {}, 77);
}

TEST_CASE("gradcheck: varlen with a zero-length sequence and two key heads (PGDN, PKDA)") {
  const dgps::Shape shape{.batch = 1, .time = 9, .heads = 2, .v_heads = 4, .key_dim = 4, .value_dim = 3};
  check_model("pgdn varlen", dgps::spec_of<dgps::PGDN>(), shape, {0, 3, 3, 9}, 2024);
  check_model("pkda varlen", dgps::spec_of<dgps::PKDA>(), shape, {0, 5, 9}, 2025);
}

TEST_CASE("gradcheck: exact preconditioner without a0 uses P0 = I / lambda, also in backward") {
  // Mesa layer with lambda = 0.7: a run without a0 must equal a run with a0 = I / 0.7 (forward
  // and every gradient, da0 included), and its gradients must match finite differences there.
  const dgps::Shape shape{.batch = 1, .time = 7, .heads = 1, .v_heads = 1, .key_dim = 3, .value_dim = 2};
  Gen gen;
  gen.a0 = false;
  const Case c = random_case(dgps::spec_of<dgps::MesaLayer>(), shape, {}, 31, gen);
  Case e = c;
  std::vector<double> a0(9, 0.0);
  for (int i = 0; i < 3; ++i) a0[i * 3 + i] = 1.0 / 0.7;
  e.arr["a0"] = a0;
  e.shapes["a0"] = {1, 1, 3, 3};
  dgps::Options opt = on(dgps::Backend::reference);
  opt.lambda = 0.7;
  const Arrays fc = run_forward<double, dgps::MesaLayer>(c, opt), fe = run_forward<double, dgps::MesaLayer>(e, opt);
  for (const char* n : {"o", "hT", "aT"}) {
    INFO(n << " err " << rel_err(fc.at(n), fe.at(n)));
    CHECK(rel_err(fc.at(n), fe.at(n)) < 1e-14);
  }
  const Arrays gc = run_backward<double, dgps::MesaLayer>(c, opt), ge = run_backward<double, dgps::MesaLayer>(e, opt);
  for (const auto& kv : gc) {
    const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& v = kv.second;
    INFO(n << " err " << rel_err(v, ge.at(n)));
    CHECK(rel_err(v, ge.at(n)) < 1e-13);
  }
  // fd_grad runs the forward with default lambda = 1, irrelevant here since a0 is given.
  const auto fd = fd_grad(e, "a0");
  INFO("da0 sym err " << rel_err(symmetrise(gc.at("da0"), 3), fd));
  CHECK(rel_err(symmetrise(gc.at("da0"), 3), fd) < kTolFd);
}
