/// @brief The recurrent kernel's launch arguments (flat, device pointers and int64 strides) and launchers.
#pragma once

#include <cstdint>
#include <cstdlib>

#include <cuda_runtime.h>

namespace dgps::cuda::kernels {

/// True when the environment variable `name` (a testing and benchmarking knob) is exactly "0".
inline bool knob_off(const char* name) {
  const char* e = std::getenv(name);
  return e && e[0] == '0' && e[1] == 0;
}

/// Decay kinds as the kernels see them (SPEC §2).
enum DecayKind : int { kDecayNone = 0, kDecayScalar = 1, kDecayDiagonal = 2 };
/// Preconditioner kinds as the kernels see them (SPEC §2; exact kinds are not supported).
enum PrecondKind : int { kPrecondIdentity = 0, kPrecondATK = 1, kPrecondATQ = 2 };

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
};

/// Launches the recurrent forward over every (sequence, value head, value tile) with input type Tin
/// (float, __nv_bfloat16 or __half). Returns the launch's error code and names the variant in `impl`.
template <class Tin>
cudaError_t launch_recurrent(const RecArgs& a, cudaStream_t stream, const char** impl);

/// Launches the forward: the block-row kernel (16-byte state rows) when possible, else the warp kernel.
template <class Tin>
cudaError_t launch_forward(const RecArgs& a, cudaStream_t stream, const char** impl);

/// Launches the decode kernels (a few tokens per sequence, states in place through h0/a0 = hT/aT;
/// with a diagonal preconditioner a.a_copy is scratch for N * H * K floats). `warp`: the warp kernel.
template <class Tin>
cudaError_t launch_decode(const RecArgs& a, cudaStream_t stream, const char** impl, bool warp = false);

/// Copies a[slots[n], h, :] of a state pool into dst[n, h, :] (contiguous), before an in-place decode.
cudaError_t launch_gather_precond_state(const float* a, const int64_t* sa, const int64_t* slots, int N, int H, int K,
                                        float* dst, cudaStream_t stream);

}  // namespace dgps::cuda::kernels
