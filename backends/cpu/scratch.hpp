/// @brief Scratch memory of the CPU leaf kernels: padded row strides, per-task blocks and the per-thread kept block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Row stride (elements) for scratch matrices of n-element rows (n a multiple of the vector length):
/// n, plus one cache line when the rows would span an even number of lines. Rows a power-of-two
/// number of lines apart map to a fraction of L1's sets (a 128 x 128 float state's 32-column panel,
/// 256 lines, onto 16 of 64 sets: more lines per set than L1 has ways), so the products streaming a
/// panel of such a matrix would reload it from L2.
template <class T>
inline int64_t padded_ld(int64_t n) {
  const int64_t bytes = n * int64_t(sizeof(T));
  return bytes % 64 == 0 && (bytes / 64) % 2 == 0 ? n + 64 / int64_t(sizeof(T)) : n;
}

/// A zero-initialised, 64-byte aligned scratch block owned by one task.
template <class T>
struct Scratch {
  T* base = nullptr;
  explicit Scratch(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    base = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (base) std::memset(base, 0, bytes);
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

/// Like Scratch, but with 16 KB of inline (stack) storage used when the block fits: a one-token
/// decode task takes a microsecond or two, and an allocation per task showed in its profile.
template <class T>
struct SmallScratch {
  alignas(64) unsigned char local[16384];
  void* heap = nullptr;
  T* base = nullptr;
  explicit SmallScratch(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    if (bytes <= sizeof(local)) {
      base = reinterpret_cast<T*>(local);
    } else {
      heap = std::aligned_alloc(64, bytes);
      base = static_cast<T*>(heap);
    }
    if (base) std::memset(static_cast<void*>(base), 0, bytes);
  }
  ~SmallScratch() { std::free(heap); }
  SmallScratch(const SmallScratch&) = delete;
  SmallScratch& operator=(const SmallScratch&) = delete;
};

/// Scratch memory of one chunkwise task (forward or backward): 64-byte aligned, left uninitialised
/// (the user writes every element it reads first, or zeroes the block). Up to kKeepBytes it is a
/// block kept by the calling thread across tasks and calls (grown on demand, freed at thread exit): a
/// fresh multi-megabyte block per task paid a page fault per 4 KB on first touch. A larger request (a
/// long sequence) gets a block of its own, freed with the loan, so that no thread keeps more than
/// kKeepBytes alive. One loan at a time per thread (the chunkwise tasks run no nested parallel work).
template <class T>
class ScratchLease {
 public:
  static constexpr size_t kKeepBytes = size_t(64) << 20;
  explicit ScratchLease(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    if (bytes > kKeepBytes) {
      own_ = allocate(bytes);
      ptr_ = own_;
      return;
    }
    Block& blk = kept();
    if (bytes > blk.bytes) {
      std::free(blk.ptr);
      blk.ptr = nullptr;
      blk.bytes = 0;
      blk.ptr = allocate(bytes);
      blk.bytes = bytes;
    }
    ptr_ = blk.ptr;
  }
  ~ScratchLease() { std::free(own_); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  /// The block.
  T* get() const { return static_cast<T*>(ptr_); }

 private:
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Block() { std::free(ptr); }
  };
  static Block& kept() {
    thread_local Block blk;
    return blk;
  }
  static void* allocate(size_t bytes) {
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* ptr_ = nullptr;
  void* own_ = nullptr;
};

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
