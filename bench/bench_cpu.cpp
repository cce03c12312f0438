/// @brief dgps_bench_cpu: CPU throughput (tokens/s, GFLOP/s, % of the measured FP32 FMA peak), chunkwise vs recurrent.
///
/// First measures the machine's FP32 FMA peak with a register-resident FMA loop for each ISA (1 and
/// N threads), then times the shapes of issue 3. FLOP counts per token and value head (K = key dim,
/// V = value dim, C = chunk): Online solve 6KV + 2CK + 2CV (the chunk products [K;Q]S, the state
/// update, the causal halves of Akk and Aqk, the triangular solve and Aqk R); Offline 4KV + CK + CV;
/// decode 6KV (two reads and one write of the K x V state per token). The same count is used for the
/// recurrent runs, so GFLOP/s ratios equal time ratios. The fwdbwd group prints the forward, the
/// chunkwise backward (ratio = (forward + backward) / forward), the forward that fills a
/// dgps::TrainingCache (ratio = its time / the plain forward's) and the backward that reads it (ratio =
/// (forward with save + backward with cache) / plain forward), and the recurrent backward on a 512-token
/// prefix (ratio = its time over the chunkwise backward's on the same prefix); the backward's GFLOP/s
/// counts twice the forward's FLOPs. Usage:
/// dgps_bench_cpu [--quick] [--json FILE] [--threads 1,2] [--reps N] [--only LIST]
/// where LIST has prefill,batch,fwdbwd,decode,sweep,exact. The exact group times the exact preconditioners
/// (Mesa layer, ridge readout) on their vectorised recurrence; their FLOPs per token and key head add
/// the inverse Gram's pass, 4K^2 (ExactATK: the rank-1 update and the next token's P k) or 6K^2
/// (ExactATQ: also P q), to decode's 6KV (Online) or 4KV (Offline).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <dgps/dgps.hpp>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---------------------------------------------------------------------------------------------
// FMA peak: 16 independent accumulator chains (enough to cover latency x throughput on current cores).

#if defined(__x86_64__)
__attribute__((target("avx512f"))) double fma_loop_avx512(int64_t iters) {
  __m512 acc[16];
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (auto& x : acc) x = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  }
  alignas(64) float t[16];
  float s = 0;
  for (auto& x : acc) {
    _mm512_store_ps(t, x);
    for (float v : t) s += v;
  }
  return s;
}
__attribute__((target("avx2,fma"))) double fma_loop_avx2(int64_t iters) {
  __m256 acc[12];
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (auto& x : acc) x = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
  alignas(32) float t[8];
  float s = 0;
  for (auto& x : acc) {
    _mm256_store_ps(t, x);
    for (float v : t) s += v;
  }
  return s;
}
#endif

/// GFLOP/s of `threads` threads each running the FMA loop of `isa` ("avx512" or "avx2"); 0 if absent.
double fma_peak(const std::string& isa, int threads) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool ok = isa == "avx512" ? __builtin_cpu_supports("avx512f") : __builtin_cpu_supports("avx2") &&
                                                                          __builtin_cpu_supports("fma");
  if (!ok) return 0;
  const int64_t iters = 20'000'000;
  const double flops_per_iter = isa == "avx512" ? 16.0 * 16 * 2 : 12.0 * 8 * 2;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> pool;
    std::vector<double> sink(threads);
    const auto t0 = Clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { sink[t] = isa == "avx512" ? fma_loop_avx512(iters) : fma_loop_avx2(iters); });
    for (auto& th : pool) th.join();
    const double s = seconds_since(t0);
    best = std::max(best, flops_per_iter * double(iters) * threads / s * 1e-9);
  }
  return best;
#else
  (void)isa, (void)threads;
  return 0;
#endif
}

// ---------------------------------------------------------------------------------------------

struct Args {
  bool quick = false;
  std::string json;
  std::vector<int> threads{1, 2};
  int reps = 3;
  std::string only = "prefill,batch,fwdbwd,decode,sweep,exact";
};

struct Record {
  std::string group, model, algorithm, impl;
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0;
  int threads = 0;
  double seconds = 0, tokens_per_s = 0, gflops = 0, pct_peak = 0, us_per_token = 0, ratio = 0;
};

/// Random inputs of one shape, float32, FLA-like ranges (unit-normal q, k, v; g in [-0.1, 0); beta,
/// beta_p in [0, 1); g_p in [-0.1, 0); center -0.2).
struct Problem {
  int64_t B, T, H, K, V;
  std::vector<float> q, k, v, g, gd, beta, gp, bp, center, o, d_o;
  Problem(int64_t B_, int64_t T_, int64_t H_, int64_t K_, int64_t V_) : B(B_), T(T_), H(H_), K(K_), V(V_) {
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    // Sum of uniforms: cheap, roughly normal (the generator must not dominate a 64k-token run).
    auto nrm = [&] { return (u(rng) + u(rng) + u(rng) - 1.5f) * 2.0f; };
    const size_t nq = size_t(B * T * H * K), nv = size_t(B * T * H * V), nh = size_t(B * T * H);
    q.resize(nq), k.resize(nq), v.resize(nv), g.resize(nh), gd.resize(nq), beta.resize(nh), gp.resize(nh),
        bp.resize(nh), center.assign(size_t(H), -0.2f), o.resize(nv), d_o.resize(nv);
    for (auto& x : q) x = nrm();
    for (auto& x : k) x = nrm();
    for (auto& x : v) x = nrm();
    for (auto& x : d_o) x = nrm();
    for (auto& x : g) x = -0.1f * u(rng);
    for (auto& x : gd) x = -0.1f * u(rng);
    for (auto& x : beta) x = u(rng);
    for (auto& x : gp) x = -0.1f * u(rng);
    for (auto& x : bp) x = u(rng);
  }
  dgps::Shape shape() const { return {.batch = B, .time = T, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V}; }
  template <class R>
  dgps::Inputs<float> inputs() const {
    auto in = dgps::inputs<float>(shape(), q.data(), k.data(), v.data());
    if constexpr (R::decay_type::needs_g) in.decay(R::decay_type::per_channel ? gd.data() : g.data());
    if constexpr (R::gain_type::needs_beta) in.gain(beta.data());
    if constexpr (dgps::precond::needs_gates<typename R::precond_type>)
      in.precond(gp.data(), bp.data(), dgps::precond::needs_center<typename R::precond_type> ? center.data() : nullptr);
    return in;
  }
};

/// The same problem with its inputs rounded to bfloat16 (and a bfloat16 output), for the bf16 rows.
struct ProblemBf16 {
  const Problem& p;
  std::vector<dgps::bf16> q, k, v, g, gd, beta, gp, bp, center, o;
  explicit ProblemBf16(const Problem& p_) : p(p_) {
    auto cvt = [](const std::vector<float>& x) { return std::vector<dgps::bf16>(x.begin(), x.end()); };
    q = cvt(p.q), k = cvt(p.k), v = cvt(p.v), g = cvt(p.g), gd = cvt(p.gd), beta = cvt(p.beta);
    gp = cvt(p.gp), bp = cvt(p.bp), center = cvt(p.center), o = cvt(p.o);
  }
  template <class R>
  dgps::Inputs<dgps::bf16> inputs() const {
    auto in = dgps::inputs<dgps::bf16>(p.shape(), q.data(), k.data(), v.data());
    if constexpr (R::decay_type::needs_g) in.decay(R::decay_type::per_channel ? gd.data() : g.data());
    if constexpr (R::gain_type::needs_beta) in.gain(beta.data());
    if constexpr (dgps::precond::needs_gates<typename R::precond_type>)
      in.precond(gp.data(), bp.data(), dgps::precond::needs_center<typename R::precond_type> ? center.data() : nullptr);
    return in;
  }
};

/// `n` floats starting at a 64-byte boundary inside `buf` (resized to hold them): inference engines
/// allocate their state caches 64-byte aligned; a 16-byte aligned std::vector would put every vector
/// load of the decode sweep across two cache lines (measured ~1.4x slower decode).
float* aligned_floats(std::vector<float>& buf, size_t n) {
  buf.assign(n + 16, 0.0f);
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - addr % 64) % 64) / sizeof(float);
}

template <class R>
double flops_per_token_head(int64_t K, int64_t V, int64_t C) {
  constexpr auto pk = dgps::spec_of<R>().precond;
  if constexpr (pk == dgps::precond::Kind::exact_atk || pk == dgps::precond::Kind::exact_atq) {
    (void)C;
    const double pre = (pk == dgps::precond::Kind::exact_atq ? 6.0 : 4.0) * double(K * K);
    return pre + (R::solve_type::kind == dgps::solve::Kind::online ? 6.0 : 4.0) * double(K * V);
  } else if constexpr (R::solve_type::kind == dgps::solve::Kind::online)
    return 6.0 * K * V + 2.0 * C * K + 2.0 * C * V;
  else
    return 4.0 * K * V + 1.0 * C * K + 1.0 * C * V;
}

/// Median of `reps` timings of fn (after one warm-up call).
double time_median(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Bench {
  Args args;
  double peak1 = 0, peak_n = 0;  // GFLOP/s of the kernels' ISA, 1 thread and max(threads)
  std::vector<Record> records;

  double peak_for(int threads) const { return threads == 1 ? peak1 : peak_n * threads / std::max(1, max_threads()); }
  int max_threads() const { return *std::max_element(args.threads.begin(), args.threads.end()); }

  void print(const Record& r) {
    std::printf("%-8s %-8s %-10s B=%-2ld T=%-6ld H=%-2ld thr=%d  %9.2f ms  %10.0f tok/s  %7.1f GFLOP/s  %5.1f%% peak",
                r.group.c_str(), r.model.c_str(), r.algorithm.c_str(), long(r.B), long(r.T), long(r.H), r.threads,
                r.seconds * 1e3, r.tokens_per_s, r.gflops, r.pct_peak);
    if (r.us_per_token > 0) std::printf("  %7.2f us/token", r.us_per_token);
    if (r.ratio > 0) std::printf("  ratio %.2f", r.ratio);
    std::printf("  [%s]\n", r.impl.c_str());
    std::fflush(stdout);
    records.push_back(r);
  }

  /// Options that run on the CPU backend with `threads` threads and algorithm `alg`.
  static dgps::Options cpu_options(int threads, dgps::Algorithm alg = dgps::Algorithm::automatic) {
    dgps::Options opt;
    opt.backend = dgps::Backend::cpu;
    opt.algorithm = alg;
    opt.threads = threads;
    return opt;
  }

  /// The record of a forward of model R on `p` (what ran: `info`) that took `seconds`.
  template <class R>
  Record forward_record(const char* group, const char* model, const dgps::RunInfo& info, const Problem& p, int threads,
                        double seconds) const {
    Record r{group, model, dgps::to_string(info.algorithm), info.impl, p.B, p.T, p.H, p.K, p.V, threads};
    r.seconds = seconds;
    r.tokens_per_s = double(p.B * p.T) / seconds;
    r.gflops = flops_per_token_head<R>(p.K, p.V, dgps::Options{}.chunk_size) * double(p.B * p.T * p.H) / seconds * 1e-9;
    r.pct_peak = 100.0 * r.gflops / peak_for(threads);
    return r;
  }

  template <class R>
  Record forward(const char* group, const char* model, const Problem& p, int threads, dgps::Algorithm alg,
                 int reps) {
    auto in = p.inputs<R>();
    auto out = dgps::outputs<float>(const_cast<float*>(p.o.data()));
    const dgps::Options opt = cpu_options(threads, alg);
    dgps::RunInfo info;
    const double s = time_median(reps, [&] { info = dgps::forward<R>(in, out, opt); });
    return forward_record<R>(group, model, info, p, threads, s);
  }

  /// The T sweep (GDN, chunkwise, B = 1) in interleaved rounds: every round times one call of every
  /// (T, threads) pair in turn, so a burst of load from the machine's other tenants lands on one call
  /// of many cases instead of every repetition of one; each case reports its median over max(reps, 5)
  /// rounds, then a summary line per thread count gives the slowest over the fastest time per token,
  /// of the medians and of each case's best round (the other tenants' load only ever adds time, so
  /// the best round is the closest to the kernel's own cost on a shared machine).
  void sweep(const std::vector<int64_t>& Ts, int64_t H, int64_t K) {
    std::vector<std::unique_ptr<Problem>> ps;
    for (int64_t t : Ts) ps.push_back(std::make_unique<Problem>(1, t, H, K, K));
    const int rounds = std::max(args.reps, 5);
    struct Case {
      const Problem* p;
      int threads;
      std::vector<double> t;
      dgps::RunInfo info;
    };
    std::vector<Case> cases;
    for (const auto& p : ps)
      for (int th : args.threads) cases.push_back({p.get(), th, {}, {}});
    auto run = [](Case& c) {
      auto in = c.p->inputs<dgps::GDN>();
      auto out = dgps::outputs<float>(const_cast<float*>(c.p->o.data()));
      const dgps::Options opt = cpu_options(c.threads, dgps::Algorithm::chunkwise);
      const auto t0 = Clock::now();
      c.info = dgps::forward<dgps::GDN>(in, out, opt);
      return seconds_since(t0);
    };
    for (auto& c : cases) run(c);  // warm-up
    for (int r = 0; r < rounds; ++r) {
      std::fprintf(stderr, "sweep: round %d of %d\n", r + 1, rounds);
      for (auto& c : cases) c.t.push_back(run(c));
    }
    for (int th : args.threads) {
      double lo = 0, hi = 0, lo_best = 0, hi_best = 0;  // fastest and slowest time per token
      for (auto& c : cases) {
        if (c.threads != th) continue;
        std::sort(c.t.begin(), c.t.end());
        const Problem& p = *c.p;
        const Record rec = forward_record<dgps::GDN>("sweep", "gdn", c.info, p, th, c.t[c.t.size() / 2]);
        print(rec);
        const double per_token = rec.seconds / double(p.T);
        const double best = c.t.front() / double(p.T);
        lo = lo == 0 ? per_token : std::min(lo, per_token);
        hi = std::max(hi, per_token);
        lo_best = lo_best == 0 ? best : std::min(lo_best, best);
        hi_best = std::max(hi_best, best);
      }
      std::printf("sweep    gdn      %d thread(s), T = %ld .. %ld, %d interleaved rounds: slowest / fastest time per "
                  "token %.3f (medians), %.3f (best rounds)\n",
                  th, long(Ts.front()), long(Ts.back()), rounds, hi / lo, hi_best / lo_best);
    }
  }

  template <class R>
  void prefill(const char* group, const char* model, const Problem& p, bool with_recurrent) {
    for (int th : args.threads) {
      const Record c = forward<R>(group, model, p, th, dgps::Algorithm::chunkwise, args.reps);
      print(c);
      if (with_recurrent) {
        Record r = forward<R>(group, model, p, th, dgps::Algorithm::recurrent, 1);
        r.ratio = r.seconds / c.seconds;  // chunkwise speed-up over recurrent
        print(r);
      }
    }
  }

  /// Gradient buffers of one problem (every gradient model R has), owned here.
  struct GradBuffers {
    std::vector<float> dq, dk, dv, dg, db, dgp, dbp, dc;
    dgps::Grads<float> gr;
    template <class R>
    void init(const Problem& p) {
      dq.resize(p.q.size()), dk.resize(p.k.size()), dv.resize(p.v.size());
      dg.resize(R::decay_type::per_channel ? p.gd.size() : p.g.size()), db.resize(p.beta.size());
      dgp.resize(p.gp.size()), dbp.resize(p.bp.size()), dc.resize(p.center.size());
      gr.dq = dgps::Out<float>(dq.data()).view;
      gr.dk = dgps::Out<float>(dk.data()).view;
      gr.dv = dgps::Out<float>(dv.data()).view;
      if constexpr (R::decay_type::needs_g) gr.dg = dgps::Out<float>(dg.data()).view;
      if constexpr (R::gain_type::needs_beta) gr.dbeta = dgps::Out<float>(db.data()).view;
      if constexpr (dgps::precond::needs_gates<typename R::precond_type>) {
        gr.dg_p = dgps::Out<float>(dgp.data()).view;
        gr.dbeta_p = dgps::Out<float>(dbp.data()).view;
        if constexpr (dgps::precond::needs_center<typename R::precond_type>)
          gr.dcenter = dgps::Out<float>(dc.data()).view;
      }
    }
  };

  /// Seconds of one backward of model R on `p` with algorithm `alg` (median of `reps`); `info` gets what ran.
  /// With `cache` (filled by a forward of the same problem) the backward reads it.
  template <class R>
  double time_backward(const Problem& p, int threads, dgps::Algorithm alg, int reps, dgps::RunInfo& info,
                       const dgps::TrainingCache* cache = nullptr) {
    auto in = p.inputs<R>();
    GradBuffers g;
    g.template init<R>(p);
    const dgps::Options opt = cpu_options(threads, alg);
    auto gin = dgps::grads_in<float>(p.d_o.data());
    if (cache) gin.use_saved(*cache);
    return time_median(reps, [&] { info = dgps::backward<R>(in, gin, g.gr, opt); });
  }

  /// Seconds of one chunkwise forward of model R on `p` that saves into `cache` (median of `reps`).
  template <class R>
  double time_forward_saving(const Problem& p, int threads, int reps, dgps::TrainingCache& cache) {
    auto in = p.inputs<R>();
    auto out = dgps::outputs<float>(const_cast<float*>(p.o.data())).save_for_backward(cache);
    const dgps::Options opt = cpu_options(threads, dgps::Algorithm::chunkwise);
    return time_median(reps, [&] { dgps::forward<R>(in, out, opt); });
  }

  /// The record of a backward of model R on `p` (what ran: `info`) that took `seconds`; its GFLOP/s count twice
  /// the forward's FLOPs.
  template <class R>
  Record backward_record(const char* group, const char* model, const char* label, const dgps::RunInfo& info,
                         const Problem& p, int threads, double seconds, double ratio) const {
    Record r{group, model, label, info.impl, p.B, p.T, p.H, p.K, p.V, threads};
    r.seconds = seconds;
    r.tokens_per_s = double(p.B * p.T) / seconds;
    r.gflops = 2.0 * flops_per_token_head<R>(p.K, p.V, 64) * double(p.B * p.T * p.H) / seconds * 1e-9;
    r.pct_peak = 100.0 * r.gflops / peak_for(threads);
    r.ratio = ratio;
    return r;
  }

  /// Training step cost: the forward, the chunkwise backward and (fwd + bwd) / fwd on `p`; then the
  /// recurrent backward against the chunkwise one on the shorter prefix `pr` (ratio = speed-up).
  template <class R>
  void fwdbwd(const char* model, const Problem& p, const Problem& pr) {
    for (int th : args.threads) {
      const Record f = forward<R>("fwdbwd", model, p, th, dgps::Algorithm::chunkwise, args.reps);
      print(f);
      dgps::RunInfo info;
      const double b = time_backward<R>(p, th, dgps::Algorithm::chunkwise, args.reps, info);
      print(backward_record<R>("fwdbwd", model, "backward", info, p, th, b,
                               (f.seconds + b) / f.seconds));  // (forward + backward) / forward
      // Training with saved activations (dgps::TrainingCache): the forward that saves, then the backward
      // that reads them; ratio = (forward with save + backward with cache) / plain forward.
      dgps::TrainingCache cache;
      const double fs = time_forward_saving<R>(p, th, args.reps, cache);
      Record rs{"fwdbwd", model, "fwd+save", f.impl, p.B, p.T, p.H, p.K, p.V, th};
      rs.seconds = fs;
      rs.tokens_per_s = double(p.B * p.T) / fs;
      rs.gflops = f.gflops * f.seconds / fs;
      rs.pct_peak = f.pct_peak * f.seconds / fs;
      rs.ratio = fs / f.seconds;  // forward with save / plain forward
      print(rs);
      const double bcache = time_backward<R>(p, th, dgps::Algorithm::chunkwise, args.reps, info, &cache);
      // (forward with save + backward with cache) / plain forward
      print(backward_record<R>("fwdbwd", model, "bwd-cached", info, p, th, bcache, (fs + bcache) / f.seconds));
      if (args.quick) continue;
      const double bc = time_backward<R>(pr, th, dgps::Algorithm::chunkwise, args.reps, info);
      const double br = time_backward<R>(pr, th, dgps::Algorithm::recurrent, 1, info);
      Record rr{"fwdbwd", model, "bwd-recur", info.impl, pr.B, pr.T, pr.H, pr.K, pr.V, th};
      rr.seconds = br;
      rr.tokens_per_s = double(pr.B * pr.T) / br;
      rr.ratio = br / bc;  // chunkwise backward speed-up over the recurrent backward
      print(rr);
    }
  }

  /// The exact preconditioners: the forward and the backward (automatic: the vectorised recurrences) on `p`
  /// (ratio = (forward + backward) / forward); then on the prefix `pr` the reference recurrence's forward and
  /// backward (ratio = its time / the kernel's on the same prefix).
  template <class R>
  void exact(const char* model, const Problem& p, const Problem& pr) {
    for (int th : args.threads) {
      const Record f = forward<R>("exact", model, p, th, dgps::Algorithm::automatic, args.reps);
      print(f);
      dgps::RunInfo info;
      const double b = time_backward<R>(p, th, dgps::Algorithm::automatic, args.reps, info);
      print(backward_record<R>("exact", model, "backward", info, p, th, b, (f.seconds + b) / f.seconds));
      if (args.quick) continue;
      const Record fp = forward<R>("exact", model, pr, th, dgps::Algorithm::automatic, args.reps);
      Record r = forward<R>("exact", model, pr, th, dgps::Algorithm::recurrent, 1);
      r.ratio = r.seconds / fp.seconds;  // kernel speed-up over the reference recurrence
      print(r);
      const double bp = time_backward<R>(pr, th, dgps::Algorithm::automatic, args.reps, info);
      dgps::RunInfo rinfo;
      const double br = time_backward<R>(pr, th, dgps::Algorithm::recurrent, 1, rinfo);
      print(backward_record<R>("exact", model, "recurrent-backward", rinfo, pr, th, br, br / bp));
    }
  }

  /// One decode step of the whole batch per call, element type T (float or dgps::bf16; the state is
  /// float either way, 64-byte aligned). Returns the seconds per step for each of args.threads; with
  /// `f32` (those of the float32 run) the rows' ratio is the speed over float32.
  template <class R, class T = float>
  std::vector<double> decode(const char* model, int64_t B, int64_t H, int64_t K, int64_t V,
                             const std::vector<double>& f32 = {}) {
    const Problem p(B, 1, H, K, V);
    std::vector<float> hbuf, abuf;
    float* h = aligned_floats(hbuf, size_t(B * H * K * V));
    float* a = aligned_floats(abuf, size_t(B * H * K));
    dgps::DecodeState<T> st;
    st.h = dgps::TensorView<float>(h, {B, H, K, V});
    if constexpr (dgps::precond::needs_gates<typename R::precond_type>) st.a = dgps::TensorView<float>(a, {B, H, K});
    std::vector<T> o(p.o.size());
    dgps::Inputs<T> in;
    std::unique_ptr<ProblemBf16> p16;
    if constexpr (std::is_same_v<T, float>) {
      in = p.inputs<R>();
    } else {
      p16 = std::make_unique<ProblemBf16>(p);
      in = p16->inputs<R>();
    }
    std::vector<double> out;
    for (int th : args.threads) {
      const dgps::Options opt = cpu_options(th);
      dgps::RunInfo info;
      const int inner = 200;
      const double s = time_median(args.reps, [&] {
        for (int i = 0; i < inner; ++i) info = dgps::decode<R>(st, in, o.data(), opt);
      }) / inner;
      Record r{"decode", model, "decode", info.impl, B, 1, H, K, V, th};
      if (out.size() < f32.size()) r.ratio = f32[out.size()] / s;  // speed over float32, same run
      out.push_back(s);
      r.seconds = s;
      r.tokens_per_s = double(B) / s;
      r.us_per_token = s * 1e6;  // one decode step of the whole batch
      r.gflops = 6.0 * K * V * double(B * H) / s * 1e-9;
      r.pct_peak = 100.0 * r.gflops / peak_for(th);
      print(r);
    }
    return out;
  }

  /// Chunkwise prefill of model R in float32 and in bfloat16 (inputs and o; float compute), back to
  /// back for each thread count; the bf16 row's ratio is its tokens/s over float32's.
  template <class R>
  void prefill_bf16(const char* model, const Problem& p) {
    const ProblemBf16 p16(p);
    const auto in16 = p16.inputs<R>();
    std::vector<dgps::bf16> o16(p.o.size());
    for (int th : args.threads) {
      const Record f = forward<R>("prefill", model, p, th, dgps::Algorithm::chunkwise, args.reps);
      const dgps::Options opt = cpu_options(th, dgps::Algorithm::chunkwise);
      dgps::RunInfo info;
      const auto out16 = dgps::outputs<dgps::bf16>(o16.data());
      const double s = time_median(args.reps, [&] { info = dgps::forward<R>(in16, out16, opt); });
      Record r = f;
      r.model = std::string(model) + "-bf16";
      r.impl = info.impl;
      r.seconds = s;
      r.tokens_per_s = double(p.B * p.T) / s;
      r.gflops = f.gflops * f.seconds / s;
      r.pct_peak = f.pct_peak * f.seconds / s;
      r.ratio = f.seconds / s;  // bf16 speed over float32, same run
      print(f);
      print(r);
    }
  }

  void write_json() const {
    if (args.json.empty()) return;
    FILE* f = std::fopen(args.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", args.json.c_str());
      return;
    }
    std::fprintf(f, "{\n  \"isa\": \"%s\",\n  \"fma_peak_gflops\": {\"1\": %.1f, \"%d\": %.1f},\n  \"records\": [\n",
                 dgps::cpu::kernels::isa_name(), peak1, max_threads(), peak_n);
    for (size_t i = 0; i < records.size(); ++i) {
      const Record& r = records[i];
      std::fprintf(f,
                   "    {\"group\": \"%s\", \"model\": \"%s\", \"algorithm\": \"%s\", \"impl\": \"%s\", \"B\": %ld, "
                   "\"T\": %ld, \"H\": %ld, \"K\": %ld, \"V\": %ld, \"threads\": %d, \"seconds\": %.6g, "
                   "\"tokens_per_s\": %.6g, \"gflops\": %.4g, \"pct_peak\": %.3g, \"us_per_token\": %.4g, "
                   "\"ratio\": %.4g}%s\n",
                   r.group.c_str(), r.model.c_str(), r.algorithm.c_str(), r.impl.c_str(), long(r.B), long(r.T),
                   long(r.H), long(r.K), long(r.V), r.threads, r.seconds, r.tokens_per_s, r.gflops, r.pct_peak,
                   r.us_per_token, r.ratio, i + 1 < records.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }

  bool want(const char* group) const { return ("," + args.only + ",").find(std::string(",") + group + ",") != std::string::npos; }

  void run() {
    const std::string isa = dgps::cpu::kernels::isa_name();
    const std::string peak_isa = isa == "generic" ? "avx2" : isa;
    peak1 = fma_peak(peak_isa, 1);
    peak_n = fma_peak(peak_isa, max_threads());
    std::printf("kernels ISA %s; measured FP32 FMA peak (%s): %.1f GFLOP/s on 1 thread, %.1f on %d\n", isa.c_str(),
                peak_isa.c_str(), peak1, peak_n, max_threads());
    if (peak1 <= 0) peak1 = peak_n = 1;
    const int64_t T = args.quick ? 1024 : 4096, H = 16, K = 128;
    if (want("prefill")) {
      const Problem p(1, T, H, K, K);
      const Problem pr(1, args.quick ? 256 : 1024, H, K, K);  // recurrent baseline on a shorter prefix
      auto both = [&]<class R>(const char* name) {
        prefill<R>("prefill", name, p, false);
        if (!args.quick) {
          for (int th : args.threads) {
            const Record c = forward<R>("prefill", name, pr, th, dgps::Algorithm::chunkwise, args.reps);
            Record r = forward<R>("prefill", name, pr, th, dgps::Algorithm::recurrent, 1);
            r.ratio = r.seconds / c.seconds;
            print(r);
          }
        }
      };
      both.template operator()<dgps::GDN>("gdn");
      prefill_bf16<dgps::GDN>("gdn", p);
      both.template operator()<dgps::PGDN>("pgdn");
      both.template operator()<dgps::KDA>("kda");
      both.template operator()<dgps::PKDA>("pkda");
      both.template operator()<dgps::DeltaNet>("deltanet");
      both.template operator()<dgps::Mamba2>("mamba2");
    }
    if (want("batch")) {
      const Problem p(args.quick ? 2 : 8, args.quick ? 1024 : 2048, H, K, K);
      prefill<dgps::GDN>("batch", "gdn", p, false);
      prefill<dgps::PGDN>("batch", "pgdn", p, false);
    }
    if (want("fwdbwd")) {
      const Problem p(1, args.quick ? 512 : T, H, K, K);
      const Problem pr(1, 512, H, K, K);  // recurrent backward baseline on a shorter prefix
      fwdbwd<dgps::GDN>("gdn", p, pr);
      fwdbwd<dgps::PGDN>("pgdn", p, pr);
      fwdbwd<dgps::KDA>("kda", p, pr);
      fwdbwd<dgps::PKDA>("pkda", p, pr);
      fwdbwd<dgps::DeltaNet>("deltanet", p, pr);
      fwdbwd<dgps::Mamba2>("mamba2", p, pr);
    }
    if (want("decode")) {
      for (int64_t B : {int64_t(1), int64_t(16)}) {
        const std::vector<double> f32 = decode<dgps::GDN>("gdn", B, H, K, K);
        decode<dgps::GDN, dgps::bf16>("gdn-bf16", B, H, K, K, f32);
        decode<dgps::PGDN>("pgdn", B, H, K, K);
        decode<dgps::KDA>("kda", B, H, K, K);
      }
    }
    if (want("exact")) {
      const Problem p(1, T, H, K, K), pr(1, 256, H, K, K);
      exact<dgps::MesaLayer>("mesa", p, pr);
      exact<dgps::RidgeReadout>("ridge", p, pr);
    }
    if (want("sweep")) {
      const std::vector<int64_t> Ts = args.quick ? std::vector<int64_t>{1024, 4096}
                                                 : std::vector<int64_t>{1024, 2048, 4096, 8192, 16384, 32768, 65536};
      sweep(Ts, H, K);
    }
    write_json();
  }
};

std::vector<int> parse_list(const char* s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      b.args.quick = true;
      b.args.reps = 1;
    } else if (a == "--json") {
      b.args.json = next();
    } else if (a == "--threads") {
      b.args.threads = parse_list(next());
    } else if (a == "--reps") {
      b.args.reps = std::max(1, std::atoi(next()));
    } else if (a == "--only") {
      b.args.only = next();
    } else {
      std::printf(
          "usage: dgps_bench_cpu [--quick] [--json FILE] [--threads 1,2] [--reps N] [--only LIST]\n"
          "  LIST: comma-separated of prefill,batch,fwdbwd,decode,sweep (default all)\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (b.args.threads.empty()) b.args.threads = {1};
  b.run();
  return 0;
}
