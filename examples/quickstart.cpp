/// @brief Quickstart: PGDN prefill of 1024 tokens, then 32 decoded tokens, on the CPU with the compile-time API.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <dgps/dgps.hpp>

namespace {

/// The per-token inputs of a PGDN layer for `n` tokens (SPEC §1 shapes with B = 1, H = HV).
struct Tokens {
  std::vector<float> q, k, v, g, beta, g_p, beta_p;

  Tokens(int64_t n, int64_t H, int64_t K, int64_t V, std::mt19937& rng) {
    std::normal_distribution<float> z;
    auto fill = [&](std::vector<float>& x, int64_t size, float (*f)(float)) {
      x.resize(size);
      for (float& e : x) e = f(z(rng));
    };
    auto same = [](float a) { return a; };
    auto logsigmoid = [](float a) { return -std::log1p(std::exp(-a)); };  // log-decays, < 0
    auto sigmoid = [](float a) { return 1.0f / (1.0f + std::exp(-a)); };  // gains in (0, 1)
    fill(q, n * H * K, same), fill(k, n * H * K, same), fill(v, n * H * V, same);
    fill(g, n * H, logsigmoid), fill(beta, n * H, sigmoid);
    fill(g_p, n * H, logsigmoid), fill(beta_p, n * H, sigmoid);
  }
};

/// The checksum printed for a tensor.
double sum(const std::vector<float>& x) {
  double s = 0;
  for (float e : x) s += e;
  return s;
}

/// Wall-clock seconds since t0.
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
  using Model = dgps::PGDN;  // scalar decay, scalar gain, diagonal ATK preconditioner, online (delta rule)
  const int64_t T = 1024, H = 4, K = 64, V = 64, steps = 32;
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  std::mt19937 rng(0);
  const std::vector<float> center(H, -0.2f);  // FLA's log_atk_scale default

  // 1. Prefill: one forward pass over the prompt, keeping the final states hT, aT for decoding.
  const dgps::Shape prompt{.batch = 1, .time = T, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  const Tokens x(T, H, K, V, rng);
  std::vector<float> o(T * H * V), h(H * K * V), a(H * K);
  auto in = dgps::inputs<float>(prompt, x.q.data(), x.k.data(), x.v.data())
                .decay(x.g.data())
                .gain(x.beta.data())
                .precond(x.g_p.data(), x.beta_p.data(), center.data());
  auto t0 = std::chrono::steady_clock::now();
  const dgps::RunInfo info =
      dgps::forward<Model>(in, dgps::outputs<float>(o.data()).final_state(h.data(), a.data()), opt);
  const double prefill_s = seconds_since(t0);

  // 2. Decode: one token at a time; the state (h, a) is updated in place.
  dgps::DecodeState<float> state;
  state.h = dgps::view(h.data(), {1, H, K, V});
  state.a = dgps::view(a.data(), {1, H, K});
  const dgps::Shape one{.batch = 1, .time = 1, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  const Tokens y(steps, H, K, V, rng);
  std::vector<float> out(steps * H * V);
  t0 = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < steps; ++t) {
    auto tok = dgps::inputs<float>(one, &y.q[t * H * K], &y.k[t * H * K], &y.v[t * H * V])
                   .decay(&y.g[t * H])
                   .gain(&y.beta[t * H])
                   .precond(&y.g_p[t * H], &y.beta_p[t * H], center.data());
    dgps::decode<Model, float>(state, tok, &out[t * H * V], opt);
  }
  const double decode_s = seconds_since(t0);

  std::printf("PGDN on %s: T=%lld, H=%lld, K=%lld, V=%lld (float)\n", info.impl.c_str(), static_cast<long long>(T),
              static_cast<long long>(H), static_cast<long long>(K), static_cast<long long>(V));
  std::printf("prefill: checksum %.6f, %.0f tokens/s\n", sum(o), T / prefill_s);
  std::printf("decode:  checksum %.6f, %.0f tokens/s (%lld tokens)\n", sum(out), steps / decode_s,
              static_cast<long long>(steps));
  return std::isfinite(sum(o) + sum(out)) ? 0 : 1;
}
