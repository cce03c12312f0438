/// @brief `dgps bench`: times forward, backward or token-by-token decode on synthetic inputs of a given shape.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <dgps/detail/check.hpp>

#include <dgps/backend.hpp>
#include <dgps/dynamic.hpp>

#include "commands.hpp"
#include "common.hpp"
#if defined(DGPS_HAS_CUDA)
#include "gpu.hpp"
#endif

namespace dgps_tool {

std::vector<OptionSpec> bench_options() {
  return join({model_options(),
               {{"batch", "B", "sequences (default 1)"},
                {"time", "T", "tokens per sequence (decode: T steps of one token)"},
                {"heads", "H", "key heads"},
                {"v-heads", "HV", "value heads, a multiple of H (default H)"},
                {"key-dim", "K", "key head dimension"},
                {"value-dim", "V", "value head dimension"},
                {"mode", "M", "forward (default) | backward | decode"},
                {"dtype", "D", "f32 (default) | f64"},
                {"repeat", "R", "timed runs; the median is reported (default 5)"},
                {"warmup", "W", "untimed runs first (default 1)"},
                {"seed", "S", "random seed of the synthetic inputs (default 0)"},
                {"json", "", "print one JSON object instead of text"}},
               backend_options(),
               math_options()});
}

namespace {

/// What `bench` times.
enum class Mode { forward, backward, decode };

/// The implementation that ran and the median and fastest run, in seconds.
struct BenchResult {
  dgps::RunInfo info;
  double median = 0, min = 0;
};

/// Synthetic inputs in the ranges trained models see: q, k, v ~ N(0, 1); decays g = logsigmoid(N(0, 1))
/// (negative); gains beta = sigmoid(N(0, 1)); the preconditioner gates likewise; center = -0.2.
template <class T>
struct Synthetic {
  std::vector<T> q, k, v, g, beta, g_p, beta_p, center, d_o;

  Synthetic(const dgps::Shape& s, const dgps::ModelSpec& spec, bool backward, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    auto fill = [&](std::vector<T>& x, int64_t n, auto f) {
      x.resize(static_cast<size_t>(n));
      for (auto& e : x) e = static_cast<T>(f(normal(rng)));
    };
    auto id = [](double z) { return z; };
    auto logsigmoid = [](double z) { return -std::log1p(std::exp(-z)); };
    auto sigmoid = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
    const int64_t BT = s.batch * s.time;
    fill(q, BT * s.heads * s.key_dim, id);
    fill(k, BT * s.heads * s.key_dim, id);
    fill(v, BT * s.v_heads * s.value_dim, id);
    if (spec.decay != dgps::decay::Kind::none)
      fill(g, BT * s.v_heads * (spec.decay == dgps::decay::Kind::diagonal ? s.key_dim : 1), logsigmoid);
    if (spec.gain == dgps::gain::Kind::scalar) fill(beta, BT * s.v_heads, sigmoid);
    if (spec.precond != dgps::precond::Kind::identity) {
      fill(g_p, BT * s.heads, logsigmoid);
      fill(beta_p, BT * s.heads, sigmoid);
    }
    if (spec.precond == dgps::precond::Kind::diagonal_atk || spec.precond == dgps::precond::Kind::diagonal_atq)
      center.assign(static_cast<size_t>(s.heads), T(-0.2));
    if (backward) fill(d_o, BT * s.v_heads * s.value_dim, id);
  }
};

/// The data of a synthetic tensor, or null for one the model does not use.
template <class T>
const T* ptr(const std::vector<T>& x) {
  return x.empty() ? nullptr : x.data();
}

/// Runs `step` `warmup` times untimed, then `repeat` times timed; progress on stderr when a run is slow.
BenchResult time_runs(int64_t warmup, int64_t repeat, bool quiet, const std::function<dgps::RunInfo()>& step) {
  using Clock = std::chrono::steady_clock;
  BenchResult r;
  std::vector<double> seconds;
  bool slow = false;
  for (int64_t i = 0; i < warmup + repeat; ++i) {
    const auto t0 = Clock::now();
    r.info = step();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i >= warmup) seconds.push_back(dt);
    slow = slow || dt > 1.0;
    if (slow && !quiet)
      std::fprintf(stderr, "bench: %s %lld/%lld: %.3f s\n", i < warmup ? "warm-up" : "run",
                   static_cast<long long>(i < warmup ? i + 1 : i - warmup + 1),
                   static_cast<long long>(i < warmup ? warmup : repeat), dt);
  }
  std::sort(seconds.begin(), seconds.end());
  const size_t n = seconds.size();
  r.median = n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  r.min = seconds.front();
  return r;
}

/// Builds synthetic inputs of element type T and times `mode` on them.
template <class T>
BenchResult bench_typed(const dgps::ModelSpec& spec, const dgps::Shape& s, const dgps::Options& opt, Mode mode,
                        int64_t warmup, int64_t repeat, uint64_t seed, bool quiet) {
  const Synthetic<T> x(s, spec, mode == Mode::backward, seed);
  const int64_t B = s.batch, Tn = s.time, H = s.heads, HV = s.v_heads, K = s.key_dim, V = s.value_dim;
  const bool has_precond = spec.precond != dgps::precond::Kind::identity;
  const bool exact = spec.precond == dgps::precond::Kind::exact_atk || spec.precond == dgps::precond::Kind::exact_atq;
  const int64_t a_size = !has_precond ? 0 : exact ? B * H * K * K : B * H * K;
  std::vector<T> o(static_cast<size_t>(B * Tn * HV * V)), h(static_cast<size_t>(B * HV * K * V)),
      a(static_cast<size_t>(a_size));

  if (mode == Mode::forward) {
    auto in = dgps::inputs<T>(s, x.q.data(), x.k.data(), x.v.data());
    in.decay(ptr(x.g)).gain(ptr(x.beta)).precond(ptr(x.g_p), ptr(x.beta_p), ptr(x.center));
    auto out = dgps::outputs<T>(o.data()).final_state(h.data(), has_precond ? a.data() : nullptr);
    return time_runs(warmup, repeat, quiet, [&] { return dgps::dynamic::forward(spec, in, out, opt); });
  }
  if (mode == Mode::backward) {
    auto in = dgps::inputs<T>(s, x.q.data(), x.k.data(), x.v.data());
    in.decay(ptr(x.g)).gain(ptr(x.beta)).precond(ptr(x.g_p), ptr(x.beta_p), ptr(x.center));
    std::vector<T> dq(x.q.size()), dk(x.k.size()), dv(x.v.size()), dg(x.g.size()), dbeta(x.beta.size()),
        dg_p(x.g_p.size()), dbeta_p(x.beta_p.size()), dcenter(x.center.size());
    dgps::Grads<T> grads;
    auto set = [](dgps::TensorView<T>& dst, std::vector<T>& buf) {
      if (!buf.empty()) dst = dgps::Out<T>(buf.data()).view;
    };
    set(grads.dq, dq), set(grads.dk, dk), set(grads.dv, dv), set(grads.dg, dg), set(grads.dbeta, dbeta);
    set(grads.dg_p, dg_p), set(grads.dbeta_p, dbeta_p), set(grads.dcenter, dcenter);
    const auto gin = dgps::grads_in<T>(x.d_o.data());
    return time_runs(warmup, repeat, quiet, [&] { return dgps::dynamic::backward(spec, in, gin, grads, opt); });
  }

  // Decode: T steps of one token for each of the B sequences, reading token t of the synthetic inputs in place.
  auto step_view = [&](const std::vector<T>& buf, int64_t t, int64_t heads, int64_t dim) {
    const T* p = ptr(buf);
    if (!p) return dgps::TensorView<const T>();
    if (dim == 0) return dgps::TensorView<const T>(p + t * heads, {B, 1, heads}, {Tn * heads, heads, 1});
    return dgps::TensorView<const T>(p + t * heads * dim, {B, 1, heads, dim}, {Tn * heads * dim, heads * dim, dim, 1});
  };
  const int64_t g_dim = spec.decay == dgps::decay::Kind::diagonal ? K : 0;
  dgps::Shape one = s;
  one.time = 1;
  auto reset = [&] {
    std::fill(h.begin(), h.end(), T(0));
    std::fill(a.begin(), a.end(), T(0));
    if (exact)  // P_0 = I / lambda
      for (int64_t m = 0; m < B * H; ++m)
        for (int64_t i = 0; i < K; ++i) a[static_cast<size_t>(m * K * K + i * K + i)] = T(1.0 / opt.lambda);
  };
  dgps::DecodeState<T> state;
  state.h = dgps::Out<T>(h.data()).view;
  if (has_precond) state.a = dgps::Out<T>(a.data()).view;
  return time_runs(warmup, repeat, quiet, [&] {
    reset();
    dgps::RunInfo info;
    for (int64_t t = 0; t < Tn; ++t) {
      auto in = dgps::inputs<T>(one, step_view(x.q, t, H, K), step_view(x.k, t, H, K), step_view(x.v, t, HV, V));
      in.decay(step_view(x.g, t, HV, g_dim)).gain(step_view(x.beta, t, HV, 0));
      in.precond(step_view(x.g_p, t, H, 0), step_view(x.beta_p, t, H, 0), ptr(x.center));
      const dgps::TensorView<T> o_t(o.data() + t * HV * V, {B, 1, HV, V}, {Tn * HV * V, HV * V, V, 1});
      info = dgps::dynamic::decode<T>(spec, state, in, o_t, opt);
    }
    return info;
  });
}

#if defined(DGPS_HAS_CUDA)
/// bench_typed on the GPU (float32): the synthetic inputs copied to the device once, each run synchronised.
BenchResult bench_gpu(const dgps::ModelSpec& spec, const dgps::Shape& s, const dgps::Options& opt, Mode mode,
                      int64_t warmup, int64_t repeat, uint64_t seed, bool quiet) {
  const Synthetic<float> x(s, spec, mode == Mode::backward, seed);
  const gpu::BenchInputs in{&x.q, &x.k, &x.v, &x.g, &x.beta, &x.g_p, &x.beta_p, &x.center, &x.d_o};
  gpu::BenchProblem problem(spec, s, opt, static_cast<int>(mode), in);
  return time_runs(warmup, repeat, quiet, [&] { return problem.run(); });
}
#endif

}  // namespace

int cmd_bench(const Args& args) {
  const dgps::ModelSpec spec = model_from(args);
  const dgps::Options opt = options_from(args);
  auto dim = [&](const char* name) {
    args.required(name);
    return args.integer(name, 1, 1);
  };
  dgps::Shape s;
  s.batch = args.integer("batch", 1, 1);
  s.time = dim("time");
  s.heads = dim("heads");
  s.key_dim = dim("key-dim");
  s.value_dim = dim("value-dim");
  s.v_heads = args.integer("v-heads", s.heads, 1);
  // The library's size rules, before any buffer is sized from products of these.
  dgps::detail::check_sizes(s.batch, s.time, s.heads, s.v_heads, s.key_dim, s.value_dim);
  const std::string mode_name = args.text("mode", "forward");
  Mode mode = Mode::forward;
  if (mode_name == "backward")
    mode = Mode::backward;
  else if (mode_name == "decode")
    mode = Mode::decode;
  else if (mode_name != "forward")
    throw UsageError("option '--mode': unknown value '" + mode_name + "' (expected forward | backward | decode)");
  const std::string dtype = args.text("dtype", "f32");
  if (dtype != "f32" && dtype != "f64")
    throw UsageError("option '--dtype': unknown value '" + dtype + "' (expected f32 | f64)");
  const int64_t repeat = args.integer("repeat", 5, 1), warmup = args.integer("warmup", 1, 0);
  const uint64_t seed = static_cast<uint64_t>(args.integer("seed", 0, 0));
  const bool json = args.has("json");

  BenchResult r;
#if defined(DGPS_HAS_CUDA)
  if (dgps::detail::select_backend(opt.backend) == dgps::Backend::cuda) {
    if (dtype != "f32") throw dgps::Error("backend 'cuda' has no float64 kernels: bench it with --dtype f32");
    r = bench_gpu(spec, s, opt, mode, warmup, repeat, seed, json);
  } else
#endif
    r = dtype == "f32" ? bench_typed<float>(spec, s, opt, mode, warmup, repeat, seed, json)
                       : bench_typed<double>(spec, s, opt, mode, warmup, repeat, seed, json);
  const double tokens = double(s.batch) * double(s.time);
  const double tokens_per_s = r.median > 0 ? tokens / r.median : 0.0;
  if (json) {
    std::printf(
        "{\"model\": \"%s\", \"spec\": \"%s\", \"shape\": {\"B\": %lld, \"T\": %lld, \"H\": %lld, \"HV\": %lld, "
        "\"K\": %lld, \"V\": %lld}, \"dtype\": \"%s\", \"backend\": \"%s\", \"algorithm\": \"%s\", \"impl\": \"%s\", "
        "\"mode\": \"%s\", \"threads\": %d, \"repeat\": %lld, \"seconds\": %.9g, \"seconds_min\": %.9g, "
        "\"tokens\": %.0f, \"tokens_per_s\": %.6g}\n",
        model_label(spec).c_str(), dgps::to_string(spec).c_str(), static_cast<long long>(s.batch),
        static_cast<long long>(s.time), static_cast<long long>(s.heads), static_cast<long long>(s.v_heads),
        static_cast<long long>(s.key_dim), static_cast<long long>(s.value_dim), dtype.c_str(),
        to_string(r.info.backend), to_string(r.info.algorithm), r.info.impl.c_str(), mode_name.c_str(), opt.threads,
        static_cast<long long>(repeat), r.median, r.min, tokens, tokens_per_s);
    return 0;
  }
  std::printf("model: %s\n", dgps::to_string(spec).c_str());
  std::printf("shape: B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld dtype=%s\n", static_cast<long long>(s.batch),
              static_cast<long long>(s.time), static_cast<long long>(s.heads), static_cast<long long>(s.v_heads),
              static_cast<long long>(s.key_dim), static_cast<long long>(s.value_dim), dtype.c_str());
  std::printf("mode: %s%s\n", mode_name.c_str(), mode == Mode::decode ? " (T steps of one token per sequence)" : "");
  std::printf("backend: %s  algorithm: %s  impl: %s  threads: %d%s\n", to_string(r.info.backend),
              to_string(r.info.algorithm), r.info.impl.c_str(), opt.threads, opt.threads == 0 ? " (all)" : "");
  std::printf("seconds: %.6g (median of %lld, min %.6g)\n", r.median, static_cast<long long>(repeat), r.min);
  std::printf("tokens/s: %.6g\n", tokens_per_s);
  return 0;
}

}  // namespace dgps_tool
