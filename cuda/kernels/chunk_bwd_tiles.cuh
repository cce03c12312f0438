/// @brief Shared helpers of the chunkwise backward: tensor offsets, gains, tile copies and row scaling.
#pragma once

#include <cstdint>

#include "launch/chunk.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

/// Element offset of (batch b, time t, head, channel c) in a tensor with strides s.
__device__ __forceinline__ int64_t at3(const int64_t* s, int64_t b, int64_t t, int64_t head) {
  return b * s[0] + t * s[1] + head * s[2];
}

/// Gain of token t (1 without gain), 0 for rows past the chunk.
__device__ __forceinline__ float gain_of(const RecArgs& a, const ChunkPos& p, int i, int hv) {
  if (i >= p.L) return 0.f;
  return a.beta ? load_gate(a.beta, at3(a.sbeta, p.b, p.t0 + i, hv), a.gate_dtype) : 1.f;
}

/// Copies `rows` rows of `cols` 16-bit elements (cols % 8 == 0, 16-byte aligned rows) between global
/// and shared memory (row strides sld, gld) with all the block's threads, 16 bytes per step.
template <class Op>
__device__ __forceinline__ void copy_tile(Op* dst, int64_t sld, const Op* src, int64_t gld, int rows, int cols) {
  const int pr = cols / 8;
  for (int e = threadIdx.x; e < rows * pr; e += blockDim.x) {
    const int r = e / pr, c8 = (e % pr) * 8;
    *reinterpret_cast<uint4*>(dst + r * sld + c8) = *reinterpret_cast<const uint4*>(src + r * gld + c8);
  }
}

/// Starts the asynchronous copy of `rows` rows of `cols` 16-bit elements (64 or 128) from global (row
/// stride gld) to shared memory (row stride sld) with all the block's NT threads (cp_commit / cp_wait).
template <int NT, class Op>
__device__ __forceinline__ void load_tile_async(Op* dst, int sld, const Op* src, int64_t gld, int rows, int cols) {
  if (cols == 64)
    copy_tile_async<64, NT>(dst, sld, src, gld, rows);
  else
    copy_tile_async<128, NT>(dst, sld, src, gld, rows);
}

/// dst[r][:] = f(r) src[r][:] over `rows` rows of COLS 16-bit elements (row stride ld, shared memory;
/// dst may be src), 16 bytes per step, with all the block's threads.
template <int COLS, class Op, class F>
__device__ __forceinline__ void scale_rows(Op* dst, const Op* src, int ld, int rows, F&& f) {
  constexpr int PR = COLS / 8;
  for (int e = threadIdx.x; e < rows * PR; e += blockDim.x) {
    const int r = e / PR, c8 = (e % PR) * 8;
    const float m = f(r);
    alignas(16) Op x[8];
    *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(src + r * ld + c8);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = from_float<Op>(to_float(x[j]) * m);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = *reinterpret_cast<const uint4*>(x);
  }
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
