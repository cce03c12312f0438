/// @brief Memory traffic of the CPU chunkwise kernels spread over their arithmetic: prefetches and non-temporal copies.
#pragma once

#include <cstdint>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// ---------------------------------------------------------------------------------------------
// Training cache (KernelParams::saved): written once by the forward, read back by the backward much
// later, so the forward writes it with non-temporal stores (no read for ownership, and the task's
// working set stays in the caches).

/// dst[r * ldd + j] = src[r * lds + j] for r < rows, j < n: n a multiple of the vector length, dst and
/// ldd aligned to the vector.
template <class T>
void stream_rows(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t n) {
  constexpr int L = Vec<T>::L;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; j += L) stream_store(dst + r * ldd + j, vload(src + r * lds + j));
}

/// Memory traffic spread over the arithmetic: prefetches of rows that a later step reads and copies
/// into the training cache (non-temporal) or into outputs, issued a bounded number of bytes at a time
/// by `step()`, which the main products call once per register block. Issued at once, either stalls
/// the core on its line fill buffers (each chunk's inputs and cache blocks are ~100-200 KB). Jobs run
/// in the order they were added; `drain(j)` finishes job j and those before it.
template <class T>
class Trickle {
 public:
  static constexpr int kMaxJobs = 16;
  /// Prefetches `rows` rows of `row_bytes` bytes, `stride` bytes apart, into L2; `write`: for writing
  /// (an output row: the store then finds the line owned instead of waiting for it).
  int prefetch(const void* base, int64_t stride, int64_t rows, int64_t row_bytes, bool write = false) {
    if (rows <= 0 || row_bytes <= 0 || n_ == kMaxJobs) return -1;
    jobs_[n_] = Job{static_cast<const char*>(base), nullptr, stride, 0, rows, row_bytes, 0, 0, false, write};
    pending_ += rows * round_up(row_bytes, 64);
    return n_++;
  }
  /// dst[r * ldd + j] = src[r * lds + j] for r < rows, j < n (a multiple of the vector length; dst
  /// and ldd aligned to the vector), with non-temporal stores.
  int copy(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t n) {
    if (rows <= 0 || n <= 0) return -1;
    if (n_ == kMaxJobs) {  // full: copy now
      stream_rows(dst, ldd, src, lds, rows, n);
      return -1;
    }
    jobs_[n_] = Job{reinterpret_cast<const char*>(src), dst, lds, ldd, rows, n, 0, 0, true, false};
    pending_ += rows * n * int64_t(sizeof(T));
    return n_++;
  }
  /// Starts a phase of about `steps` calls of step(): the bytes pending plus `extra` bytes of jobs
  /// still to come are spread over them.
  void plan(int64_t steps, int64_t extra = 0) {
    budget_ = imin(int64_t(8192), round_up((pending_ + extra) / (steps > 0 ? steps : 1) + 1, 64));
    steps_ = 0;
  }
  /// Calls of step() since plan().
  int64_t steps() const { return steps_; }
  /// Issues up to the budget's bytes of the pending jobs.
  void step() {
    ++steps_;
    int64_t left = budget_;
    while (left > 0 && head_ < n_) left -= advance(jobs_[head_], left);
  }
  /// Finishes job j (and every job before it); j < 0 does nothing.
  void drain(int j) {
    while (j >= 0 && head_ <= j && head_ < n_) advance(jobs_[head_], int64_t(1) << 60);
  }
  /// Finishes every job and forgets them.
  void drain_all() {
    drain(n_ - 1);
    head_ = n_ = 0;
    pending_ = 0;
  }

 private:
  struct Job {
    const char* src;
    T* dst;
    int64_t lds, ldd, rows, len;  // prefetch: lds in bytes, len = row bytes; copy: elements
    int64_t r, off;
    bool copy, write;
  };
  /// Works on the head job for up to `bytes` bytes; returns the bytes done (moves on when it is done).
  int64_t advance(Job& j, int64_t bytes) {
    int64_t done = 0;
    if (j.copy) {
      constexpr int L = Vec<T>::L;
      const T* src = reinterpret_cast<const T*>(j.src);
      while (done < bytes && j.r < j.rows) {
        stream_store(j.dst + j.r * j.ldd + j.off, vload(src + j.r * j.lds + j.off));
        done += L * int64_t(sizeof(T));
        if ((j.off += L) >= j.len) j.off = 0, ++j.r;
      }
    } else {
      while (done < bytes && j.r < j.rows) {
        if (j.write)
          __builtin_prefetch(j.src + j.r * j.lds + j.off, 1, 2);
        else
          __builtin_prefetch(j.src + j.r * j.lds + j.off, 0, 2);
        done += 64;
        if ((j.off += 64) >= j.len) j.off = 0, ++j.r;
      }
    }
    pending_ -= done;
    if (j.r >= j.rows) ++head_;
    return done > 0 ? done : 1;
  }
  Job jobs_[kMaxJobs];
  int n_ = 0, head_ = 0;
  int64_t pending_ = 0, budget_ = 512, steps_ = 0;
};

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
