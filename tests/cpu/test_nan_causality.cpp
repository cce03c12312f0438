/// @brief Causality of non-finite inputs: a NaN or +Inf at token t changes no output before t, on every host backend.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <dgps/model_spec.hpp>

#include "support.hpp"

using namespace dgps_test;

namespace {

constexpr int64_t kT = 40, kH = 2, kK = 16, kV = 16, kChunk = 16;

/// Output o of case `c` (float) on `backend`: forward (chunkwise or recurrent), or decode `step` tokens a call.
std::vector<float> output(const Case& c, const std::string& how) {
  if (how != "decode") {
    dgps::Options o = on(how == "reference" ? dgps::Backend::reference : dgps::Backend::cpu, 1);
    o.algorithm = how == "chunkwise"   ? dgps::Algorithm::chunkwise
                  : how == "recurrent" ? dgps::Algorithm::recurrent
                                       : dgps::Algorithm::automatic;
    o.chunk_size = kChunk;
    const Arrays r = run_forward<float>(c, o);
    return std::vector<float>(r.at("o").begin(), r.at("o").end());
  }
  // Decode 4 tokens a call from h0 / a0 (a NaN inside a call's tokens must stay causal too).
  CaseTensors<float> ct(c);
  std::vector<float> h(ct.s.at("h0"));
  std::vector<float> a = ct.s.count("a0") ? ct.s.at("a0") : std::vector<float>{};
  std::vector<float> o(static_cast<size_t>(kT * kH * kV));
  constexpr int64_t step = 4;
  for (int64_t t0 = 0; t0 < kT; t0 += step) {
    auto slice = [&](const char* n, int64_t per_token) -> const float* {
      const float* p = ct.p(n);
      return p ? p + t0 * per_token : nullptr;
    };
    const dgps::Shape sh{.batch = 1, .time = step, .heads = kH, .v_heads = kH, .key_dim = kK, .value_dim = kV};
    auto tok = dgps::inputs<float>(sh, slice("q", kH * kK), slice("k", kH * kK), slice("v", kH * kV));
    const int64_t gper = c.spec.decay == dgps::decay::Kind::diagonal ? kH * kK : kH;
    tok.decay(slice("g", gper)).gain(slice("beta", kH)).precond(slice("g_p", kH), slice("beta_p", kH), ct.p("center"));
    dgps::DecodeState<float> st;
    st.h = dgps::view<float>(h.data(), {1, kH, kK, kV});
    if (!a.empty()) st.a = dgps::view<float>(a.data(), {1, kH, kK});
    dgps::dynamic::decode(c.spec, st, tok, o.data() + t0 * kH * kV, on(dgps::Backend::cpu, 1));
  }
  return o;
}

}  // namespace

TEST_CASE("causality: a NaN or +Inf in any input at token t leaves o[:t] bitwise unchanged, every host backend") {
  const char* const models[] = {"gdn", "pgdn", "kda", "gla", "mamba2", "la", "pdn"};
  const char* const inputs[] = {"q", "k", "v", "g", "beta", "g_p", "beta_p"};
  const char* const hows[] = {"reference", "recurrent", "chunkwise", "decode"};
  Rng rng(40);
  for (const char* m : models) {
    const dgps::ModelSpec spec = dgps::model_by_name(m);
    const Case clean =
        random_case(spec, {.batch = 1, .time = kT, .heads = kH, .v_heads = kH, .key_dim = kK, .value_dim = kV}, {}, 7);
    for (const char* how : hows) {
      if (std::string(how) == "chunkwise" && !dgps::chunkwise_covers(spec)) continue;
      const std::vector<float> base = output(clean, how);
      for (const char* name : inputs) {
        if (!clean.has(name)) continue;
        const int64_t per_token = static_cast<int64_t>(clean.arr.at(name).size()) / kT;
        const int64_t rnd = static_cast<int64_t>(rng.uniform(1, kT - 1));
        for (int64_t t : {int64_t(0), kChunk - 1, kChunk, kChunk + 1, 2 * kChunk, kT - 1, rnd}) {
          for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
            Case c = clean;
            // One element of token t (a random one of its heads and channels).
            const int64_t e = static_cast<int64_t>(rng.uniform(0, double(per_token)));
            c.arr[name][static_cast<size_t>(t * per_token + e)] = bad;
            const std::vector<float> o = output(c, how);
            const size_t n = static_cast<size_t>(t * kH * kV);
            INFO("model " << std::string(m) << " backend " << std::string(how) << " input " << std::string(name)
                          << " token " << t << " value " << bad);
            size_t first = n;  // the first output element that changed
            for (size_t i = 0; i < n && first == n; ++i)
              if (std::memcmp(&o[i], &base[i], sizeof(float)) != 0) first = i;
            INFO("first changed element " << first << " (token " << first / (kH * kV) << "): "
                                          << o[first < n ? first : 0] << " was " << base[first < n ? first : 0]);
            CHECK(first == n);
          }
        }
      }
    }
  }
}
