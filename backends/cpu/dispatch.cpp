/// @brief Run-time instruction-set selection (in one place) and the parallel drivers of the CPU leaf kernels.
///
/// Compiled with the baseline flags only. The ISA is the best one the CPU supports among those this
/// build compiled (DGPS_CPU_HAVE_AVX512 / DGPS_CPU_HAVE_AVX2 on x86, DGPS_CPU_HAVE_NEON64 on aarch64), capped by
/// DGPS_MAX_CPU_ISA (avx512 | avx2 | neon64 | generic), which is read on every call.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "dgps/cpu/kernels.hpp"
#include "dgps/detail/parallel.hpp"
#include "isa.hpp"
#include "pool.hpp"

namespace dgps::cpu::kernels {

namespace {

/// The levels in order; neon64 (aarch64) ranks with avx2 (x86): a build compiles one family only.
enum class Level { generic = 0, avx2 = 1, neon64 = 1, avx512 = 2 };

/// The best level this CPU runs (cached: CPU features do not change).
Level cpu_level() {
  static const Level level = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
      return Level::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::avx2;
#elif defined(__aarch64__) && defined(__linux__)
    if (getauxval(AT_HWCAP) & HWCAP_ASIMD) return Level::neon64;
#elif defined(__aarch64__)
    return Level::neon64;  // Advanced SIMD is part of the aarch64 baseline
#endif
    return Level::generic;
  }();
  return level;
}

/// The cap from DGPS_MAX_CPU_ISA (no cap when unset or unrecognised).
Level env_cap() {
  const char* env = std::getenv("DGPS_MAX_CPU_ISA");
  if (!env || !*env) return Level::avx512;
  if (std::strcmp(env, "generic") == 0) return Level::generic;
  if (std::strcmp(env, "avx2") == 0 || std::strcmp(env, "neon64") == 0) return Level::avx2;
  return Level::avx512;
}

IsaKernels select() {
  const Level want = static_cast<Level>(std::min(int(cpu_level()), int(env_cap())));
#if defined(DGPS_CPU_HAVE_AVX512)
  if (want == Level::avx512) return avx512::table();
#endif
#if defined(DGPS_CPU_HAVE_AVX2)
  if (want >= Level::avx2) return avx2::table();
#endif
#if defined(DGPS_CPU_HAVE_NEON64)
  if (want >= Level::neon64) return neon64::table();
#endif
  (void)want;
  return generic::table();
}

/// Name strings with static storage for every ISA and operation.
const char* impl_name(const char* op, const char* isa) {
  static const std::string names[3][4] = {
      {"cpu/chunkwise/avx512", "cpu/chunkwise/avx2", "cpu/chunkwise/neon64", "cpu/chunkwise/generic"},
      {"cpu/decode/avx512", "cpu/decode/avx2", "cpu/decode/neon64", "cpu/decode/generic"},
      {"cpu/exact/avx512", "cpu/exact/avx2", "cpu/exact/neon64", "cpu/exact/generic"}};
  const int o = std::strcmp(op, "chunkwise") == 0 ? 0 : std::strcmp(op, "decode") == 0 ? 1 : 2;
  const int i = std::strcmp(isa, "avx512") == 0 ? 0
                : std::strcmp(isa, "avx2") == 0 ? 1
                : std::strcmp(isa, "neon64") == 0 ? 2
                                                  : 3;
  return names[o][i].c_str();
}

/// Copies the diagonal statistics the sequences read (a0 [N, H, K], or through a state pool the
/// states that `in_slots` names, at their own indices) into `buf` and points `p.a0` at it, so that
/// tasks writing aT never race with tasks still reading a0 when the caller passed the same memory.
template <class T>
void snapshot_a0(KernelParams& p, std::vector<unsigned char>& buf) {
  const bool diag = p.spec.precond == precond::Kind::diagonal_atk || p.spec.precond == precond::Kind::diagonal_atq;
  if (!diag || !p.a0.data || !p.aT.data) return;
  int64_t rows = p.in_slots ? 0 : p.N;
  if (p.in_slots)
    for (int64_t n = 0; n < p.N; ++n) rows = std::max(rows, p.in_slots[n] + 1);
  buf.resize(size_t(rows * p.H * p.K) * sizeof(T));
  T* dst = reinterpret_cast<T*>(buf.data());
  const T* src = static_cast<const T*>(p.a0.data);
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t si = p.in_slots ? p.in_slots[n] : n;
    if (si < 0) continue;
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t c = 0; c < p.K; ++c)
        dst[(si * p.H + h) * p.K + c] = src[si * p.a0.stride[0] + h * p.a0.stride[1] + c];
  }
  p.a0.data = dst;
  p.a0.stride[0] = p.H * p.K;
  p.a0.stride[1] = p.K;
  p.a0.stride[2] = 1;
}

/// Calls fn(i) for i in [0, n) on up to `threads` threads (0 = all). Unlike detail::parallel_for,
/// the TBB arena of each thread count is created once and reused: decode calls take microseconds,
/// and building an arena per call would cost more than the work.
template <class F>
void run_tasks(int64_t n, int threads, bool fixed_partition, F&& fn) {
  if (n <= 0) return;
#if defined(DGPS_HAS_TBB)
  const int want = threads > 0 ? threads : dgps::detail::hardware_threads();
  if (want == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  static std::mutex m;
  static std::map<int, std::unique_ptr<tbb::task_arena>> arenas;
  tbb::task_arena* arena = nullptr;
  {
    std::lock_guard<std::mutex> lk(m);
    auto& slot = arenas[want];
    if (!slot) slot = std::make_unique<tbb::task_arena>(want);
    arena = slot.get();
  }
  // A fixed (static) partition gives each thread the same tasks on every call, so a decode loop
  // keeps each head's state in the cache of the core that updates it; otherwise work stealing
  // balances unequal tasks (varlen).
  const auto body = [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i != r.end(); ++i) fn(i);
  };
  arena->execute([&] {
    if (fixed_partition)
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1), body, tbb::static_partitioner());
    else
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1), body);
  });
#else
  (void)fixed_partition;
  dgps::detail::parallel_for(n, threads, std::forward<F>(fn));
#endif
}

/// The sequences of a decode through a state pool in ascending order of the slot each reads (padding
/// sequences and those starting from zero last); empty without a pool or with one sequence.
std::vector<int64_t> slot_order(const KernelParams& p) {
  const int64_t* read = p.in_slots ? p.in_slots : p.slots;
  if (!read || p.N <= 1) return {};
  std::vector<std::pair<uint64_t, int64_t>> key(static_cast<size_t>(p.N));
  for (int64_t n = 0; n < p.N; ++n)  // negative slots and padding convert to the largest keys
    key[size_t(n)] = {p.padded && p.padded[n] ? ~uint64_t(0) : uint64_t(read[n]), n};
  std::sort(key.begin(), key.end());
  std::vector<int64_t> order(key.size());
  for (size_t i = 0; i < key.size(); ++i) order[i] = key[i].second;
  return order;
}

}  // namespace

const char* isa_name() { return select().name; }

const char* chunkwise_forward(const KernelParams& params) {
  const IsaKernels isa = select();
  KernelParams p = params;
  std::vector<unsigned char> a0copy;
  if (p.dtype == DType::f64)
    snapshot_a0<double>(p, a0copy);
  else
    snapshot_a0<float>(p, a0copy);
  // Parallel over (sequence, value head); with fewer pairs than threads, also over blocks of value
  // columns (independent in the recurrence, SPEC §2), each at least 32 columns wide. With more pairs
  // than threads, a task runs a group of adjacent value heads of one sequence chunk by chunk together
  // (their input rows are adjacent): up to kGroup heads (8 states of 128 x 128 floats stay in a 2 MB
  // L2), and at most pairs / threads, so that every thread still gets a task.
  constexpr int64_t kGroup = 8;
  const int64_t pairs = p.N * p.HV;
  const int64_t threads = p.threads > 0 ? p.threads : dgps::detail::hardware_threads();
  int64_t vsplit = 1;
  if (pairs > 0 && pairs < threads) vsplit = std::max<int64_t>(1, std::min((threads + pairs - 1) / pairs, p.V / 32));
  const int64_t group = std::max<int64_t>(1, std::min({kGroup, p.HV, pairs / std::max<int64_t>(1, threads)}));
  const int64_t tasks = p.N * ((p.HV + group - 1) / group) * vsplit;
  run_tasks(tasks, p.threads, false, [&](int64_t task) { isa.chunk_task(p, task, vsplit, group); });
  return impl_name("chunkwise", isa.name);
}

const char* chunkwise_backward(const KernelParams& p) {
  const IsaKernels isa = select();
  // One task per (sequence, key head) group: the group's value heads add into the same q/k
  // gradients (GVA), so each group sums them itself, in a fixed order. With a training cache and one
  // value head per key head, a task runs up to kGroup adjacent key heads of one sequence chunk by chunk
  // together (adjacent input rows, as in the forward), at most pairs / threads so that every thread
  // still gets a task.
  constexpr int64_t kGroup = 8;
  const int64_t pairs = p.N * p.H;
  const int64_t threads = p.threads > 0 ? p.threads : dgps::detail::hardware_threads();
  const bool cached = p.saved && !p.save && p.saved_seg == 0;  // the full cache (not checkpoints)
  const int64_t group =
      cached && p.HV == p.H ? std::max<int64_t>(1, std::min({kGroup, p.H, pairs / std::max<int64_t>(1, threads)})) : 1;
  const int64_t ng = (p.H + group - 1) / group;
  const int64_t tasks = p.N * ng;
  std::vector<double> dc(size_t(std::max<int64_t>(pairs, 0)), 0.0);
  run_tasks(tasks, p.threads, false,
            [&](int64_t task) { isa.backward_task(p, task, group, &dc[size_t(task / ng * p.H + task % ng * group)]); });
  if (p.dcenter.data) {
    for (int64_t h = 0; h < p.H; ++h) {
      double s = 0;
      for (int64_t n = 0; n < p.N; ++n) s += dc[size_t(n * p.H + h)];
      if (p.dtype == DType::f64)
        static_cast<double*>(p.dcenter.data)[h * p.dcenter.stride[0]] = s;
      else
        static_cast<float*>(p.dcenter.data)[h * p.dcenter.stride[0]] = float(s);
    }
  }
  return impl_name("chunkwise", isa.name);
}

const char* decode(const KernelParams& p) {
  const IsaKernels isa = select();
  // One task per (sequence, key head) group: the group's value heads share the preconditioner
  // state, so a0/aT (possibly the same memory) are read and written by one task only.
  const int64_t tasks = p.N * p.H;
  // Below ~200 kFLOP of state work per call waking a second thread costs more than it saves.
  const int64_t work = tasks * (p.HV / p.H) * p.K * p.V * (p.T > 0 ? p.T : 1);
  const int want = work < (int64_t(1) << 15) ? 1 : p.threads > 0 ? p.threads : dgps::detail::hardware_threads();
  // Through a state pool the sequences run in the order of the slots they read, so that each thread's
  // range of tasks walks the pool upwards: on two threads, scattered slots in call order measured 8-10%
  // slower than a dense state, the same slots in ascending order within 2% (dgps_bench_serve). The tasks
  // are independent (check.hpp rejects a slot written by one sequence and read by another), so the order
  // changes no result.
  const std::vector<int64_t> order = slot_order(p);
  // A persistent, briefly spinning pool with a static partition (pool.hpp): TBB or fresh threads
  // cost more to wake than a B = 1 step takes. A concurrent caller finding it busy runs serially.
  struct Ctx {
    const IsaKernels* isa;
    const KernelParams* p;
    const int64_t* order;  ///< sequence run at position n, or null (call order)
    void operator()(int64_t task) const {
      isa->decode_task(*p, order ? order[task / p->H] * p->H + task % p->H : task);
    }
  } ctx{&isa, &p, order.empty() ? nullptr : order.data()};
  const auto body = [](void* c, int64_t task) { (*static_cast<const Ctx*>(c))(task); };
  if (want <= 1 || tasks <= 1 || !SpinPool::instance().run(tasks, want, body, &ctx))
    for (int64_t task = 0; task < tasks; ++task) ctx(task);
  return impl_name("decode", isa.name);
}

const char* exact_backward(const KernelParams& p) {
  const IsaKernels isa = select();
  run_tasks(p.N * p.H, p.threads, false, [&](int64_t task) { isa.exact_backward_task(p, task); });
  return impl_name("exact", isa.name);
}

}  // namespace dgps::cpu::kernels
