/// @brief The warp kernel of SPEC §2: one warp per (sequence, value head, value tile); the fallback for any V.
///
/// Each thread keeps KT/KS rows of one column of the float32 state S (K x V, key-major) in registers;
/// KS threads share a column and reduce their partial dot products with warp shuffles. Tokens are
/// staged L at a time: the warp normalises q and k (SPEC §1), scans the diagonal preconditioner
/// statistics (SPEC §2, paper eq. 9) and stores the read key, write key, read query and decays in
/// shared memory; then it runs the L tokens of the recurrence from there.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "dgps/detail/squash.hpp"
#include "launch/recurrent.cuh"

namespace dgps::cuda::kernels {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

/// The two halves of grid_dependency_sync. grid_dependency_wait: in a programmatic dependent launch,
/// waits until the previous kernel has finished and its writes are visible (no global read of what it
/// writes before it). grid_dependents_launch: lets the next kernel, if launched as a programmatic
/// dependent, be scheduled before this one finishes. Elsewhere (an ordinary launch; the sm_80 build)
/// no-ops.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// In a kernel launched as a programmatic dependent (launch_ex): waits until the previous kernel in
/// the stream has finished and its writes are visible, then lets the next one be scheduled.
/// Elsewhere (an ordinary launch; a no-op in the sm_80 build) it returns at once. Call it before any
/// global read.
__device__ __forceinline__ void grid_dependency_sync() {
  grid_dependency_wait();
  grid_dependents_launch();
}

/// The thread block cluster barrier (sm_90a build), split: arrive (ordering this thread's earlier memory
/// accesses before it) and wait (ordering its later ones after every thread of the cluster arrived).
/// Every thread of every block of the cluster must call both, arrive first. No-ops in the sm_80 build.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

/// Launches `kernel` on `stream` with the launch attributes asked for. `dependent`: as a programmatic
/// dependent launch (the kernel must call grid_dependency_sync() before reading global memory); in a
/// CUDA graph capture it becomes a programmatic edge, so replays keep the early scheduling.
/// `cluster`: thread block cluster dimensions (they divide `grid`; only where sm90_kernels()), or
/// 1 x 1 x 1 for none.
template <class... Params, class... Args>
cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      bool dependent, dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (dependent) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x, attr[n].val.clusterDim.y = cluster.y, attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/// Loads element i of a gate tensor whose element type is chosen at run time (0 f32, 1 bf16, 2 f16).
__device__ __forceinline__ float load_gate(const void* p, int64_t i, int dtype) {
  if (dtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dtype == 2) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

/// Stores element i of a gate gradient whose element type is chosen at run time (0 f32, 1 bf16, 2 f16).
__device__ __forceinline__ void store_gate(void* p, int64_t i, int dtype, float x) {
  if (dtype == 1)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(x);
  else if (dtype == 2)
    static_cast<__half*>(p)[i] = __float2half(x);
  else
    static_cast<float*>(p)[i] = x;
}

/// The squash and its slopes (SPEC §2; dgps/detail/squash.hpp) under the names the backward's kernels call.
using dgps::maths::squash;
__device__ __forceinline__ void squash_slopes(float A, float M, float center, float log_x, float eps, float* dmda,
                                              float* dmdc) {
  *dmda = dgps::maths::squash_slope(A, M, center, log_x, eps, dmdc);
}

template <int KS>
__device__ __forceinline__ float reduce_parts(float x) {
  constexpr int VT = 32 / KS;
#pragma unroll
  for (int m = VT; m < 32; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

/// Backward of the L2 norm and scale (SPEC §1) of one row held by a warp (4 channels per lane):
/// x̂ = x rstd, y = mul x̂: dx = mul rstd (dy - x̂ (x̂·dy)), or mul dy without the norm.
__device__ __forceinline__ void norm_grad(const float* x, float rstd, const float* dy, float mul, bool norm,
                                          float* dx) {
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) dot = fmaf(x[j] * rstd, dy[j], dot);
  dot = norm ? warp_sum(dot) : 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) dx[j] = norm ? mul * rstd * (dy[j] - x[j] * rstd * dot) : mul * dy[j];
}

/// Staged tokens per block.
constexpr int kStage = 16;

/// Shared-memory layout of the recurrent kernel: L staged tokens of each per-channel vector, padded
/// so that the KS parts of a column read different banks. Only the vectors a model needs are present.
template <int KT, int KS>
struct StageLayout {
  static constexpr int R = KT / KS;   // state rows per thread
  static constexpr int RP = R + 4;    // padded rows of one part
  static constexpr int KP = KS * RP;  // padded length of one staged vector
  static constexpr int L = kStage;
  /// Bytes of dynamic shared memory: k and q always, kw for DiagonalATK, exp(g) for Diagonal decay.
  static size_t bytes(bool atk, bool diag) {
    return sizeof(float) * size_t(L) * KP * (2 + (atk ? 1 : 0) + (diag ? 1 : 0));
  }
};

template <class Tin, int KT, int KS>
__global__ void __launch_bounds__(32) recurrent_kernel(const RecArgs a) {
  using Lay = StageLayout<KT, KS>;
  constexpr int R = Lay::R, RP = Lay::RP, KP = Lay::KP, L = Lay::L;
  constexpr int VT = 32 / KS;   // value columns per warp
  constexpr int CPL = KT / 32;  // channels per lane in the cooperative phases
  extern __shared__ __align__(16) float smem[];
  // Raw (not yet normalised) k and q of the staged tokens; kw = k ⊙ M normalised (DiagonalATK);
  // exp(g) per channel (Diagonal decay).
  float* s_k = smem;
  float* s_q = s_k + L * KP;
  float* s_kw = s_q + L * KP;
  float* s_dg = s_kw + (a.precond == kPrecondATK ? L * KP : 0);
  __shared__ float s_v[L][VT], s_dec[L], s_beta[L], s_gp[L], s_bp[L], s_rk[L], s_rq[L];
  grid_dependency_sync();  // launched as a programmatic dependent: the previous kernel's writes

  const int lane = threadIdx.x;
  const int part = lane / VT, col = lane % VT;
  const int n = blockIdx.z, hv = blockIdx.y;
  const int h = hv / a.group;
  const int vcol = blockIdx.x * VT + col;
  const bool vok = vcol < a.V;
  const int K = a.K;

  int64_t bos = 0, len = a.T, b = n;
  if (a.cu_seqlens) {
    bos = a.cu_seqlens[n];
    len = a.cu_seqlens[n + 1] - bos;
    b = 0;
  }
  const int64_t sidx = a.slots ? a.slots[n] : n;

  // State rows part*R .. part*R+R-1 of column vcol (SPEC §1: S[k][v], key-major).
  float S[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int c = part * R + i;
    S[i] = (a.h0 && vok && c < K) ? a.h0[sidx * a.sh0[0] + hv * a.sh0[1] + c * a.sh0[2] + vcol] : 0.f;
  }
  const bool has_p = a.precond != kPrecondIdentity;
  const bool atk = a.precond == kPrecondATK;
  float A[CPL];
  const int64_t aidx = a.a0_by_sequence ? n : sidx;
#pragma unroll
  for (int j = 0; j < CPL; ++j) {
    const int c = lane + 32 * j;
    A[j] = (has_p && a.a0 && c < K) ? a.a0[aidx * a.sa0[0] + h * a.sa0[1] + c] : 0.f;
  }
  const float center = has_p ? load_gate(a.center, h, a.gate_dtype) : 0.f;

  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  const Tin* v = static_cast<const Tin*>(a.v);
  Tin* o = static_cast<Tin*>(a.o);

#pragma unroll 1
  for (int64_t t0 = 0; t0 < len; t0 += L) {
    const int nt = static_cast<int>(len - t0 < L ? len - t0 : L);
    // Stage L tokens: every load is independent, so they are all in flight together.
#pragma unroll 4
    for (int e = lane; e < L * KT; e += 32) {
      const int tt = e / KT, c = e % KT;
      const int p = tt * KP + c + 4 * (c / R);
      const int64_t tok = bos + t0 + tt;
      const bool ok = tt < nt && c < K;
      s_k[p] = ok ? to_float(k[b * a.sk[0] + tok * a.sk[1] + h * a.sk[2] + c]) : 0.f;
      s_q[p] = ok ? to_float(q[b * a.sq[0] + tok * a.sq[1] + h * a.sq[2] + c]) : 0.f;
      if (a.decay == kDecayDiagonal)
        s_dg[p] = ok ? expf(load_gate(a.g, b * a.sg[0] + tok * a.sg[1] + hv * a.sg[2] + c, a.gate_dtype)) : 1.f;
    }
    if (lane < nt) {
      const int64_t tok = bos + t0 + lane;
      s_dec[lane] = a.decay == kDecayScalar
                        ? expf(load_gate(a.g, b * a.sg[0] + tok * a.sg[1] + hv * a.sg[2], a.gate_dtype))
                        : 1.f;
      s_beta[lane] =
          a.beta ? load_gate(a.beta, b * a.sbeta[0] + tok * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype) : 1.f;
      if (has_p) {
        s_gp[lane] = expf(load_gate(a.g_p, b * a.sgp[0] + tok * a.sgp[1] + h * a.sgp[2], a.gate_dtype));
        s_bp[lane] = load_gate(a.beta_p, b * a.sbp[0] + tok * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
      }
    }
    for (int e = lane; e < nt * VT; e += 32) {
      const int tt = e / VT, j = e % VT, vc = blockIdx.x * VT + j;
      const int64_t tok = bos + t0 + tt;
      s_v[tt][j] = vc < a.V ? to_float(v[b * a.sv[0] + tok * a.sv[1] + hv * a.sv[2] + vc]) : 0.f;
    }
    __syncwarp();
    // L2 norms (SPEC §1), one token per lane; q's factor includes the scale.
    if (lane < nt) {
      float ssk = 0.f, ssq = 0.f;
#pragma unroll 4
      for (int c = 0; c < KT; ++c) {
        const int p = lane * KP + c + 4 * (c / R);
        ssk = fmaf(s_k[p], s_k[p], ssk);
        ssq = fmaf(s_q[p], s_q[p], ssq);
      }
      s_rk[lane] = a.l2norm ? rsqrtf(ssk + 1e-6f) : 1.f;
      s_rq[lane] = (a.l2norm ? rsqrtf(ssq + 1e-6f) : 1.f) * a.scale;
    }
    __syncwarp();
    // Diagonal preconditioner statistics (SPEC §2): A = exp(g_p) A + beta_p k^2, M = squash(A);
    // kw = k ⊙ M (normalised) for DiagonalATK, q ⊙ M for DiagonalATQ.
    if (has_p) {
#pragma unroll 1
      for (int tt = 0; tt < nt; ++tt) {
        const float rk = s_rk[tt];
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          const int c = lane + 32 * j;
          const int p = tt * KP + c + 4 * (c / R);
          const float kn = s_k[p] * rk;
          A[j] = maths::stats_step(A[j], s_gp[tt], s_bp[tt], kn);
          const float M = maths::squash(A[j], center, a.log_x, a.eps);
          if (atk)
            s_kw[p] = kn * M;
          else
            s_q[p] *= M;
        }
      }
      __syncwarp();
    }
    // The recurrence (SPEC §2), token by token, from shared memory. k and q are raw there: their
    // norms multiply the dot products (and the write, unless kw already holds the normalised key).
    // Not unrolled: the body is large and must stay in the instruction cache.
#pragma unroll 1
    for (int tt = 0; tt < nt; ++tt) {
      const float4* kr = reinterpret_cast<const float4*>(s_k + tt * KP + part * RP);
      const float4* kw = reinterpret_cast<const float4*>((atk ? s_kw : s_k) + tt * KP + part * RP);
      const float4* qr = reinterpret_cast<const float4*>(s_q + tt * KP + part * RP);
      const float rk = s_rk[tt];
      float dec = s_dec[tt];
      if (a.decay == kDecayDiagonal) {
        const float4* dg = reinterpret_cast<const float4*>(s_dg + tt * KP + part * RP);
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
          const float4 d = dg[i];
          S[4 * i] *= d.x, S[4 * i + 1] *= d.y, S[4 * i + 2] *= d.z, S[4 * i + 3] *= d.w;
        }
      }
      float delta = s_beta[tt] * s_v[tt][col];
      if (a.online) {  // residual v - Sbar^T k with the read key k
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
          const float4 kk = kr[i];
          d0 = fmaf(S[4 * i], kk.x, d0);
          d1 = fmaf(S[4 * i + 1], kk.y, d1);
          d2 = fmaf(S[4 * i + 2], kk.z, d2);
          d3 = fmaf(S[4 * i + 3], kk.w, d3);
        }
        const float r = reduce_parts<KS>((d0 + d1) + (d2 + d3)) * (dec * rk);
        delta = s_beta[tt] * (s_v[tt][col] - r);
      }
      if (!atk) delta *= rk;
      float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
        const float4 w = kw[i];
        const float4 qq = qr[i];
        S[4 * i] = fmaf(S[4 * i], dec, w.x * delta);
        S[4 * i + 1] = fmaf(S[4 * i + 1], dec, w.y * delta);
        S[4 * i + 2] = fmaf(S[4 * i + 2], dec, w.z * delta);
        S[4 * i + 3] = fmaf(S[4 * i + 3], dec, w.w * delta);
        o0 = fmaf(S[4 * i], qq.x, o0);
        o1 = fmaf(S[4 * i + 1], qq.y, o1);
        o2 = fmaf(S[4 * i + 2], qq.z, o2);
        o3 = fmaf(S[4 * i + 3], qq.w, o3);
      }
      const float out = reduce_parts<KS>((o0 + o1) + (o2 + o3)) * s_rq[tt];
      if (part == 0 && vok) {
        const int64_t tok = bos + t0 + tt;
        o[b * a.so[0] + tok * a.so[1] + hv * a.so[2] + vcol] = from_float<Tin>(out);
      }
    }
    __syncwarp();
  }

  if (a.hT && vok) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int c = part * R + i;
      if (c < K) a.hT[sidx * a.shT[0] + hv * a.shT[1] + c * a.shT[2] + vcol] = S[i];
    }
  }
  if (has_p && a.aT && hv % a.group == 0 && blockIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = lane + 32 * j;
      if (c < K) a.aT[sidx * a.saT[0] + h * a.saT[1] + c] = A[j];
    }
  }
}

template <class Tin, int KT, int KS>
cudaError_t launch_variant(const RecArgs& a, cudaStream_t stream, bool dependent) {
  constexpr int VT = 32 / KS;
  const dim3 grid((a.V + VT - 1) / VT, a.HV, a.N);
  const size_t smem = StageLayout<KT, KS>::bytes(a.precond == kPrecondATK, a.decay == kDecayDiagonal);
  return launch_ex(recurrent_kernel<Tin, KT, KS>, grid, dim3(32), smem, stream, dependent, dim3(1, 1, 1), a);
}

/// Launches the warp kernel's variant of `plan` (Plan::warp_keys rows, Plan::warp_split threads per column).
template <class Tin>
cudaError_t launch_warp(const RecArgs& a, const Plan& plan, cudaStream_t stream) {
  const bool d = plan.pdl;
  if (plan.warp_keys == 64)
    return plan.warp_split == 1   ? launch_variant<Tin, 64, 1>(a, stream, d)
           : plan.warp_split == 2 ? launch_variant<Tin, 64, 2>(a, stream, d)
                                  : launch_variant<Tin, 64, 4>(a, stream, d);
  return plan.warp_split == 1   ? launch_variant<Tin, 128, 1>(a, stream, d)
         : plan.warp_split == 2 ? launch_variant<Tin, 128, 2>(a, stream, d)
                                : launch_variant<Tin, 128, 4>(a, stream, d);
}

}  // namespace dgps::cuda::kernels
