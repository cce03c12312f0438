/// @brief The sequential passes' warp-specialised copy pipeline (ProducerPipe) and the compute warps' named barrier.
#pragma once

#include <cstdint>

namespace dgps::cuda::kernels::chunk {
namespace {

/// The tile buffers of the sequential passes, warp-specialised: one producer warp copies each
/// chunk's tiles (cp.async) ahead while the NT compute threads work, so the compute warps issue no
/// copies (with one warp per scheduler, copy loops take a large share of the compute warps' issue). The hand-
/// offs are named barriers (hardware barriers, which compute-sanitizer's racecheck follows): FULL b
/// (the producer arrives once its copies into buffer b have landed, the compute warps sync) and EMPTY
/// b (compute warp 0 arrives once the compute warps are done with buffer b, the producer syncs).
/// Chunk j of the pass (in its order) uses buffer j % NBUF for the (j / NBUF)-th time. With three
/// buffers the producer keeps two fills in flight. Barrier ids: 1 is sync_compute's, 2 .. 2 + 2 NBUF
/// these.
template <int NBUF, int NT>
struct ProducerPipe {
  static_assert(NBUF >= 2 && 2 + 2 * NBUF <= 16, "named barriers");
  /// The buffer and its use count of one chunk of the pass.
  struct Slot {
    int buf = 0;
    int64_t use = 0;
    __device__ __forceinline__ void next() {
      if (++buf == NBUF) buf = 0, ++use;
    }
  };
  /// Compute threads: waits for the copies of slot s.
  __device__ __forceinline__ static void wait_full(Slot s) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(2 + s.buf), "n"(NT + 32) : "memory");
  }
  /// Compute threads, after their barrier that follows the last read of chunk j's buffer: frees it
  /// for chunk j + NBUF (if the pass has one; count: the pass's chunks).
  __device__ __forceinline__ static void release(Slot s, int64_t j, int64_t count) {
    if (threadIdx.x < 32 && j + NBUF < count) asm volatile("bar.arrive %0, 64;\n" ::"r"(2 + NBUF + s.buf) : "memory");
  }
  /// The producer warp: for each chunk ci of the pass (in order, `count` of them), `issue(ci, buffer)`
  /// starts its copies into the buffer (cp.async, not committed).
  template <class Issue>
  __device__ __forceinline__ static void produce(int64_t count, Issue&& issue) {
    Slot slot, prev;
    for (int64_t j = 0; j < count; ++j) {
      if (slot.use > 0) asm volatile("bar.sync %0, 64;\n" ::"r"(2 + NBUF + slot.buf) : "memory");
      issue(j, slot.buf);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      if (NBUF >= 3 && j > 0) {  // the previous fill has landed: hand it over, keep this one in flight
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        asm volatile("bar.arrive %0, %1;\n" ::"r"(2 + prev.buf), "n"(NT + 32) : "memory");
      } else if (NBUF < 3) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        asm volatile("bar.arrive %0, %1;\n" ::"r"(2 + slot.buf), "n"(NT + 32) : "memory");
      }
      prev = slot;
      slot.next();
    }
    if (NBUF >= 3 && count > 0) {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      asm volatile("bar.arrive %0, %1;\n" ::"r"(2 + prev.buf), "n"(NT + 32) : "memory");
    }
  }
};

/// Barrier of the first NT threads of the block (the compute warps; the producer warp is not in it).
template <int NT>
__device__ __forceinline__ void sync_compute() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
