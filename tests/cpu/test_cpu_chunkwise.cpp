/// @brief CPU chunkwise forward (SPEC §4) and decode kernels against the reference, on every ISA of this build.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <dgps/cpu/kernels.hpp>

#include "support.hpp"

using namespace dgps_test;

namespace {

namespace dk = dgps::decay;

const auto& kIsas = kCpuIsas;

dgps::Options chunkwise(int64_t chunk, int threads = 2) {
  dgps::Options o = on(dgps::Backend::cpu, threads);
  o.algorithm = dgps::Algorithm::chunkwise;
  o.chunk_size = chunk;
  return o;
}

/// The reference forward (float64) of a case, with chunk-independent options.
Arrays gold(const Case& c) {
  dgps::Options o = on(dgps::Backend::reference);
  o.scale = c.opt.scale;
  o.l2norm_qk = c.opt.l2norm_qk;
  o.x = c.opt.x;
  o.eps = c.opt.eps;
  return run_forward<double>(c, o);
}

}  // namespace

// Metric of the conformance suite: max|x - gold| / denominator (case.json), per tensor.
TEST_CASE("cpu chunkwise: every covered conformance case, chunk 16 and 64, every ISA, f32 1e-4 and f64 1e-9") {
  for (const auto& name : case_names()) {
    const Case c = load_case(name);
    if (!dgps::cpu::kernels::chunkwise_covers(c.spec)) continue;
    for (const char* isa : kIsas) {
      IsaCap cap(isa);
      for (int64_t chunk : {16, 64}) {
        dgps::Options o = chunkwise(chunk);
        with_case_options(c, o);
        const Arrays f = run_forward<float>(c, o);
        const Arrays d = run_forward<double>(c, o);
        for (const char* t : {"o", "hT", "aT"}) {
          if (!c.has(t)) continue;
          INFO("case " << name << " isa " << isa << " chunk " << chunk << " tensor " << t);
          CHECK(rel_err(f.at(t), c.arr.at(t), c.denom.at(t)) < 1e-4);
          CHECK(rel_err(d.at(t), c.arr.at(t), c.denom.at(t)) < 1e-9);
        }
      }
    }
  }
}

TEST_CASE("cpu chunkwise: RunInfo, automatic rule and unsupported combinations") {
  const Case c = random_case(dgps::model_by_name("pgdn"), {.batch = 1, .time = 40, .heads = 2, .v_heads = 2,
                                                             .key_dim = 16, .value_dim = 16}, {}, 3);
  CaseTensors<float> ct(c);
  std::vector<float> o(40 * 2 * 16);
  auto in = ct.inputs(c);
  auto out = dgps::outputs<float>(o.data());
  dgps::Options opt = on(dgps::Backend::cpu);
  const dgps::RunInfo a = dgps::dynamic::forward(c.spec, in, out, opt);
  CHECK(a.algorithm == dgps::Algorithm::chunkwise);
  CHECK(a.impl == std::string("cpu/chunkwise/") + dgps::cpu::kernels::isa_name());
  opt.algorithm = dgps::Algorithm::recurrent;
  CHECK(dgps::dynamic::forward(c.spec, in, out, opt).algorithm == dgps::Algorithm::recurrent);
  {
    IsaCap cap("generic");
    opt.algorithm = dgps::Algorithm::chunkwise;
    CHECK(dgps::dynamic::forward(c.spec, in, out, opt).impl == "cpu/chunkwise/generic");
  }
  CHECK(dgps::supports<dgps::PGDN>(dgps::Backend::cpu, dgps::Algorithm::chunkwise));
  CHECK(dgps::supports<dgps::KDA>(dgps::Backend::cpu, dgps::Algorithm::chunkwise));
  CHECK_FALSE(dgps::supports<dgps::MesaLayer>(dgps::Backend::cpu, dgps::Algorithm::chunkwise));
  CHECK_FALSE(dgps::supports<dgps::RidgeReadout>(dgps::Backend::cpu, dgps::Algorithm::chunkwise));
  const Case m = random_case(dgps::model_by_name("mesa"), {.batch = 1, .time = 8, .heads = 1, .v_heads = 1,
                                                            .key_dim = 8, .value_dim = 8}, {}, 4);
  CHECK_THROWS_AS(run_forward<float>(m, chunkwise(16)), dgps::Error);
}

TEST_CASE("cpu chunkwise: random K=V=128, odd lengths, GVA, varlen, h0/a0, every covered combination") {
  struct Shape {
    int64_t B, T, H, HV, K, V, chunk;
    std::vector<int64_t> cu;
  };
  const Shape shapes[] = {
      {1, 133, 1, 1, 128, 128, 64, {}},
      {2, 77, 2, 4, 32, 48, 16, {}},
      {1, 150, 2, 2, 60, 20, 64, {0, 5, 5, 70, 150}},
      {1, 9, 1, 1, 16, 16, 64, {}},
  };
  uint64_t seed = 100;
  for (const auto& sh : shapes)
    for (const auto& spec : covered_specs()) {
      const Case c = random_case(spec, {.batch = sh.B, .time = sh.T, .heads = sh.H, .v_heads = sh.HV,
                                        .key_dim = sh.K, .value_dim = sh.V},
                                 sh.cu, ++seed);
      const Arrays ref = gold(c);
      const Arrays f = run_forward<float>(c, chunkwise(sh.chunk));
      const Arrays d = run_forward<double>(c, chunkwise(sh.chunk));
      INFO(dgps::to_string(spec) << " T " << sh.T << " K " << sh.K << " V " << sh.V << " HV " << sh.HV);
      CHECK(worst(f, ref) < 1e-4);
      CHECK(worst(d, ref) < 1e-9);
    }
}

TEST_CASE("cpu chunkwise: strong decay g = -50 and zero keys stay finite and exact") {
  for (const char* model : {"gdn", "kda", "pgdn", "pkda", "mamba2", "gla"}) {
    const dgps::ModelSpec spec = dgps::model_by_name(model);
    Gen gen;
    gen.g_lo = -50;
    gen.g_hi = -50;
    gen.zero_key_tokens = {0, 3, 64, 65, 99};
    const Case c = random_case(spec, {.batch = 1, .time = 100, .heads = 2, .v_heads = 2, .key_dim = 32,
                                      .value_dim = 32}, {}, 7, gen);
    const Arrays ref = gold(c);
    for (int64_t chunk : {16, 64}) {
      const Arrays f = run_forward<float>(c, chunkwise(chunk));
      const Arrays d = run_forward<double>(c, chunkwise(chunk));
      INFO(model << " chunk " << chunk);
      for (const auto& [n, v] : f) CHECK(all_finite(v));
      CHECK(worst(f, ref) < 1e-4);
      CHECK(worst(d, ref) < 1e-9);
    }
  }
}

TEST_CASE("cpu decode kernel: every model, several steps of 1-3 tokens, slots, equals the reference forward") {
  for (const auto& kv : dgps::kNamedModels) {
    const auto& name = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& spec = kv.second;
    for (const char* isa : {"generic", "avx512"}) {
      IsaCap cap(isa);
      // V = 152: two whole column blocks of the decode sweep and a partial one (the last write of a
      // whole block reads the next whole block).
      const int64_t N = 2, Tn = 6, H = 2, HV = 4, K = 16, V = 152;
      const Case c = random_case(spec, {.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K,
                                        .value_dim = V}, {}, 11);
      const Arrays ref = gold(c);
      // State pool of 3 slots: sequence 0 -> slot 2, sequence 1 -> slot 0.
      const int64_t slot_of[2] = {2, 0};
      const auto adims = precond_state_dims(spec, 3, H, K);
      std::vector<double> h(3 * HV * K * V, 0.0), a(adims.empty() ? 0 : product(adims), 0.0);
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < HV * K * V; ++i) h[slot_of[n] * HV * K * V + i] = c.arr.at("h0")[n * HV * K * V + i];
        if (!a.empty()) {
          const int64_t per = product(adims) / 3;
          for (int64_t i = 0; i < per; ++i) a[slot_of[n] * per + i] = c.arr.at("a0")[n * per + i];
        }
      }
      std::vector<int64_t> slots = {2, 0};
      std::vector<double> o_all(N * Tn * HV * V, NAN);
      int64_t t = 0;
      for (int64_t step : {1, 3, 2}) {
        // Tokens t .. t+step-1 of both sequences, as an [N, step, ...] batch.
        auto slice = [&](const std::string& n, int64_t per_tok) {
          std::vector<double> out(N * step * per_tok);
          for (int64_t b = 0; b < N; ++b)
            for (int64_t i = 0; i < step * per_tok; ++i) out[(b * step) * per_tok + i] = c.arr.at(n)[(b * Tn + t) * per_tok + i];
          return out;
        };
        std::vector<double> q = slice("q", H * K), k = slice("k", H * K), v = slice("v", HV * V), g, beta, gp, bp;
        dgps::Inputs<double> in = dgps::inputs<double>({.batch = N, .time = step, .heads = H, .v_heads = HV,
                                                        .key_dim = K, .value_dim = V},
                                                       q.data(), k.data(), v.data());
        if (c.has("g")) {
          g = slice("g", spec.decay == dk::Kind::diagonal ? HV * K : HV);
          in.decay(g.data());
        }
        if (c.has("beta")) {
          beta = slice("beta", HV);
          in.gain(beta.data());
        }
        if (c.has("g_p")) {
          gp = slice("g_p", H);
          bp = slice("beta_p", H);
          in.precond(gp.data(), bp.data(), c.has("center") ? c.arr.at("center").data() : nullptr);
        }
        std::vector<double> o(N * step * HV * V);
        dgps::DecodeState<double> st;
        st.h = tv<double>(h, {3, HV, K, V});
        if (!a.empty()) st.a = tv<double>(a, adims);
        st.slots = dgps::TensorView<const int64_t>(slots.data(), {N});
        dgps::Options opt = on(dgps::Backend::cpu, 2);
        const dgps::RunInfo info = dgps::dynamic::decode(spec, st, in, o.data(), opt);
        CHECK(info.impl == std::string("cpu/decode/") + dgps::cpu::kernels::isa_name());
        for (int64_t b = 0; b < N; ++b)
          for (int64_t i = 0; i < step * HV * V; ++i) o_all[(b * Tn + t) * HV * V + i] = o[(b * step) * HV * V + i];
        t += step;
      }
      INFO("model " << name << " isa " << isa);
      CHECK(rel_err(o_all, ref.at("o")) < 1e-9);
      std::vector<double> hT(N * HV * K * V);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HV * K * V; ++i) hT[n * HV * K * V + i] = h[slot_of[n] * HV * K * V + i];
      CHECK(rel_err(hT, ref.at("hT")) < 1e-9);
      if (!a.empty()) {
        const int64_t per = product(adims) / 3;
        std::vector<double> aT(N * per);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < per; ++i) aT[n * per + i] = a[slot_of[n] * per + i];
        CHECK(rel_err(aT, ref.at("aT")) < 1e-9);
      }
    }
  }
}
