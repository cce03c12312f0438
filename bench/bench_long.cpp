/// @brief dgps_bench_long: time and peak RSS of one CPU forward or backward (GDN, KDA or PGDN) of one long sequence.
///
/// dgps_bench_long --model gdn|kda|pgdn --time T [--heads H] [--dim K] [--pass fwd|bwd] [--threads N] [--reps N]
///                 [--ranks R] [--cache none|checkpoints|full]
/// `--cache` (one rank): with fwd, the forward saves into a TrainingCache of that kind; with bwd, an untimed forward
/// saves into one first and the timed backward reads it (none: no cache, the backward recomputes everything).
/// `--ranks R` splits the sequence into R equal segments run by dgps::distributed over a ThreadGroup (one thread per
/// rank, each rank's call on threads / R threads): the context-parallel path (docs/distributed.md).
/// Prints one line: model, T, pass, best seconds of the reps (wall clock, then the process's CPU time: on a
/// shared machine the CPU time of a one-thread run moves less with the load), peak RSS (MiB) of the process and the
/// bytes of the call's own inputs and outputs (MiB). Run one pass per process: the peak RSS is the
/// process's, so the backward's workspace is its peak minus the tensors.
#include <sys/resource.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <dgps/dgps.hpp>
#include <dgps/distributed.hpp>

namespace {

std::vector<float> filled(int64_t n, float lo, float hi, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (auto& x : v) x = u(g);
  return v;
}

template <class R>
int run(int64_t T, int64_t H, int64_t K, bool bwd, int threads, int reps, int ranks, const std::string& cache_kind,
        const char* name) {
  const int64_t V = K, tok = T * H;
  auto q = filled(tok * K, -1, 1, 1), k = filled(tok * K, -1, 1, 2), v = filled(tok * V, -1, 1, 3);
  auto g = filled(R::decay_type::per_channel ? tok * K : tok, -0.3f, -0.01f, 4), beta = filled(tok, 0.1f, 0.9f, 5);
  auto gp = filled(tok, -0.3f, -0.01f, 6), bp = filled(tok, 0.3f, 1.0f, 7), center = filled(H, -1, 0.5f, 8);
  std::vector<float> o(static_cast<size_t>(bwd ? 0 : tok * V));  // (zero-filled: it counts in the RSS)
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  opt.threads = threads;
  const int64_t gn = int64_t(g.size());
  double tensors = double(3 * tok * K + gn + 3 * tok + H) * 4;
  std::vector<float> dq, dk, dv, dg, dbeta, dgp, dbp, dcenter, d_o;
  if (bwd) {
    d_o = filled(tok * V, -1, 1, 9);
    dq.resize(q.size()), dk.resize(k.size()), dv.resize(v.size()), dg.resize(g.size()), dbeta.resize(beta.size());
    dgp.resize(gp.size()), dbp.resize(bp.size()), dcenter.resize(center.size());
    tensors += double(4 * tok * K + gn + 3 * tok) * 4;
  } else {
    tensors += double(tok * V) * 4;
  }
  double best = 1e30, best_cpu = 1e30;
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  dgps::TrainingCache cache;
  cache.set_max_full_bytes(cache_kind == "full" ? SIZE_MAX : 0);
  dgps::TrainingCache* use = cache_kind == "none" ? nullptr : &cache;
  // One call over tokens [t0, t1) (the whole sequence, or rank r's segment with `comm`); `fwd` forces a forward.
  auto call = [&](int64_t t0, int64_t t1, dgps::distributed::Communicator* comm, const dgps::Options& o2,
                  bool fwd = false) {
    const int64_t L = t1 - t0, gk = R::decay_type::per_channel ? K : 1;
    const dgps::Shape s2{.batch = 1, .time = L, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
    auto in2 = dgps::inputs<float>(s2, q.data() + t0 * H * K, k.data() + t0 * H * K, v.data() + t0 * H * V);
    in2.decay(g.data() + t0 * H * gk).gain(beta.data() + t0 * H);
    if constexpr (std::is_same_v<R, dgps::PGDN>) in2.precond(gp.data() + t0 * H, bp.data() + t0 * H, center.data());
    if (bwd && !fwd) {
      dgps::Grads<float> gr;
      gr.dq = dgps::view<float>(dq.data() + t0 * H * K, {1, L, H, K});
      gr.dk = dgps::view<float>(dk.data() + t0 * H * K, {1, L, H, K});
      gr.dv = dgps::view<float>(dv.data() + t0 * H * V, {1, L, H, V});
      gr.dg = R::decay_type::per_channel ? dgps::view<float>(dg.data() + t0 * H * K, {1, L, H, K})
                                         : dgps::view<float>(dg.data() + t0 * H, {1, L, H});
      gr.dbeta = dgps::view<float>(dbeta.data() + t0 * H, {1, L, H});
      if constexpr (std::is_same_v<R, dgps::PGDN>) {
        gr.dg_p = dgps::view<float>(dgp.data() + t0 * H, {1, L, H});
        gr.dbeta_p = dgps::view<float>(dbp.data() + t0 * H, {1, L, H});
        gr.dcenter = dgps::view<float>(dcenter.data(), {H});
      }
      auto gi = dgps::grads_in<float>(d_o.data() + t0 * H * V);
      if (use) gi.use_saved(*use);
      if (comm)
        dgps::distributed::backward<R>(*comm, in2, gi, gr, o2);
      else
        dgps::backward<R>(in2, gi, gr, o2);
    } else {
      auto out = dgps::outputs<float>(o.data() + t0 * H * V);
      if (use) out.save_for_backward(*use);
      if (comm)
        dgps::distributed::forward<R>(*comm, in2, out, o2);
      else
        dgps::forward<R>(in2, out, o2);
    }
  };
  dgps::distributed::ThreadGroup group(ranks);
  if (bwd && use) {
    if (o.empty()) {  // the saving forward writes o
      o.resize(static_cast<size_t>(tok * V));
      tensors += double(tok * V) * 4;
    }
    call(0, T, nullptr, opt, true);
    if (!cache.filled()) {
      std::fprintf(stderr, "dgps_bench_long: the forward saved nothing\n");
      return 1;
    }
  }
  for (int rep = 0; rep < reps; ++rep) {
    const double c0 = cpu_now();
    const auto t0 = std::chrono::steady_clock::now();
    if (ranks == 1) {
      call(0, T, nullptr, opt);
    } else {
      dgps::Options o2 = opt;
      o2.threads = threads / ranks > 0 ? threads / ranks : 1;
      std::vector<std::thread> th;
      for (int r = 0; r < ranks; ++r)
        th.emplace_back([&, r] { call(T * r / ranks, T * (r + 1) / ranks, &group.member(r), o2); });
      for (auto& t : th) t.join();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
    const double cs = cpu_now() - c0;
    best_cpu = cs < best_cpu ? cs : best_cpu;
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("%s T=%lld H=%lld K=%lld %s cache %s ranks %d %.4f s cpu %.4f s peak_rss %.1f MiB tensors %.1f MiB "
              "cache %.1f MiB\n",
              name, static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(K),
              bwd ? "bwd" : "fwd", cache_kind.c_str(), ranks, best, best_cpu, double(ru.ru_maxrss) / 1024,
              tensors / (1 << 20), double(cache.bytes()) / (1 << 20));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "gdn", pass = "fwd";
  int64_t T = 4096, H = 1, K = 128;
  int threads = 1, reps = 1, ranks = 1;
  std::string cache = "none";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: dgps_bench_long --model gdn|kda|pgdn --time T [--heads H] [--dim K] [--pass fwd|bwd] "
                   "[--threads N] [--reps N] [--ranks R] [--cache none|checkpoints|full]\n");
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--model")
      model = v;
    else if (a == "--time")
      T = std::atoll(v);
    else if (a == "--heads")
      H = std::atoll(v);
    else if (a == "--dim")
      K = std::atoll(v);
    else if (a == "--pass")
      pass = v;
    else if (a == "--threads")
      threads = std::atoi(v);
    else if (a == "--reps")
      reps = std::atoi(v);
    else if (a == "--ranks")
      ranks = std::atoi(v);
    else if (a == "--cache")
      cache = v;
  }
  if (cache != "none" && cache != "checkpoints" && cache != "full") {
    std::fprintf(stderr, "dgps_bench_long: --cache takes none, checkpoints or full (got %s)\n", cache.c_str());
    return 2;
  }
  if (cache != "none" && ranks != 1) {
    std::fprintf(stderr, "dgps_bench_long: --cache needs --ranks 1\n");
    return 2;
  }
  if (ranks < 1 || T < ranks) {
    std::fprintf(stderr, "dgps_bench_long: --ranks must be between 1 and --time (got %d)\n", ranks);
    return 2;
  }
  const bool bwd = pass == "bwd";
  if (model == "kda") return run<dgps::KDA>(T, H, K, bwd, threads, reps, ranks, cache, "kda");
  if (model == "pgdn") return run<dgps::PGDN>(T, H, K, bwd, threads, reps, ranks, cache, "pgdn");
  return run<dgps::GDN>(T, H, K, bwd, threads, reps, ranks, cache, "gdn");
}
