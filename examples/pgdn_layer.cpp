/// @brief A full PGDN layer (projections, short convolutions, gates, recurrence, gated RMSNorm) with a decode cache.
///
/// The layer follows FLA's PrecondGatedDeltaNet layer (fla/layers/precond_gated_deltanet.py):
///   q, k, v  = SiLU(causal depthwise conv4(x W)),        L2 norm of q, k inside dgps (l2norm_qk)
///   beta     = sigmoid(x W_b)                             per value head
///   g        = -exp(A_log) * softplus(x W_a + dt_bias)    per value head
///   g_p      = -exp(A_log_p) * softplus(x W_ap + dt_bias_p), beta_p = sigmoid(x W_bp)   per key head
///   center   = -0.2                                       (log_atk_scale)
///   y        = (RMSNorm(o) * SiLU(x W_gate)) W_o
/// It runs a prefill of a prompt, then decodes new tokens one at a time from a cache (the DecodeState plus
/// the convolution history), and checks that every decoded output equals a full forward pass over prompt
/// plus new tokens. Exit status 1 when they differ by more than 1e-4.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <dgps/dgps.hpp>

#if defined(DGPS_EXAMPLE_HAS_EIGEN)
#include <Eigen/Core>
#endif

namespace {

using Model = dgps::PGDN;
constexpr int64_t kConv = 4;  // short convolution width

/// y[rows, out] = x[rows, in] W[in, out], all row-major.
void matmul(const float* x, const std::vector<float>& W, int64_t rows, int64_t in, int64_t out, float* y) {
#if defined(DGPS_EXAMPLE_HAS_EIGEN)
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<M>(y, rows, out).noalias() = Eigen::Map<const M>(x, rows, in) * Eigen::Map<const M>(W.data(), in, out);
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < out; ++j) {
      float s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * W[i * out + j];
      y[r * out + j] = s;
    }
#endif
}

/// x * sigmoid(x)
float silu(float a) { return a / (1.0f + std::exp(-a)); }
/// 1 / (1 + exp(-x))
float sigmoid(float a) { return 1.0f / (1.0f + std::exp(-a)); }
/// log(1 + exp(x)), linear for large x
float softplus(float a) { return a > 20.0f ? a : std::log1p(std::exp(a)); }

/// The layer's parameters, randomly initialised as FLA does (A ~ U(1, 16), dt ~ logU(1e-3, 1e-1)).
struct Layer {
  int64_t D, H, HV, K, V;
  std::vector<float> Wq, Wk, Wv, conv_q, conv_k, conv_v, Wa, Wb, A_log, dt_bias, Wap, Wbp, A_log_p, dt_bias_p, center,
      Wgate, norm, Wo;

  Layer(int64_t D_, int64_t H_, int64_t HV_, int64_t K_, int64_t V_, std::mt19937& rng)
      : D(D_), H(H_), HV(HV_), K(K_), V(V_) {
    std::normal_distribution<float> z;
    std::uniform_real_distribution<float> u;
    auto randn = [&](int64_t n, float s) {
      std::vector<float> w(n);
      for (float& e : w) e = s * z(rng);
      return w;
    };
    auto a_log = [&](int64_t n) {
      std::vector<float> w(n);
      for (float& e : w) e = std::log(1.0f + 15.0f * u(rng));
      return w;
    };
    auto dt_inverse_softplus = [&](int64_t n) {
      std::vector<float> w(n);
      for (float& e : w) {
        const float dt = std::exp(std::log(1e-3f) + u(rng) * (std::log(1e-1f) - std::log(1e-3f)));
        e = dt + std::log(-std::expm1(-dt));
      }
      return w;
    };
    const float sd = 1.0f / std::sqrt(float(D));
    Wq = randn(D * H * K, sd), Wk = randn(D * H * K, sd), Wv = randn(D * HV * V, sd);
    conv_q = randn(H * K * kConv, 0.5f), conv_k = randn(H * K * kConv, 0.5f), conv_v = randn(HV * V * kConv, 0.5f);
    Wa = randn(D * HV, sd), Wb = randn(D * HV, sd), A_log = a_log(HV), dt_bias = dt_inverse_softplus(HV);
    Wap = randn(D * H, sd), Wbp = randn(D * H, sd), A_log_p = a_log(H), dt_bias_p = dt_inverse_softplus(H);
    center.assign(H, -0.2f);
    Wgate = randn(D * HV * V, sd), norm.assign(V, 1.0f), Wo = randn(HV * V * D, 1.0f / std::sqrt(float(HV * V)));
  }
};

/// What a layer keeps between calls for each sequence: the last kConv-1 pre-convolution rows of q, k, v,
/// and the recurrent states h [B, HV, K, V], a [B, H, K] that dgps::decode updates in place.
struct Cache {
  std::vector<float> hist_q, hist_k, hist_v, h, a;
  Cache(const Layer& L, int64_t B)
      : hist_q(B * (kConv - 1) * L.H * L.K),
        hist_k(hist_q.size()),
        hist_v(B * (kConv - 1) * L.HV * L.V),
        h(B * L.HV * L.K * L.V),
        a(B * L.H * L.K) {}
};

/// Causal depthwise convolution of x [B, T, C] with weights w [C, kConv] and history hist [B, kConv-1, C]
/// (updated to the last kConv-1 rows), followed by SiLU.
std::vector<float> short_conv(const std::vector<float>& x, const std::vector<float>& w, std::vector<float>& hist,
                              int64_t B, int64_t T, int64_t C) {
  std::vector<float> y(x.size());
  const int64_t P = kConv - 1;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> seq((P + T) * C);  // history rows then the new rows
    std::copy_n(&hist[b * P * C], P * C, seq.begin());
    std::copy_n(&x[b * T * C], T * C, seq.begin() + P * C);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float s = 0;
        for (int64_t j = 0; j < kConv; ++j) s += w[c * kConv + j] * seq[(t + j) * C + c];
        y[(b * T + t) * C + c] = silu(s);
      }
    std::copy_n(seq.begin() + T * C, P * C, &hist[b * P * C]);
  }
  return y;
}

/// The layer's inputs to the recurrence and its output gate for x [B, T, D], advancing the conv history.
struct Projected {
  std::vector<float> q, k, v, g, beta, g_p, beta_p, gate;
};

/// Projections, convolutions and gates of x [B, T, D].
Projected project(const Layer& L, const std::vector<float>& x, int64_t B, int64_t T, Cache& cache) {
  const int64_t n = B * T;
  auto linear = [&](const std::vector<float>& W, int64_t out) {
    std::vector<float> y(n * out);
    matmul(x.data(), W, n, L.D, out, y.data());
    return y;
  };
  Projected p;
  p.q = short_conv(linear(L.Wq, L.H * L.K), L.conv_q, cache.hist_q, B, T, L.H * L.K);
  p.k = short_conv(linear(L.Wk, L.H * L.K), L.conv_k, cache.hist_k, B, T, L.H * L.K);
  p.v = short_conv(linear(L.Wv, L.HV * L.V), L.conv_v, cache.hist_v, B, T, L.HV * L.V);
  auto decay = [&](std::vector<float> a, const std::vector<float>& A_log, const std::vector<float>& dt_bias) {
    const size_t heads = A_log.size();
    for (size_t i = 0; i < a.size(); ++i) a[i] = -std::exp(A_log[i % heads]) * softplus(a[i] + dt_bias[i % heads]);
    return a;
  };
  auto gain = [&](std::vector<float> b) {
    for (float& e : b) e = sigmoid(e);
    return b;
  };
  p.g = decay(linear(L.Wa, L.HV), L.A_log, L.dt_bias);
  p.beta = gain(linear(L.Wb, L.HV));
  p.g_p = decay(linear(L.Wap, L.H), L.A_log_p, L.dt_bias_p);
  p.beta_p = gain(linear(L.Wbp, L.H));
  p.gate = linear(L.Wgate, L.HV * L.V);
  return p;
}

/// y [B*T, D] = (RMSNorm(o) * SiLU(gate)) W_o, the norm over each value head's V channels.
std::vector<float> output(const Layer& L, const std::vector<float>& o, const std::vector<float>& gate, int64_t n) {
  std::vector<float> z(o.size()), y(n * L.D);
  for (int64_t r = 0; r < n * L.HV; ++r) {
    float ms = 0;
    for (int64_t c = 0; c < L.V; ++c) ms += o[r * L.V + c] * o[r * L.V + c];
    const float inv = 1.0f / std::sqrt(ms / float(L.V) + 1e-5f);
    for (int64_t c = 0; c < L.V; ++c) z[r * L.V + c] = o[r * L.V + c] * inv * L.norm[c] * silu(gate[r * L.V + c]);
  }
  matmul(z.data(), L.Wo, n, L.HV * L.V, L.D, y.data());
  return y;
}

/// Runs the layer over x [B, T, D] from `cache` (prefill when the cache is fresh) and returns y [B, T, D]
/// and the recurrence output o [B, T, HV, V]. With `decode`, uses dgps::decode on the cached state;
/// otherwise dgps::forward, writing the final state into the cache.
std::pair<std::vector<float>, std::vector<float>> run(const Layer& L, const std::vector<float>& x, int64_t B, int64_t T,
                                                      Cache& cache, bool decode) {
  const Projected p = project(L, x, B, T, cache);
  const dgps::Shape shape{.batch = B, .time = T, .heads = L.H, .v_heads = L.HV, .key_dim = L.K, .value_dim = L.V};
  auto in = dgps::inputs<float>(shape, p.q.data(), p.k.data(), p.v.data())
                .decay(p.g.data())
                .gain(p.beta.data())
                .precond(p.g_p.data(), p.beta_p.data(), L.center.data());
  std::vector<float> o(B * T * L.HV * L.V);
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  if (decode) {
    dgps::DecodeState<float> state;
    state.h = dgps::view(cache.h.data(), {B, L.HV, L.K, L.V});
    state.a = dgps::view(cache.a.data(), {B, L.H, L.K});
    dgps::decode<Model, float>(state, in, o.data(), opt);
  } else {
    dgps::forward<Model>(in, dgps::outputs<float>(o.data()).final_state(cache.h.data(), cache.a.data()), opt);
  }
  return {output(L, o, p.gate, B * T), o};
}

/// Rows [t0, t0 + n) of each of the B sequences of x [B, T, C].
std::vector<float> slice(const std::vector<float>& x, int64_t B, int64_t T, int64_t C, int64_t t0, int64_t n) {
  std::vector<float> y(B * n * C);
  for (int64_t b = 0; b < B; ++b) std::copy_n(&x[(b * T + t0) * C], n * C, &y[b * n * C]);
  return y;
}

}  // namespace

int main() {
  const int64_t B = 2, D = 128, H = 2, HV = 4, K = 32, V = 32, prompt = 48, steps = 16, total = prompt + steps;
  std::mt19937 rng(7);
  const Layer layer(D, H, HV, K, V, rng);
  std::normal_distribution<float> z;
  std::vector<float> x(B * total * D);
  for (float& e : x) e = z(rng);

  // Reference: one forward pass over prompt + new tokens.
  Cache fresh(layer, B);
  const auto [y_full, o_full] = run(layer, x, B, total, fresh, false);

  // Prefill the prompt, then decode the new tokens one at a time from the cache.
  Cache cache(layer, B);
  run(layer, slice(x, B, total, D, 0, prompt), B, prompt, cache, false);
  double max_y = 0, max_o = 0, scale_y = 0;
  for (int64_t t = prompt; t < total; ++t) {
    const auto [y, o] = run(layer, slice(x, B, total, D, t, 1), B, 1, cache, true);
    const auto y_ref = slice(y_full, B, total, D, t, 1), o_ref = slice(o_full, B, total, HV * V, t, 1);
    for (size_t i = 0; i < y.size(); ++i) max_y = std::max(max_y, double(std::fabs(y[i] - y_ref[i])));
    for (size_t i = 0; i < y.size(); ++i) scale_y = std::max(scale_y, double(std::fabs(y_ref[i])));
    for (size_t i = 0; i < o.size(); ++i) max_o = std::max(max_o, double(std::fabs(o[i] - o_ref[i])));
  }
#if defined(DGPS_EXAMPLE_HAS_EIGEN)
  const char* projections = "Eigen";
#else
  const char* projections = "plain loops";
#endif
  std::printf("PGDN layer: B=%lld D=%lld H=%lld HV=%lld K=%lld V=%lld, prompt %lld + %lld decoded tokens (%s)\n",
              static_cast<long long>(B), static_cast<long long>(D), static_cast<long long>(H),
              static_cast<long long>(HV), static_cast<long long>(K), static_cast<long long>(V),
              static_cast<long long>(prompt), static_cast<long long>(steps), projections);
  std::printf("decode vs full forward: max|o diff| = %.3g, max|y diff| = %.3g (max|y| = %.3g)\n", max_o, max_y,
              scale_y);
  const bool ok = max_o <= 1e-4 && max_y <= 1e-4 && std::isfinite(max_o + max_y);
  std::printf("%s\n", ok ? "OK: decode equals forward" : "FAIL: decode differs from forward by more than 1e-4");
  return ok ? 0 : 1;
}
