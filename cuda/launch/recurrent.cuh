/// @brief The recurrent kernel's launch arguments (flat, device pointers and int64 strides) and launchers.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "plan.hpp"

namespace dgps::cuda::kernels {

/// Decay kinds as the kernels see them (SPEC §2).
enum DecayKind : int { kDecayNone = 0, kDecayScalar = 1, kDecayDiagonal = 2 };
/// Preconditioner kinds as the kernels see them (SPEC §2; the exact kinds run only the exact kernels,
/// launch/exact.cuh).
enum PrecondKind : int { kPrecondIdentity = 0, kPrecondATK = 1, kPrecondATQ = 2, kPrecondExactATK = 3, kPrecondExactATQ = 4 };

/// Everything the recurrent kernel reads: raw device pointers, element strides of the first three
/// dimensions of each tensor (the last one is contiguous), sizes and run-time policy switches.
struct RecArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  const void *g_p = nullptr, *beta_p = nullptr, *center = nullptr;
  const float *h0 = nullptr, *a0 = nullptr;
  void* o = nullptr;
  float *hT = nullptr, *aT = nullptr;
  int64_t sq[3]{}, sk[3]{}, sv[3]{}, sg[3]{}, sbeta[3]{}, sgp[3]{}, sbp[3]{}, so[3]{};
  int64_t sh0[3]{}, sa0[3]{}, shT[3]{}, saT[3]{};
  const int64_t* cu_seqlens = nullptr;  ///< [N+1] or null
  const int64_t* slots = nullptr;       ///< [N] state index per sequence, or null
  int64_t T = 0;
  int N = 0, H = 0, HV = 0, K = 0, V = 0, group = 1;
  int decay = kDecayNone, precond = kPrecondIdentity, gate_dtype = 0;
  bool online = true, l2norm = true;
  bool a0_by_sequence = false;  ///< a0 is indexed by sequence (a private copy), not by slot
  /// Decode scratch of N * H * K floats for a private copy of the statistics a0 (where the kernel
  /// cannot order its reads of a0 before the write of aT, see launch_decode), or null.
  float* a_copy = nullptr;
  /// The block-row kernel runs in clusters that hold every block reading a key head's statistics:
  /// they all read a0 before a cluster barrier, the one writing aT (= a0, in place) writes after it.
  bool cluster_a = false;
  float scale = 1, log_x = 0, eps = 0;
  float lambda = 1;  ///< exact preconditioners: P_0 = I / lambda without a0
};

/// Tokens staged per group by the block-row kernel in decode with more than one token (calls normally
/// carry 1 to 4 tokens); the forward stages 8.
constexpr int kDecodeGroup = 4;
/// Warps per block of decode_warp_kernel (32 value columns, the width the block-row kernel takes for
/// small batches).
constexpr int kDecodeWarps = 4;

/// True when the state rows can be moved with 16-byte accesses (V % 4 == 0, aligned rows): the block-row
/// kernels apply.
inline bool rowblock_vectorizable(const RecArgs& a) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return a.V % 4 == 0 && aligned(a.h0) && aligned(a.hT) && a.sh0[0] % 4 == 0 && a.sh0[1] % 4 == 0 &&
         a.sh0[2] % 4 == 0 && a.shT[0] % 4 == 0 && a.shT[1] % 4 == 0 && a.shT[2] % 4 == 0;
}

/// The current device's number of SMs (132, an H100's or H200's, where it cannot be read).
inline int sm_count() {
  int sms = 132, dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

/// True when the current device runs the sm_90a build of the kernels (Hopper), the one compiled with
/// grid_dependency_sync and the cluster barrier. Other GPUs run the portable build (PTX for sm_80,
/// where both are no-ops), so the launches must not ask for dependent scheduling or clusters there.
inline bool sm90_kernels() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major == 9;
}

/// Launches the recurrent forward of `plan` (Plan::Kernel::rowblock or warp) with input type Tin (float,
/// __nv_bfloat16 or __half). Returns the launch's error code.
template <class Tin>
cudaError_t launch_forward(const RecArgs& a, const Plan& plan, cudaStream_t stream);

/// Launches the decode of `plan` (plan_decode: a few tokens per sequence, states in place through h0/a0 =
/// hT/aT; with a diagonal preconditioner a.a_copy is scratch for N * H * K floats).
template <class Tin>
cudaError_t launch_decode(const RecArgs& a, const Plan& plan, cudaStream_t stream);

/// Copies a[slots[n], h, :] of a state pool into dst[n, h, :] (contiguous), before an in-place decode.
/// `dependent`: as a programmatic dependent launch (Plan::pdl).
cudaError_t launch_gather_precond_state(const float* a, const int64_t* sa, const int64_t* slots, int N, int H, int K,
                                        float* dst, cudaStream_t stream, bool dependent);

}  // namespace dgps::cuda::kernels
