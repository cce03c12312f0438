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
};

/// Defined in kernel_<isa>.cpp (only for the instruction sets this build compiles).
namespace avx512 { IsaKernels table(); }
namespace avx2 { IsaKernels table(); }
namespace generic { IsaKernels table(); }

}  // namespace dgps::cpu::kernels
