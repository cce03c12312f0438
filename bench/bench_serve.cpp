/// @brief dgps_bench_serve: one-token decode through a state pool (random slots) against dense decode, on the CPU.
///
/// A serving engine keeps P states and decodes a batch of B sequences whose slots are scattered in the pool.
/// This times, per model (GDN, PGDN) and batch size, one decode step of the batch over the same pool
/// [P, HV, K, V] (P >= 4B, far larger than the caches) with (a) dense states: a contiguous window of B states
/// passed as [B, HV, K, V] without slots, and (b) B random distinct slots; both are redrawn every step, so
/// neither finds the states that the previous step left in cache (a hot dense state would only measure the
/// cache); and (c) the same random slots of a K-last pool [P, HV, V, K] (DecodeState::layout). The three kinds of
/// step alternate. Prints the ratios pool / dense and K-last pool / dense. Median of `--reps` runs of `--steps`
/// steps each. Usage: dgps_bench_serve [--threads N] [--reps R] [--steps S] [--pool P] [--heads H]; K = V = 128,
/// HV = H.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <dgps/dgps.hpp>

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int threads = 0;
  int reps = 7;
  int steps = 50;
  int64_t pool = 256;
  int64_t heads = 16;
};

/// 64-byte aligned float buffer (as engines allocate their state pools).
struct Buf {
  float* p = nullptr;
  explicit Buf(size_t n, float fill) {
    p = static_cast<float*>(std::aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64));
    std::fill(p, p + n, fill);
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

/// Median us per step of (dense, pool, K-last pool).
template <class R>
std::array<double, 3> median_step_us(const Config& c, int64_t B, uint64_t seed) {
  constexpr bool precond = !std::is_same_v<typename R::precond_type, dgps::precond::Identity>;
  const int64_t H = c.heads, K = 128, V = 128, P = std::max(c.pool, 4 * B);
  const dgps::Shape s{.batch = B, .time = 1, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t n, float scale, float shift) {
    std::vector<float> v(n);
    for (auto& x : v) x = shift + scale * nd(rng);
    return v;
  };
  const auto q = rnd(size_t(B * H * K), 1, 0), k = rnd(size_t(B * H * K), 1, 0), v = rnd(size_t(B * H * V), 1, 0);
  const auto g = rnd(size_t(B * H), 0.01f, -0.05f), beta = rnd(size_t(B * H), 0.05f, 0.5f);
  const auto gp = rnd(size_t(B * H), 0.01f, -0.05f), bp = rnd(size_t(B * H), 0.05f, 0.5f);
  const std::vector<float> center(size_t(H), -0.2f);
  Buf h(size_t(P * H * K * V), 0.01f), a(size_t(P * H * K), 0.5f);
  std::vector<float> o(size_t(B * H * V));
  std::vector<int64_t> all(static_cast<size_t>(P)), slots(static_cast<size_t>(B));
  std::iota(all.begin(), all.end(), int64_t(0));
  auto in = dgps::inputs<float>(s, q.data(), k.data(), v.data()).decay(g.data()).gain(beta.data());
  if constexpr (precond) in.precond(gp.data(), bp.data(), center.data());
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  opt.threads = c.threads;
  std::vector<double> times[3];
  for (int r = 0; r < c.reps + 1; ++r) {
    double total[3] = {0, 0, 0};
    for (int st = 0; st < 3 * c.steps; ++st) {
      const int kind = st % 3;  // dense, pool, K-last pool alternate: drifts of a shared machine cancel
      const bool pooled = kind > 0;
      dgps::DecodeState<float> ds;
      ds.h = kind == 2 ? dgps::view(h.p, {P, H, V, K}) : dgps::view(h.p, {P, H, K, V});
      if (kind == 2) ds.layout = dgps::StateLayout::k_last;
      if constexpr (precond) ds.a = dgps::view(a.p, {P, H, K});
      if (!pooled) {  // a window of B contiguous states, as a dense [B, ...] state
        const int64_t w = int64_t(rng() % uint64_t(P / B)) * B;
        ds.h = dgps::view(h.p + w * H * K * V, {B, H, K, V});
        if constexpr (precond) ds.a = dgps::view(a.p + w * H * K, {B, H, K});
      } else {
        std::shuffle(all.begin(), all.end(), rng);  // a fresh scatter of slots every step
        std::copy_n(all.begin(), B, slots.begin());
        ds.slots = dgps::view(static_cast<const int64_t*>(slots.data()), {B});
      }
      const auto t0 = Clock::now();
      dgps::decode<R>(ds, in, o.data(), opt);
      total[kind] += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    if (r > 0)  // the first round warms up
      for (int i = 0; i < 3; ++i) times[i].push_back(total[i] / c.steps * 1e6);
  }
  for (auto& t : times) std::sort(t.begin(), t.end());
  return {times[0][times[0].size() / 2], times[1][times[1].size() / 2], times[2][times[2].size() / 2]};
}

template <class R>
void run(const char* name, const Config& c) {
  for (int64_t B : {1, 8, 32}) {
    const auto [dense, pool, k_last] = median_step_us<R>(c, B, 1);
    std::printf("%-5s B=%-3lld P=%-4lld dense %9.1f us/step  pool %9.1f  K-last pool %9.1f  pool/dense %.3f  "
                "K-last/dense %.3f  (%.0f tokens/s)\n",
                name, static_cast<long long>(B), static_cast<long long>(std::max(c.pool, 4 * B)), dense, pool, k_last,
                pool / dense, k_last / dense, double(B) / (pool * 1e-6));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (a == "--threads") c.threads = int(v);
    else if (a == "--reps") c.reps = int(v);
    else if (a == "--steps") c.steps = int(v);
    else if (a == "--pool") c.pool = v;
    else if (a == "--heads") c.heads = v;
    else {
      std::fprintf(stderr, "usage: dgps_bench_serve [--threads N] [--reps R] [--steps S] [--pool P] [--heads H]\n");
      return 2;
    }
  }
  std::printf("dgps_bench_serve: one-token decode, H = HV = %lld, K = V = 128, float32, %s, threads %d (0 = all)\n",
              static_cast<long long>(c.heads), dgps::cpu::kernels::isa_name(), c.threads);
  run<dgps::GDN>("gdn", c);
  run<dgps::PGDN>("pgdn", c);
  return 0;
}
