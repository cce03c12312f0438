/// @brief Concurrent calls: forward, backward and decode on the cpu backend from several threads at once equal serial
/// runs bitwise.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// One job of the mix: a model, a shape, what to run and with how many threads.
struct Job {
  const char* model;
  int64_t T, H, K, V;
  int kind;  // 0 forward chunkwise, 1 forward recurrent, 2 backward, 3 decode
  int threads;
};

/// Everything a job produces, flattened (exact float64 copies of the float results).
std::vector<double> run_job(const Job& j, uint64_t seed) {
  const dgps::ModelSpec spec = dgps::model_by_name(j.model);
  const Case c = random_case(
      spec, {.batch = 2, .time = j.T, .heads = j.H, .v_heads = j.H, .key_dim = j.K, .value_dim = j.V}, {}, seed);
  dgps::Options o = on(dgps::Backend::cpu, j.threads);
  o.chunk_size = 16;
  Arrays r;
  if (j.kind == 0 || j.kind == 1) {
    o.algorithm = j.kind == 0 && dgps::chunkwise_covers(spec) ? dgps::Algorithm::chunkwise : dgps::Algorithm::recurrent;
    r = run_forward<float>(c, o);
  } else if (j.kind == 2) {
    r = run_backward<float>(c, o);
  } else {
    // Decode two tokens a call from h0 / a0, the batch's two sequences together.
    CaseTensors<float> ct(c);
    std::vector<float> h(ct.s.at("h0"));
    std::vector<float> a = ct.s.count("a0") ? ct.s.at("a0") : std::vector<float>{};
    const int64_t step = 2;
    std::vector<float> out(static_cast<size_t>(2 * step * j.H * j.V));
    std::vector<double>& all = r["o"];
    for (int64_t t0 = 0; t0 + step <= j.T; t0 += step) {
      // Tokens [t0, t0 + step) of both sequences, as strided views into the [B, T, ...] inputs.
      auto part = [&](const char* n, int64_t per_token) -> dgps::TensorView<const float> {
        const float* p = ct.p(n);
        if (!p) return {};
        if (per_token == j.H)
          return dgps::TensorView<const float>(p + t0 * per_token, {2, step, j.H}, {j.T * j.H, j.H, 1});
        const int64_t d = per_token / j.H;
        return dgps::TensorView<const float>(p + t0 * per_token, {2, step, j.H, d}, {j.T * per_token, per_token, d, 1});
      };
      const dgps::Shape sh{.batch = 2, .time = step, .heads = j.H, .v_heads = j.H, .key_dim = j.K, .value_dim = j.V};
      dgps::Inputs<float> tok = dgps::inputs<float>(sh, nullptr, nullptr, nullptr);
      tok.q = part("q", j.H * j.K);
      tok.k = part("k", j.H * j.K);
      tok.v = part("v", j.H * j.V);
      if (c.has("g")) tok.g = part("g", static_cast<int64_t>(c.arr.at("g").size()) / (2 * j.T));
      if (c.has("beta")) tok.beta = part("beta", j.H);
      if (c.has("g_p")) tok.g_p = part("g_p", j.H), tok.beta_p = part("beta_p", j.H);
      if (c.has("center")) tok.center = dgps::TensorView<const float>(ct.p("center"), {j.H});
      dgps::DecodeState<float> st;
      st.h = dgps::view<float>(h.data(), {2, j.H, j.K, j.V});
      if (!a.empty()) st.a = dgps::view<float>(a.data(), {2, j.H, j.K});
      dgps::dynamic::decode(spec, st, tok, out.data(), o);
      all.insert(all.end(), out.begin(), out.end());
    }
    all.insert(all.end(), h.begin(), h.end());
    all.insert(all.end(), a.begin(), a.end());
  }
  std::vector<double> flat;
  for (const auto& [n, v] : r) flat.insert(flat.end(), v.begin(), v.end());
  return flat;
}

/// Bitwise equality of two result vectors (NaN payloads included).
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("concurrency: forward, backward and decode from several threads equal serial runs bitwise") {
  const std::vector<Job> jobs = {
      {"gdn", 48, 2, 16, 16, 0, 1},  {"pgdn", 40, 1, 32, 16, 0, 2},   {"kda", 33, 2, 16, 32, 1, 1},
      {"gla", 50, 2, 16, 16, 2, 2},  {"pgdn", 24, 2, 16, 16, 2, 1},   {"gdn", 20, 2, 16, 16, 3, 1},
      {"pgdn", 16, 1, 16, 16, 3, 2}, {"mamba2", 64, 2, 16, 16, 0, 0}, {"la", 30, 1, 16, 16, 2, 0},
  };
  std::vector<std::vector<double>> serial;
  for (size_t i = 0; i < jobs.size(); ++i) serial.push_back(run_job(jobs[i], 100 + i));
  constexpr int kThreads = 6, kReps = 4;
  std::atomic<int> mismatches{0}, errors{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < kThreads; ++w)
    pool.emplace_back([&, w] {
      for (int rep = 0; rep < kReps; ++rep)
        for (size_t n = 0; n < jobs.size(); ++n) {
          const size_t i = (n + size_t(w) * 2 + size_t(rep)) % jobs.size();  // a different mix on every thread
          try {
            if (!same_bits(run_job(jobs[i], 100 + i), serial[i])) ++mismatches;
          } catch (...) {
            ++errors;
          }
        }
    });
  for (auto& t : pool) t.join();
  CHECK(errors.load() == 0);
  CHECK(mismatches.load() == 0);
}
