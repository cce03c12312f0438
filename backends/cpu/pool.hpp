/// @brief Internal: a persistent, briefly spinning worker pool for the decode kernel (calls of microseconds).
///
/// A decode step of B = 1, H = 16, K = V = 128 is about 10 µs of work per core; waking sleeping
/// threads (futex, an inter-processor interrupt under a hypervisor) or creating them costs as much.
/// The pool's workers therefore spin for a short while (kSpinNs) after each job before they sleep,
/// so back-to-back decode calls find them awake.
///
/// Tasks are split statically (participant j prefers the contiguous range j n / parts .. (j + 1) n
/// / parts), so a decode loop keeps each head's state in the cache of the core that updates it. Every
/// block of tasks is claimed atomically before it runs, and the calling thread, once done with its
/// own range, claims the blocks of a worker that has not started in time: a worker that the OS has
/// descheduled (a busy machine) delays the call by microseconds, not by a scheduler time slice.
/// One caller at a time: a concurrent caller gets `false` from `run` and runs its tasks itself.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DGPS_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define DGPS_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define DGPS_CPU_RELAX() ((void)0)
#endif

namespace dgps::cpu::kernels {

class SpinPool {
 public:
  /// How long an idle worker spins before it sleeps (nanoseconds).
  static constexpr int64_t kSpinNs = 200'000;
  /// Most claimable blocks per job (larger jobs claim contiguous groups of tasks).
  static constexpr int64_t kMaxBlocks = 1024;
  /// After finishing its own range, the caller takes over the unstarted blocks of a worker that has
  /// not begun after kStealAfterNs, or of any worker after kStealAnywayNs (nanoseconds).
  static constexpr int64_t kStealAfterNs = 3'000, kStealAnywayNs = 50'000;

  /// The process-wide pool (built on first use; workers are started on demand).
  static SpinPool& instance() {
    static SpinPool pool;
    return pool;
  }

  SpinPool() {
    for (auto& c : claim_) c.store(0, std::memory_order_relaxed);
    for (auto& c : started_) c.store(0, std::memory_order_relaxed);
  }
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;

  ~SpinPool() {
    stop_.store(true);
    word_.fetch_add(256);
    word_.notify_all();
    for (auto& t : workers_) t.join();
  }

  /// Runs fn(ctx, i) once for every i in [0, n) on up to `parts` participants (the calling thread
  /// and parts - 1 workers). Returns false without running anything when another thread is using
  /// the pool.
  bool run(int64_t n, int parts, void (*fn)(void*, int64_t), void* ctx) {
    std::unique_lock<std::mutex> lk(busy_, std::try_to_lock);
    if (!lk.owns_lock()) return false;
    if (n <= 0) return true;
    parts = int(std::max<int64_t>(1, std::min<int64_t>({int64_t(parts), n, int64_t(255)})));
    while (int(workers_.size()) < parts - 1) {
      const int w = int(workers_.size()) + 1;
      workers_.emplace_back([this, w] { loop(w); });
    }
    const int64_t per = (n + kMaxBlocks - 1) / kMaxBlocks;
    // A seqlock around the job fields: the word first says "being set up" (a new generation with
    // zero participants), then publishes (generation mod 2^24) << 8 | parts. The claim tag is the
    // whole 64-bit generation, so it never wraps: a block is free for every job newer than its claim.
    const uint64_t tag = ++generation_;
    const uint32_t word = uint32_t(tag & 0xffffff) << 8;
    word_.store(word);
    tag_.store(tag, std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    per_.store(per, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    word_.store(word | uint32_t(parts));  // seq_cst, paired with the sleepers_ protocol in loop()
    if (sleepers_.load() > 0) word_.notify_all();
    const Job job{fn, ctx, n, per, parts, tag};
    const int64_t mine = work(job, 0);
    // Wait for the workers; take over the blocks nobody has started (from the end of each range
    // backwards) only when the workers are behind (less than half of their blocks done when this
    // thread is through its own: a busy machine has descheduled one), when one has not begun after
    // kStealAfterNs, or after kStealAnywayNs. Stealing from workers that keep pace would move heads,
    // and their states, between cores from one call to the next.
    const int64_t nb = (n + per - 1) / per;
    const auto t0 = std::chrono::steady_clock::now();
    bool stolen = false;
    for (int spins = 0; done_.load(std::memory_order_acquire) != nb; ++spins) {
      DGPS_CPU_RELAX();
      if (spins % 32 != 0) continue;
      const auto waited = std::chrono::steady_clock::now() - t0;
      if (!stolen) {
        bool idle = false;
        for (int j = 1; j < parts; ++j) idle = idle || started_[j].load(std::memory_order_relaxed) != tag;
        const bool behind = spins == 0 && (done_.load(std::memory_order_relaxed) - mine) * 2 < nb - mine;
        if (behind || (idle && waited > std::chrono::nanoseconds(kStealAfterNs)) ||
            waited > std::chrono::nanoseconds(kStealAnywayNs)) {
          for (int j = parts - 1; j >= 1; --j)
            for (int64_t b = nb * (j + 1) / parts - 1; b >= nb * j / parts; --b) run_block(job, b);
          stolen = true;
        }
      } else if (waited > std::chrono::nanoseconds(2 * kStealAnywayNs)) {
        std::this_thread::yield();  // a preempted worker holds a block: let it run
      }
    }
    return true;
  }

  /// Test hook: counts `jobs` jobs as started without running them, so a test can reach generations that
  /// a process reaches only after hours of decoding (the word's 24-bit field wraps every 2^24 jobs).
  void skip_jobs_for_testing(uint64_t jobs) {
    std::lock_guard<std::mutex> lk(busy_);
    generation_ += jobs;
  }

 private:
  struct Job {
    void (*fn)(void*, int64_t);
    void* ctx;
    int64_t n, per;
    int parts;
    uint64_t tag;
  };

  /// Claims block b for job `job` and runs it; false when someone claimed it already.
  bool run_block(const Job& job, int64_t b) {
    uint64_t cur = claim_[b].load(std::memory_order_relaxed);
    do {
      // A claim of this job or of a newer one (seen by a worker that woke late) wins.
      if (cur >= job.tag) return false;
    } while (!claim_[b].compare_exchange_weak(cur, job.tag, std::memory_order_acq_rel));
    const int64_t a = b * job.per, e = std::min(job.n, a + job.per);
    for (int64_t i = a; i < e; ++i) job.fn(job.ctx, i);
    done_.fetch_add(1, std::memory_order_release);
    return true;
  }

  /// Participant j's own range of blocks, in order; returns how many it ran.
  int64_t work(const Job& job, int j) {
    started_[j].store(job.tag, std::memory_order_relaxed);
    const int64_t nb = (job.n + job.per - 1) / job.per;
    int64_t ran = 0;
    for (int64_t b = nb * j / job.parts; b < nb * (j + 1) / job.parts; ++b) ran += run_block(job, b);
    return ran;
  }

  void loop(int w) {
    uint32_t seen = 0;
    for (;;) {
      uint32_t g = word_.load(std::memory_order_acquire);
      if (g == seen) {
        auto t0 = std::chrono::steady_clock::now();
        int spins = 0;
        while ((g = word_.load(std::memory_order_acquire)) == seen) {
          DGPS_CPU_RELAX();
          if (++spins % 64 == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(kSpinNs)) {
            sleepers_.fetch_add(1);
            word_.wait(seen);
            sleepers_.fetch_sub(1);
            t0 = std::chrono::steady_clock::now();
          }
        }
      }
      seen = g;
      if (stop_.load()) return;
      if (w >= int(g & 0xff)) continue;  // not a participant, or a job being set up
      // Snapshot of the job, valid when the word is unchanged afterwards (seqlock). A worker that is
      // late finds every block of its job claimed already and runs nothing.
      const Job job{fn_.load(std::memory_order_relaxed),
                    ctx_.load(std::memory_order_relaxed),
                    n_.load(std::memory_order_relaxed),
                    per_.load(std::memory_order_relaxed),
                    int(g & 0xff),
                    tag_.load(std::memory_order_relaxed)};
      std::atomic_thread_fence(std::memory_order_acquire);
      if (word_.load(std::memory_order_relaxed) != g) continue;
      work(job, w);
    }
  }

  std::mutex busy_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> word_{0};  ///< generation << 8 | participants
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> done_{0};  ///< blocks finished in the current job
  std::atomic<bool> stop_{false};
  std::atomic<void (*)(void*, int64_t)> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0}, per_{1};
  uint64_t generation_ = 0;                  ///< jobs started (under busy_); the current job's tag
  std::atomic<uint64_t> tag_{0};             ///< the published job's tag (read under the seqlock)
  std::atomic<uint64_t> claim_[kMaxBlocks];  ///< tag of the job that claimed each block
  std::atomic<uint64_t> started_[256];       ///< tag of the last job each participant began
};

}  // namespace dgps::cpu::kernels
