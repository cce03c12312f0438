/// @brief The chunkwise forward's launchers (SPEC §4): statistics, intra-chunk kernel and state pass per call.
///
/// The kernels: precond_stats.cuh, intra_chunk.cuh, state_pass.cuh, state_pass_wg.cuh.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include <cuda.h>  // CUtensorMap (types only: the driver's encoder is found at run time)
#include <cudaTypedefs.h>

#include "launch/chunk.cuh"
#include "kernels/intra_chunk.cuh"
#include "kernels/precond_stats.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/state_pass.cuh"
#include "kernels/state_pass_wg.cuh"
#include "kernels/tiles.cuh"
#include "ptx/wgmma.cuh"

// Internal linkage: each input type's translation unit has its own copy of the non-template kernels.
namespace dgps::cuda::kernels::chunk {
namespace {

using namespace layout;

/// Sets the dynamic shared memory limit of kernel `f` once per process.
template <class F>
cudaError_t allow_smem(F* f, size_t bytes) {
  return cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <class Tin, class Op, int VT, int WARPS = 4, int NBUF = 2>
cudaError_t launch_state(const ChunkArgs& ca, cudaStream_t stream) {
  constexpr size_t bytes = state_smem_bytes(VT, NBUF);
  constexpr int threads = WARPS * 32 + (WARPS == 4 ? 32 : 0);
  const dim3 grid(ca.Vpad / VT, ca.a.HV, ca.a.N);
  if (ca.bwd) {
    static const cudaError_t set = allow_smem(state_kernel<Tin, Op, VT, WARPS, true, NBUF>, bytes);
    if (set != cudaSuccess) return set;
    state_kernel<Tin, Op, VT, WARPS, true, NBUF><<<grid, threads, bytes, stream>>>(ca);
  } else {
    static const cudaError_t set = allow_smem(state_kernel<Tin, Op, VT, WARPS, false, NBUF>, bytes);
    if (set != cudaSuccess) return set;
    state_kernel<Tin, Op, VT, WARPS, false, NBUF><<<grid, threads, bytes, stream>>>(ca);
  }
  return cudaGetLastError();
}

/// True when kernel f runs as sm_90a code on this device (built for it, a Hopper GPU). Stricter than
/// sm90_kernels(), which assumes the default build: the decode's sm_90a-only instructions are no-ops
/// elsewhere, but this kernel's body is empty outside the sm_90a build.
template <class F>
bool runs_sm90a(F* f) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, f) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion == 90;
}

/// True when the warpgroup state pass with 64 x WGS value columns runs here (sm_90a code, the shared
/// memory it needs).
template <class Tin, class Op, int WGS>
bool state_wg_runs() {
  static const bool runs = runs_sm90a(state_wg_kernel<Tin, Op, WGS>) && wg_smem_bytes(64 * WGS) <= chunk_max_smem();
  return runs;
}

/// Launches the warpgroup state pass's instance MODE with 64 x WGS value columns (where state_wg_runs); with
/// ChunkArgs::split, a block per segment (TR: pass 1, two per segment but the last).
template <class Tin, class Op, int WGS, bool TR, int MODE>
cudaError_t launch_state_wg_mode(const ChunkArgs& ca, const CUtensorMap& tq, const CUtensorMap& tk,
                                 const CUtensorMap& tv, cudaStream_t stream) {
  constexpr size_t bytes = wg_smem_bytes(64 * WGS);
  auto* kernel = state_wg_kernel<Tin, Op, WGS, TR, MODE>;
  static const cudaError_t set = allow_smem(kernel, bytes);
  if (set != cudaSuccess) return set;
  const unsigned segs = ca.split > 1 ? ca.split - TR : 1;
  const dim3 grid(TR ? 2 : ca.Vpad / (64 * WGS), ca.a.HV, ca.a.N * segs);
  kernel<<<grid, WGS * 128 + (MODE & kWgKW ? 128 : 0), bytes, stream>>>(ca, tq, tk, tv);
  return cudaGetLastError();
}
/// Launches the warpgroup state pass (launch_state_wg_mode) in the instance of the call's decay and residual:
/// Diagonal decay or not, raw v rows (16-bit inputs, 128 columns) or W and U. cudaErrorInvalidValue where
/// no instance applies (the split pass without raw v rows, or with kw_state).
template <class Tin, class Op, int WGS, bool TR = false>
cudaError_t launch_state_wg(const ChunkArgs& ca, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv,
                            cudaStream_t stream) {
  const bool diag = ca.a.decay == kDecayDiagonal;
  if constexpr (WGS == 2 && !std::is_same_v<Tin, float>) {  // raw v rows: 16-bit inputs, 128 columns
    if (ca.raw_v && diag) return launch_state_wg_mode<Tin, Op, WGS, TR, kWgDiag | kWgRawV>(ca, tq, tk, tv, stream);
    if (ca.raw_v && ca.kw_state) {
      if constexpr (TR)
        return cudaErrorInvalidValue;  // (kw_state: never in the split pass)
      else
        return launch_state_wg_mode<Tin, Op, WGS, false, kWgRawV | kWgKW>(ca, tq, tk, tv, stream);
    }
    if (ca.raw_v) return launch_state_wg_mode<Tin, Op, WGS, TR, kWgRawV>(ca, tq, tk, tv, stream);
  }
  if constexpr (!TR) {
    if (!ca.raw_v)
      return diag ? launch_state_wg_mode<Tin, Op, WGS, false, kWgDiag>(ca, tq, tk, tv, stream)
                  : launch_state_wg_mode<Tin, Op, WGS, false, 0>(ca, tq, tk, tv, stream);
  }
  return cudaErrorInvalidValue;
}

/// The split state pass's scan (ChunkArgs::split): the state entering each segment of each (sequence,
/// value head), S_0 = h0 and S_{j+1} = A_j S_j + B_j with pass 1's A_j^T and B_j^T (Tseg), into Sseg
/// (transposed, like the warpgroup pass's accumulators), up to the sequence's last segment. Float32 on the
/// CUDA cores; a block per (sequence, value head) and kScanCols value columns, two threads per key (8
/// columns each). A_{j+1}^T is copied into shared memory (cp.async, two buffers of 64 KB) while step j
/// computes: one memory round trip per step.
constexpr int kScanCols = 16;
constexpr size_t kScanSmem = sizeof(float) * (2 * KP * KP + KP * kScanCols);
__global__ void __launch_bounds__(2 * KP) split_scan_kernel(const ChunkArgs ca) {
  constexpr int CW = kScanCols / 2;
  const RecArgs& a = ca.a;
  const int nh = blockIdx.x, n = nh / a.HV, hv = nh % a.HV, k = threadIdx.x % KP;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int last = split_last_segment(ca, count);  // (packed sequences: fewer segments than ca.split)
  const int c0 = blockIdx.y * kScanCols + CW * (threadIdx.x / KP), cl = c0 % kScanCols;
  extern __shared__ __align__(16) float scan_smem[];
  float* sA = scan_smem;                     // two buffers of A_j^T [KP][KP]
  float* sS = scan_smem + 2 * KP * KP;       // S_j [KP][kScanCols]
  const float* T0 = ca.Tseg + int64_t(nh) * (ca.split - 1) * 2 * KP * KP;  // A_j^T at T0 + 2 j KP KP, then B_j^T
  auto load = [&](int j) {
    const float* src = T0 + int64_t(j) * 2 * KP * KP;
    float* dst = sA + (j & 1) * KP * KP;
    for (int e = threadIdx.x; e < KP * KP / 4; e += 2 * KP) cp_async16(dst + 4 * e, src + 4 * e);
    cp_commit();
  };
  if (last > 0) load(0);
  float s[CW];
#pragma unroll
  for (int c = 0; c < CW; ++c)
    s[c] = a.h0 && k < a.K && c0 + c < a.V ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + k * a.sh0[2] + c0 + c] : 0.f;
  for (int j = 0;; ++j) {
    float* d = ca.Sseg + (int64_t(nh) * ca.split + j) * KP * KP + int64_t(c0) * KP + k;
#pragma unroll
    for (int c = 0; c < CW; ++c) d[c * KP] = s[c];
    if (j == last) break;
    __syncthreads();  // every thread is done with S_{j-1} and A_{j-1}'s buffer
#pragma unroll
    for (int c = 0; c < CW; ++c) sS[k * kScanCols + cl + c] = s[c];
    const float* Bt = T0 + (int64_t(j) * 2 + 1) * KP * KP + int64_t(c0) * KP + k;
#pragma unroll
    for (int c = 0; c < CW; ++c) s[c] = Bt[c * KP];
    if (j + 1 < last) {
      load(j + 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();  // A_j and S_j in shared memory
    const float* At = sA + (j & 1) * KP * KP + k;  // At[k' KP] = A_j[k][k']
#pragma unroll 4
    for (int kk = 0; kk < KP; ++kk) {
      const float x = At[kk * KP];
      const float4* row = reinterpret_cast<const float4*>(sS + kk * kScanCols + cl);
#pragma unroll
      for (int c = 0; c < CW / 4; ++c) {
        const float4 y = row[c];
        s[4 * c] = fmaf(x, y.x, s[4 * c]);
        s[4 * c + 1] = fmaf(x, y.y, s[4 * c + 1]);
        s[4 * c + 2] = fmaf(x, y.z, s[4 * c + 2]);
        s[4 * c + 3] = fmaf(x, y.w, s[4 * c + 3]);
      }
    }
  }
}

/// The driver's cuTensorMapEncodeTiled, found once through the runtime (nothing links against the
/// driver library); null where the driver does not have it.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

/// True when the forward's sequential pass of `ca` can run state_wg_kernel (chunk_wg_pass).
template <class Tin, class Op>
bool wg_pass_runs(const ChunkArgs& ca) {
  return !ca.bwd && ca.state_vt >= 64 &&
         (ca.state_vt == 128 ? state_wg_runs<Tin, Op, 2>() : state_wg_runs<Tin, Op, 1>());
}

/// A tensor map over the 16-bit rows of q, k or v ([N, T, H, 128] with element strides s; K = 128,
/// 16-byte aligned rows) whose box is one chunk's tile of one head in the packed blocked layout:
/// dimensions (8 channels, T tokens, 16 channel groups, H, N), box (8, C, 16, 1, 1), so that the box
/// lands as 16 column groups of C rows x 16 bytes. Returns false where the map cannot be made.
inline bool raw_rows_map(CUtensorMap* m, const void* base, const int64_t* s, int64_t T, int H, int N, bool f16) {
  const auto fn = encode_tiled();
  if (!fn || T > INT32_MAX) return false;  // the copies' coordinates are 32-bit
  const cuuint64_t dim[5] = {8, cuuint64_t(T), KP / 8, cuuint64_t(H), cuuint64_t(N)};
  const cuuint64_t stride[4] = {cuuint64_t(s[1]) * 2, 16, cuuint64_t(s[2]) * 2, cuuint64_t(s[0]) * 2};  // bytes
  const cuuint32_t box[5] = {8, C, KP / 8, 1, 1}, step[5] = {1, 1, 1, 1, 1};
  for (const cuuint64_t x : stride)
    if (x % 16 != 0 || x == 0 || x >= (cuuint64_t(1) << 40)) return false;
  return fn(m, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, const_cast<void*>(base),
            dim, stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// Launches an instance of the intra-chunk kernel with `bytes` of dynamic shared memory (its limit raised
/// once per instance, to the largest layout's), as a programmatic dependent launch where `dependent`.
template <auto Kernel>
cudaError_t launch_intra(const ChunkArgs& c, dim3 grid, size_t bytes, cudaStream_t stream, bool dependent) {
  static const cudaError_t set = allow_smem(Kernel, intra_smem_bytes(true, true));
  if (set != cudaSuccess) return set;
  return launch_ex(Kernel, grid, dim3(kThreads), bytes, stream, dependent, dim3(1, 1, 1), c);
}

/// Blocks of the persistent precond_sums_kernel instance `kernel`: `forced` when positive (Plan::sums_blocks),
/// else as many as fit on the device at once (six per SM on Hopper: its two 16 KB buffers).
int precond_sums_blocks(const void* kernel, int forced) {
  if (forced > 0) return forced;
  int per = 0;
  const int sms = sm_count();
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, kThreads, 0) != cudaSuccess) per = 1;
  return sms * std::max(per, 1);
}

/// Launches the chunkwise kernels of `ca` with the launch choices of `plan` (plan_chunkwise: layouts, grid
/// sizes, dependent launches); clears plan.tma where a tensor map cannot be made.
template <class Tin, class Op>
cudaError_t launch_all(const ChunkArgs& ca, Plan& plan, cudaStream_t stream) {
  const RecArgs& a = ca.a;
  if (ca.chunk_bound == 0) return cudaSuccess;
  if (a.cu_seqlens) chunk_map_kernel<<<1, 256, 0, stream>>>(ca);
  if (ca.lookback) {  // (a diagonal preconditioner's statistics by the intra-chunk kernel: its words zeroed)
    const cudaError_t e = cudaMemsetAsync(ca.lb, 0, lookback_bytes(ca), stream);
    if (e != cudaSuccess) return e;
  } else if (a.precond != kPrecondIdentity) {
    const int64_t items = ca.chunk_bound * a.H;
    constexpr auto sums = precond_sums_kernel<Tin, Op>;
    const int blocks = precond_sums_blocks(reinterpret_cast<const void*>(sums), plan.sums_blocks);
    sums<<<static_cast<unsigned>(std::min<int64_t>(items, blocks)), kThreads, 0, stream>>>(ca);
    const cudaError_t e =
        launch_ex(precond_scan_kernel, dim3(a.N, a.H), dim3(kThreads), 0, stream, plan.pdl, dim3(1, 1, 1), ca);
    if (e != cudaSuccess) return e;
  }
  // Hopper: the warpgroup state pass (ChunkArgs::blocked, the plan's choice), which this build must have.
  const bool wg_pass = ca.blocked;
  if (wg_pass && !wg_pass_runs<Tin, Op>(ca)) return cudaErrorInvalidValue;
  if (ca.raw_v && !wg_pass) return cudaErrorInvalidValue;  // the workspace has no W and U for another pass
  ChunkArgs c = ca;
  c.tma_rows = false;  // (set below where the tensor maps are made)
  const bool diag = a.decay == kDecayDiagonal;
  // (the look-back's grid is one-dimensional: lookback_item)
  const dim3 grid = ca.lookback ? dim3(static_cast<unsigned>(ca.chunk_bound * a.HV))
                                : dim3(static_cast<unsigned>(ca.chunk_bound), a.HV);
  // After the statistics' scan, a programmatic dependent launch (Hopper): the blocks stage their q and k
  // rows while the scan finishes.
  const bool dependent = a.precond != kPrecondIdentity && !ca.lookback && plan.pdl;
  const int quad = plan.quad;
  constexpr auto quad_id = intra_kernel<Tin, Op, false, kQuadIdentity>;
  constexpr auto quad_atk = intra_kernel<Tin, Op, false, kQuadATK>;
  const size_t bytes = diag && ca.raw_v           ? intra_lean_smem_bytes()
                       : quad                     ? intra_quad_smem_bytes(quad == kQuadATK)
                                                  : intra_smem_bytes(a.precond == kPrecondATK, diag);
  cudaError_t e;
  if (diag && ca.raw_v)
    e = launch_intra<intra_kernel<Tin, Op, true>>(c, grid, bytes, stream, dependent);
  else if (quad == kQuadIdentity)
    e = launch_intra<quad_id>(c, grid, bytes, stream, dependent);
  else if (quad == kQuadATK)
    e = launch_intra<quad_atk>(c, grid, bytes, stream, dependent);
  else
    e = launch_intra<intra_kernel<Tin, Op>>(c, grid, bytes, stream, dependent);
  if (e != cudaSuccess) return e;
  if (wg_pass) {
    // Raw q and k rows by tensor copies where their maps can be made (B = 0 for packed sequences, whose
    // tokens all lie in one row of the map).
    CUtensorMap tq{}, tk{}, tv{};
    const bool f16 = std::is_same_v<Op, __half>;
    const int n_map = a.cu_seqlens ? 1 : a.N;
    c.tma_rows = ca.tma_rows && (!ca.raw_q || raw_rows_map(&tq, a.q, a.sq, a.T, a.H, n_map, f16)) &&
                 (!(ca.raw_kw || (ca.raw_v && ca.raw_q)) || raw_rows_map(&tk, a.k, a.sk, a.T, a.H, n_map, f16)) &&
                 (!ca.raw_v || raw_rows_map(&tv, a.v, a.sv, a.T, a.HV, n_map, f16));
    plan.tma = c.tma_rows;
    const bool split = ca.split > 1;
    if constexpr (!std::is_same_v<Tin, float>) {  // (raw v rows: 16-bit inputs only)
      if (split) {  // pass 1, the scan, pass 2
        if (ca.state_vt != 128 || !ca.raw_v) return cudaErrorInvalidValue;
        const cudaError_t e1 = launch_state_wg<Tin, Op, 2, true>(c, tq, tk, tv, stream);
        if (e1 != cudaSuccess) return e1;
        static const cudaError_t scan_set = allow_smem(split_scan_kernel, kScanSmem);
        if (scan_set != cudaSuccess) return scan_set;
        split_scan_kernel<<<dim3(a.N * a.HV, KP / kScanCols), 2 * KP, kScanSmem, stream>>>(c);
        const cudaError_t e2 = cudaGetLastError();
        if (e2 != cudaSuccess) return e2;
      }
    } else if (split) {
      return cudaErrorInvalidValue;
    }
    return ca.state_vt == 128 ? launch_state_wg<Tin, Op, 2>(c, tq, tk, tv, stream)
                              : launch_state_wg<Tin, Op, 1>(c, tq, tk, tv, stream);
  }
  switch (ca.state_vt) {
    case 128:
      return launch_state<Tin, Op, 128, 8>(ca, stream);
    case 64:
      return launch_state<Tin, Op, 64>(ca, stream);
    case 32:
      return launch_state<Tin, Op, 32>(ca, stream);
    default: break;
  }
  // Three buffers (the producer two chunks ahead) where they fit (Hopper), else two.
  if (state_smem_bytes(16, 3) <= chunk_max_smem()) return launch_state<Tin, Op, 16, 4, 3>(ca, stream);
  return launch_state<Tin, Op, 16>(ca, stream);
}

/// The backward's entry (launch/chunk_backward_launch.cuh): the intra-chunk kernel and the state pass of a
/// backward-mode `ca` (no warpgroup pass, no quad layout, the sums kernel's default grid), named in `impl`.
template <class Tin, class Op>
cudaError_t launch_all(const ChunkArgs& ca, cudaStream_t stream, const char** impl) {
  Plan plan = plan_backward_mode(ca);
  const cudaError_t e = launch_all<Tin, Op>(ca, plan, stream);
  *impl = impl_name(plan);
  return e;
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk

namespace dgps::cuda::kernels {

template <class Tin>
bool chunk_wg_pass(const ChunkArgs& c) {
  using Op = std::conditional_t<std::is_same_v<Tin, __half>, __half, __nv_bfloat16>;
  return chunk::wg_pass_runs<Tin, Op>(c);
}

template <class Tin>
cudaError_t launch_chunkwise(const ChunkArgs& c, Plan& plan, cudaStream_t stream) {
  using Op = std::conditional_t<std::is_same_v<Tin, __half>, __half, __nv_bfloat16>;
  return chunk::launch_all<Tin, Op>(c, plan, stream);
}

}  // namespace dgps::cuda::kernels
