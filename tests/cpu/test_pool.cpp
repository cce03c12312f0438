/// @brief The CPU decode's spin pool: every task runs exactly once, also past the generations where a narrower
/// claim tag would wrap (a pooled decode once hung after 2^23 calls followed by a call with more tasks).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <vector>

#include "../../backends/cpu/pool.hpp"

namespace {

using dgps::cpu::kernels::SpinPool;

struct Counts {
  std::vector<std::atomic<int>> hits;
  explicit Counts(int64_t n) : hits(size_t(n)) {}
};

/// Runs a job of n tasks on `parts` participants and returns how many tasks ran other than exactly once;
/// a job that does not finish within 20 s ends the process (a hung pool cannot be recovered in-process).
int64_t run_job(SpinPool& pool, int64_t n, int parts) {
  Counts c(n);
  auto body = [](void* ctx, int64_t i) { static_cast<Counts*>(ctx)->hits[size_t(i)].fetch_add(1); };
  auto done = std::async(std::launch::async, [&] { return pool.run(n, parts, body, &c); });
  if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "SpinPool::run(%lld tasks, %d parts) did not return within 20 s\n", (long long)n, parts);
    std::_Exit(1);
  }
  REQUIRE(done.get());
  int64_t wrong = 0;
  for (auto& h : c.hits) wrong += h.load() != 1;
  return wrong;
}

}  // namespace

TEST_CASE("spin pool: every task once across job tags that a 24-bit tag would wrap") {
  SpinPool pool;
  uint64_t jobs = 0;  // jobs the pool has counted
  auto skip_to = [&](uint64_t g) {
    pool.skip_jobs_for_testing(g - jobs);
    jobs = g;
  };
  CHECK(run_job(pool, 2, 2) == 0);  // blocks 0 and 1 claimed by an early job
  ++jobs;
  // 2^23 + 16 jobs later a job with more blocks: blocks 2 and 3 were never claimed, 0 and 1 long ago.
  skip_to(jobs + (uint64_t(1) << 23) + 16);
  CHECK(run_job(pool, 4, 2) == 0);
  CHECK(run_job(pool, 64, 2) == 0);
  jobs += 2;
  // Across the wrap of the published word's 24-bit generation field, and across 2^32.
  for (uint64_t wrap : {uint64_t(1) << 24, uint64_t(1) << 32}) {
    skip_to(wrap - 3);
    for (int j = 0; j < 8; ++j, ++jobs) CHECK(run_job(pool, 1 + 37 * j % 200, 1 + j % 3) == 0);
  }
  // Many small jobs back to back (late workers must find their blocks claimed, never run one twice).
  int64_t wrong = 0;
  for (int j = 0; j < 2000; ++j) wrong += run_job(pool, 1 + j % 9, 2);
  CHECK(wrong == 0);
}
