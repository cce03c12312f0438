/// @brief CPU chunkwise backward (SPEC §4, paper App. D) against the conformance gradients and the reference.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <dgps/cpu/kernels.hpp>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// CPU backend, chunkwise algorithm, chunk size `chunk`.
dgps::Options chunkwise(int64_t chunk, int threads = 2) {
  dgps::Options o = on(dgps::Backend::cpu, threads);
  o.algorithm = dgps::Algorithm::chunkwise;
  o.chunk_size = chunk;
  return o;
}

/// The reference backward (float64).
Arrays gold_grads(const Case& c) { return run_backward<double>(c, on(dgps::Backend::reference)); }

}  // namespace

// Metric of the conformance suite: max|x - gold| / denominator (case.json), per gradient.
TEST_CASE("cpu backward: every covered conformance case, chunk 16 and 64, every ISA, f32 1e-4 and f64 1e-9") {
  double worst32 = 0, worst64 = 0;
  for (const auto& name : case_names()) {
    const Case c = load_case(name);
    if (!dgps::cpu::kernels::chunkwise_covers(c.spec)) continue;
    for (const char* isa : kCpuIsas) {
      IsaCap cap(isa);
      for (int64_t chunk : {16, 64}) {
        dgps::Options o = chunkwise(chunk);
        with_case_options(c, o);
        const Arrays f = run_backward<float>(c, o);
        const Arrays d = run_backward<double>(c, o);
        int checked = 0;
        for (const auto& kv : f) {
          const auto& n = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
          const auto& v = kv.second;
          if (!c.has(n)) continue;
          ++checked;
          const double ef = rel_err(v, c.arr.at(n), c.denom.at(n)), ed = rel_err(d.at(n), c.arr.at(n), c.denom.at(n));
          worst32 = std::max(worst32, ef);
          worst64 = std::max(worst64, ed);
          INFO("case " << name << " isa " << isa << " chunk " << chunk << " gradient " << n << " f32 " << ef << " f64 "
                       << ed);
          CHECK(ef < 1e-4);
          CHECK(ed < 1e-9);
        }
        CHECK(checked >= 4);
      }
    }
  }
  MESSAGE("conformance gradients, worst relative error: f32 " << worst32 << ", f64 " << worst64);
}

TEST_CASE("cpu backward: RunInfo reports chunkwise; recurrent on request; exact preconditioners throw") {
  const Case c = random_case(dgps::model_by_name("pgdn"),
                             {.batch = 1, .time = 40, .heads = 2, .v_heads = 2, .key_dim = 16, .value_dim = 16}, {}, 3);
  CaseTensors<float> ct(c);
  std::vector<float> dq(c.arr.at("q").size());
  dgps::Grads<float> g;
  g.dq = tv<float>(dq, c.shapes.at("q"));
  auto in = ct.inputs(c);
  auto gi = dgps::grads_in<float>(ct.p("do"));
  dgps::Options opt = on(dgps::Backend::cpu);
  const dgps::RunInfo a = dgps::dynamic::backward(c.spec, in, gi, g, opt);
  CHECK(a.algorithm == dgps::Algorithm::chunkwise);
  CHECK(a.impl == std::string("cpu/chunkwise/") + dgps::cpu::kernels::isa_name());
  opt.algorithm = dgps::Algorithm::chunkwise;
  CHECK(dgps::dynamic::backward(c.spec, in, gi, g, opt).algorithm == dgps::Algorithm::chunkwise);
  opt.algorithm = dgps::Algorithm::recurrent;
  const dgps::RunInfo rr = dgps::dynamic::backward(c.spec, in, gi, g, opt);
  CHECK(rr.algorithm == dgps::Algorithm::recurrent);
  CHECK(rr.impl == "cpu/recurrent");
  const Case m = random_case(dgps::model_by_name("mesa"),
                             {.batch = 1, .time = 8, .heads = 1, .v_heads = 1, .key_dim = 8, .value_dim = 8}, {}, 4);
  CHECK_THROWS_AS(run_backward<float>(m, chunkwise(16)), dgps::Error);
  // Automatic on an uncovered model runs the recurrence.
  const Arrays rm = run_backward<double>(m, on(dgps::Backend::cpu));
  CHECK(all_finite(rm.at("dq")));
}

TEST_CASE("cpu backward: random small shapes, every covered combination, GVA, varlen, odd chunks, f64 1e-9") {
  struct Shape {
    int64_t B, T, H, HV, K, V, chunk;
    std::vector<int64_t> cu;
    bool h0, final_grads;
  };
  const Shape shapes[] = {
      {2, 37, 1, 2, 16, 8, 16, {}, true, true},
      {1, 70, 2, 4, 20, 12, 64, {0, 5, 5, 40, 70}, true, false},
      {1, 50, 1, 1, 8, 16, 20, {}, false, true},
      {1, 33, 2, 2, 16, 16, 7, {0, 0, 33}, false, false},
  };
  uint64_t seed = 500;
  for (const auto& sh : shapes)
    for (const auto& spec : covered_specs()) {
      Gen gen;
      gen.h0 = gen.a0 = sh.h0;
      gen.final_grads = sh.final_grads;
      const Case c = random_case(
          spec, {.batch = sh.B, .time = sh.T, .heads = sh.H, .v_heads = sh.HV, .key_dim = sh.K, .value_dim = sh.V},
          sh.cu, ++seed, gen);
      const Arrays ref = gold_grads(c);
      const Arrays d = run_backward<double>(c, chunkwise(sh.chunk));
      std::string which;
      const double e = worst(d, ref, &which);
      INFO(dgps::to_string(spec) << " T " << sh.T << " chunk " << sh.chunk << " worst " << which << " " << e);
      CHECK(e < 1e-9);
    }
}

TEST_CASE("cpu backward: random K=V=128, T ~ 1000, GVA and varlen, every covered combination, f32 1e-4") {
  double worst_seen = 0;
  uint64_t seed = 900;
  for (const auto& spec : covered_specs()) {
    const Case c =
        random_case(spec, {.batch = 1, .time = 1000, .heads = 1, .v_heads = 2, .key_dim = 128, .value_dim = 128},
                    {0, 300, 300, 1000}, ++seed);
    const Arrays ref = gold_grads(c);
    for (int64_t chunk : {64}) {
      const Arrays f = run_backward<float>(c, chunkwise(chunk));
      std::string which;
      const double e = worst(f, ref, &which);
      worst_seen = std::max(worst_seen, e);
      INFO(dgps::to_string(spec) << " chunk " << chunk << " worst " << which << " " << e);
      CHECK(e < 1e-4);
    }
  }
  MESSAGE("K=V=128 T=1000 GVA varlen f32, worst relative error " << worst_seen);
}

TEST_CASE("cpu backward: K=V=128 chunk 16, T not a multiple of the chunk, f32 1e-4 and f64 1e-9") {
  for (const char* model : {"pgdn", "pkda", "kda", "pmamba2"}) {
    const Case c =
        random_case(dgps::model_by_name(model),
                    {.batch = 2, .time = 203, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {}, 77);
    const Arrays ref = gold_grads(c);
    for (int64_t chunk : {16, 64}) {
      const Arrays f = run_backward<float>(c, chunkwise(chunk));
      const Arrays d = run_backward<double>(c, chunkwise(chunk));
      INFO(std::string(model) << " chunk " << chunk);
      CHECK(worst(f, ref) < 1e-4);
      CHECK(worst(d, ref) < 1e-9);
    }
  }
}

TEST_CASE("cpu backward: strong decay g = -50 and zero keys stay finite and exact") {
  for (const char* model : {"gdn", "kda", "pgdn", "pkda", "mamba2", "gla", "pmamba2"}) {
    const dgps::ModelSpec spec = dgps::model_by_name(model);
    Gen gen;
    gen.g_lo = -50;
    gen.g_hi = -50;
    gen.zero_key_tokens = {0, 3, 64, 65, 99};
    const Case c = random_case(
        spec, {.batch = 1, .time = 100, .heads = 2, .v_heads = 2, .key_dim = 32, .value_dim = 32}, {}, 7, gen);
    const Arrays ref = gold_grads(c);
    for (int64_t chunk : {16, 64}) {
      const Arrays f = run_backward<float>(c, chunkwise(chunk));
      const Arrays d = run_backward<double>(c, chunkwise(chunk));
      std::string wf, wd;
      const double ef = worst(f, ref, &wf), ed = worst(d, ref, &wd);
      INFO(std::string(model) << " chunk " << chunk << " f32 " << wf << " " << ef << " f64 " << wd << " " << ed);
      for (const auto& [n, v] : f) CHECK(all_finite(v));
      CHECK(ef < 1e-4);
      CHECK(ed < 1e-9);
    }
  }
}

TEST_CASE("cpu backward: only the requested gradients are written") {
  const Case c =
      random_case(dgps::model_by_name("pkda"),
                  {.batch = 1, .time = 30, .heads = 1, .v_heads = 2, .key_dim = 16, .value_dim = 16}, {}, 21);
  CaseTensors<double> ct(c);
  std::vector<double> dk(c.arr.at("k").size(), 0.0), dgp(c.arr.at("g_p").size(), 0.0);
  dgps::Grads<double> g;
  g.dk = tv<double>(dk, c.shapes.at("k"));
  g.dg_p = tv<double>(dgp, c.shapes.at("g_p"));
  auto in = ct.inputs(c);
  auto gi = dgps::grads_in<double>(ct.p("do"), ct.ps("dhT"), ct.ps("daT"));
  dgps::dynamic::backward(c.spec, in, gi, g, chunkwise(16));
  const Arrays ref = gold_grads(c);
  CHECK(rel_err(dk, ref.at("dk")) < 1e-9);
  CHECK(rel_err(dgp, ref.at("dg_p")) < 1e-9);
}

TEST_CASE("cpu backward: without the L2 norm, custom scale and scale 0, f64 1e-9 against the reference") {
  struct Opt {
    bool l2norm;
    double scale;
  };
  for (const Opt op : {Opt{false, 0.7}, Opt{true, 0.0}, Opt{true, 1.3}})
    for (const char* model : {"pgdn", "pmamba2", "kda", "dn", "la"}) {
      const Case c =
          random_case(dgps::model_by_name(model),
                      {.batch = 1, .time = 45, .heads = 2, .v_heads = 2, .key_dim = 16, .value_dim = 16}, {}, 31);
      dgps::Options ref = on(dgps::Backend::reference), cw = chunkwise(16);
      ref.l2norm_qk = cw.l2norm_qk = op.l2norm;
      ref.scale = cw.scale = op.scale;
      const Arrays g = run_backward<double>(c, ref), d = run_backward<double>(c, cw);
      std::string which;
      const double e = worst(d, g, &which);
      INFO(std::string(model) << " l2norm " << op.l2norm << " scale " << op.scale << " worst " << which << " " << e);
      CHECK(e < 1e-9);
    }
}

// Without a training cache the backward sweeps segments of 4096 tokens (dgps::detail::kCheckpointTokens)
// from checkpointed states: sequences of several segments, a last segment of a few tokens,
// GVA (a state and a state gradient per value head across segments), varlen, odd chunks.
TEST_CASE(
    "cpu backward: sequences over several 4096-token segments, GVA, varlen, every covered combination, f64 1e-9") {
  uint64_t seed = 1300;
  for (const auto& spec : covered_specs()) {
    Gen gen;
    gen.h0 = gen.a0 = true;
    gen.final_grads = true;
    const Case c =
        random_case(spec, {.batch = 1, .time = 13000, .heads = 1, .v_heads = 2, .key_dim = 16, .value_dim = 8},
                    {0, 4100, 4100, 13000}, ++seed, gen);
    const Arrays ref = gold_grads(c);
    for (int64_t chunk : {64, 7}) {
      const Arrays d = run_backward<double>(c, chunkwise(chunk));
      std::string which;
      const double e = worst(d, ref, &which);
      INFO(dgps::to_string(spec) << " chunk " << chunk << " worst " << which << " " << e);
      CHECK(e < 1e-9);
    }
  }
}
