/// @brief parallel_for over independent tasks: oneTBB when available, std::thread otherwise.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(DGPS_HAS_TBB)
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#endif

namespace dgps::detail {

/// Number of hardware threads the CPU backend uses by default.
inline int hardware_threads() {
#if defined(DGPS_HAS_TBB)
  return tbb::this_task_arena::max_concurrency();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

/// Calls fn(i) for i in [0, n) on up to `threads` threads (0 = all). Tasks must be independent.
/// The first exception thrown by a task is rethrown after all tasks finished.
template <class F>
void parallel_for(int64_t n, int threads, F&& fn) {
  if (n <= 0) return;
  const int want = threads > 0 ? threads : hardware_threads();
  if (want == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#if defined(DGPS_HAS_TBB)
  tbb::task_arena arena(want);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1), [&](const tbb::blocked_range<int64_t>& r) {
      for (int64_t i = r.begin(); i != r.end(); ++i) fn(i);
    });
  });
#else
  const int nt = static_cast<int>(std::min<int64_t>(want, n));
  std::atomic<int64_t> next{0};
  std::exception_ptr err;
  std::mutex m;
  std::vector<std::thread> pool;
  for (int t = 0; t < nt; ++t)
    pool.emplace_back([&] {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        try {
          fn(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(m);
          if (!err) err = std::current_exception();
        }
      }
    });
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
#endif
}

}  // namespace dgps::detail
