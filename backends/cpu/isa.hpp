/// @brief Internal: the entry points every per-ISA leaf-kernel translation unit exports.
#pragma once

#include <cstdint>

#include "dgps/cpu/kernels.hpp"

namespace dgps::cpu::kernels {

/// One instruction set's compiled kernels. Each task is independent; tasks are numbered
/// (n * ceil(HV / group) + hv / group) * vsplit + value-column block (chunkwise forward: value heads
/// in groups of `group`), n * ceil(H / group) + h / group (chunkwise backward: key heads in groups of
/// `group`) or n * H + h (decode, one task per key-head group).
struct IsaKernels {
  const char* name;
  void (*chunk_task)(const KernelParams&, int64_t task, int64_t vsplit, int64_t group);
  void (*decode_task)(const KernelParams&, int64_t task);
  /// Chunkwise backward of the key heads [h0, h0 + nh) of sequence n (each with its group of value
  /// heads); stores the dcenter term of key head h0 + j in dcenter[j] (0 without a diagonal
  /// preconditioner). group > 1 only with a training cache and HV = H.
  void (*backward_task)(const KernelParams&, int64_t task, int64_t group, double* dcenter);
  /// Backward of the exact preconditioners (exact_backward.hpp) of task n * H + h: (sequence n, key head h).
  void (*exact_backward_task)(const KernelParams&, int64_t task);
  /// Test hook: the vectorised squash (SPEC §2) of the n statistics A (n a multiple of 8 float vectors) by each
  /// path, into out[k * n + i]: k = 0 squash_vn (8 vectors at a time, squash_v where it declines), 1 squash_v,
  /// 2 squash_inplace, 3 and 4 the squash and its slope dM/dA from squash_slope.
  void (*squash_lanes)(const float* A, int64_t n, float center, float log_x, float eps, float* out);
};

/// Defined in kernel_<isa>.cpp (only for the instruction sets this build compiles); exported from a shared build for
/// the tests that call one unit directly (tests/cpu/test_cpu_simd.cpp).
namespace avx512 { DGPS_API IsaKernels table(); }
namespace avx2 { DGPS_API IsaKernels table(); }
namespace neon64 { DGPS_API IsaKernels table(); }
namespace generic { DGPS_API IsaKernels table(); }

}  // namespace dgps::cpu::kernels
