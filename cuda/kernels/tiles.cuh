/// @brief Shared tile helpers of the chunkwise kernels: fragment loads, conversions, row staging, copies, positions.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch/chunk.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels::chunk {
namespace {

using namespace layout;
constexpr int kThreads = 128;

/// A fragment of the 16 x 16 block at (m0, k0) of a row-major [m][k] tile.
template <class Op>
__device__ __forceinline__ void load_a(uint32_t* f, const Op* s, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(f, s + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}
/// A fragment of the 16 x 16 block at (m0, k0) of A = X^T with X stored row-major [k][m].
template <class Op>
__device__ __forceinline__ void load_a_t(uint32_t* f, const Op* s, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(f, s + (k0 + (l & 7) + (l >> 4) * 8) * ld + m0 + ((l >> 3) & 1) * 8);
}
/// B fragments of n-tiles n0 and n0 + 8 (f[0..1], f[2..3]) at k0, with B = Y^T and Y stored row-major [n][k].
template <class Op>
__device__ __forceinline__ void load_b(uint32_t* f, const Op* s, int ld, int n0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(f, s + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8);
}
/// B fragments of n-tiles n0 and n0 + 8 at k0, with B stored row-major [k][n].
template <class Op>
__device__ __forceinline__ void load_b_t(uint32_t* f, const Op* s, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(f, s + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8);
}

/// Row and column of accumulator element e (0..3) of the 16 x 8 tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) { return m0 + ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int acc_col(int n0, int e) { return n0 + 2 * (threadIdx.x & 3) + (e & 1); }

__device__ __forceinline__ int64_t imin64(int64_t x, int64_t y) { return x < y ? x : y; }

/// x and y rounded to Op (16-bit) and back, as to_float(from_float<Op>(.)) but by one packed conversion.
template <class Op>
__device__ __forceinline__ void round_pair(float& x, float& y) {
  if constexpr (std::is_same_v<Op, __nv_bfloat16>) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(x, y);
    x = __low2float(p), y = __high2float(p);
  } else {
    static_assert(std::is_same_v<Op, __half>, "16-bit operands");
    const __half2 p = __floats2half2_rn(x, y);
    x = __low2float(p), y = __high2float(p);
  }
}

/// Component i (0 .. 3, known at compile time) of a float4.
__device__ __forceinline__ float f4_at(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/// Element u (0 .. 7, known at compile time) of 8 floats read 16 bytes at a time from p (16-byte aligned).
struct Float8 {
  float4 lo, hi;
  __device__ __forceinline__ explicit Float8(const float* p)
      : lo(*reinterpret_cast<const float4*>(p)), hi(*reinterpret_cast<const float4*>(p + 4)) {}
  __device__ __forceinline__ float operator[](int u) const { return f4_at(u < 4 ? lo : hi, u & 3); }
};

/// Stores two adjacent elements (an even column pair) with one 32-bit access.
template <class Op>
__device__ __forceinline__ void store2(Op* p, float x, float y) {
  alignas(4) Op v[2] = {from_float<Op>(x), from_float<Op>(y)};
  *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(v);
}

/// Stores x, y at p[0], p[1] with one access (p aligned to two elements).
__device__ __forceinline__ void store_pair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store_pair(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}

/// Writes x, y to columns c, c + 1 of a row (c even) at p: one access when `pair` (aligned rows, both
/// columns in range, see pair_rows), else each element where ok0, ok1.
template <class T>
__device__ __forceinline__ void write_pair(T* p, float x, float y, bool pair, bool ok0, bool ok1) {
  if (pair && ok1) {
    store_pair(p, x, y);
  } else {
    if (ok0) p[0] = from_float<T>(x);
    if (ok1) p[1] = from_float<T>(y);
  }
}

/// One warp copies 16 rows of `cols` 16-bit elements (64 or 128: C, KP or Vpad) from shared memory to
/// global memory, 16 bytes per lane and step (the row length a compile-time constant: no division).
template <class Op>
__device__ __forceinline__ void copy_rows16(Op* dst, int64_t gld, const Op* src, int sld, int cols) {
  const int lane = threadIdx.x & 31;
  auto copy = [&](auto per_row) {  // 8-element groups per row
    constexpr int PR = decltype(per_row)::value;
#pragma unroll
    for (int e = lane; e < 16 * PR; e += 32) {
      const int r = e / PR, c8 = (e % PR) * 8;
      *reinterpret_cast<uint4*>(dst + r * gld + c8) = *reinterpret_cast<const uint4*>(src + r * sld + c8);
    }
  };
  if (cols == 128)
    copy(std::integral_constant<int, 16>{});
  else
    copy(std::integral_constant<int, 8>{});
}

/// Offset of row r, columns c8 .. c8 + 7 (c8 a multiple of 8) of a C-row tile in the packed blocked
/// layout (ChunkArgs::blocked: column groups of C rows x 8 elements).
__device__ __forceinline__ int blocked_at(int r, int c8) { return c8 * C + r * 8; }

/// One warp's 16 rows m0 .. m0 + 15 (in `src`, row stride sld) into the workspace tile `tile`: row-major
/// (row stride gld) or, with `blocked`, packed blocked (16 lanes write one column group's 16 rows, 256
/// contiguous bytes).
template <class Op>
__device__ __forceinline__ void store_rows16(Op* tile, int m0, int64_t gld, const Op* src, int sld, int cols,
                                             bool blocked) {
  if (!blocked) return copy_rows16(tile + m0 * gld, gld, src, sld, cols);
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 2 * cols; e += 32) {
    const int r = e % 16, c8 = (e / 16) * 8;
    *reinterpret_cast<uint4*>(tile + blocked_at(m0 + r, c8)) = *reinterpret_cast<const uint4*>(src + r * sld + c8);
  }
}

/// Where global chunk `gc` lies: its sequence, index in the sequence, tokens.
struct ChunkPos {
  int n = -1;      ///< sequence, -1 past the end of a packed batch
  int64_t c = 0;   ///< chunk index within the sequence
  int64_t b = 0;   ///< batch row
  int64_t t0 = 0;  ///< first token (index along T of batch row b)
  int L = 0;       ///< tokens in the chunk (1..C)
};

__device__ __forceinline__ ChunkPos chunk_pos(const ChunkArgs& ca, int64_t gc) {
  ChunkPos p;
  int64_t bos = 0, len = ca.a.T;
  if (ca.a.cu_seqlens) {
    const int2 m = ca.map[gc];
    if (m.x < 0) return p;
    p.n = m.x, p.c = m.y;
    bos = ca.a.cu_seqlens[p.n];
    len = ca.a.cu_seqlens[p.n + 1] - bos;
  } else {
    p.n = static_cast<int>(gc / ca.chunks_per_seq), p.c = gc % ca.chunks_per_seq;
    p.b = p.n;
  }
  p.t0 = bos + p.c * C;
  p.L = static_cast<int>(imin64(C, len - p.c * C));
  return p;
}

/// First global chunk and number of chunks of sequence n; its first token and batch row.
__device__ __forceinline__ void seq_chunks(const ChunkArgs& ca, int n, int64_t* first, int64_t* count, int64_t* len) {
  if (ca.a.cu_seqlens) {
    *first = ca.first[n];
    *count = ca.first[n + 1] - *first;
    *len = ca.a.cu_seqlens[n + 1] - ca.a.cu_seqlens[n];
  } else {
    *first = int64_t(n) * ca.chunks_per_seq;
    *count = ca.chunks_per_seq;
    *len = ca.a.T;
  }
}

/// The split state pass's last segment of a sequence of `count` chunks (ChunkArgs::split; 0 for an empty
/// sequence): equal-length sequences have ChunkArgs::split segments, packed ones as many as they need.
__device__ __forceinline__ int split_last_segment(const ChunkArgs& ca, int64_t count) {
  return count > 0 ? static_cast<int>((count - 1) / ca.seg_chunks) : 0;
}

/// The chunk's rows of one head of a [B, T, heads, D] tensor as one thread holds them between its
/// loads and its stores to shared memory (16-byte rows, D % 8 == 0; COLS >= D, a multiple of 16).
template <class Tin, int COLS>
struct RowLoads {
  static constexpr int PR = COLS / 8;             // 8-element groups per row
  static constexpr int IT = C * PR / kThreads;    // groups per thread
  static constexpr int W = sizeof(Tin) * 8 / 16;  // 16-byte words per group (1, or 2 for float)
  static constexpr int RS = kThreads / PR;        // rows between a thread's successive groups
  static_assert(C * PR % kThreads == 0 && kThreads % PR == 0, "tile must split evenly");
  uint4 raw[IT][W];
};

/// Issues this thread's loads of the rows (`row0`: the chunk's first row of the head, `rs`: the row
/// stride), zero past L rows and past D columns.
template <class Tin, int COLS>
__device__ __forceinline__ void load_rows(RowLoads<Tin, COLS>& s, const Tin* row0, int64_t rs, int L, int D) {
  using R = RowLoads<Tin, COLS>;
  const int r0 = threadIdx.x / R::PR, c8 = (threadIdx.x % R::PR) * 8;
  const Tin* src = row0 + r0 * rs + c8;
#pragma unroll
  for (int it = 0; it < R::IT; ++it, src += R::RS * rs) {
    const int r = r0 + it * R::RS;
#pragma unroll
    for (int w = 0; w < R::W; ++w)
      s.raw[it][w] = (r < L && c8 < D) ? reinterpret_cast<const uint4*>(src)[w] : make_uint4(0, 0, 0, 0);
  }
}

/// Stores the loaded rows into shared memory as operand type Op, row-major [C][ld].
template <class Tin, class Op, int COLS>
__device__ __forceinline__ void store_rows(Op* dst, int ld, const RowLoads<Tin, COLS>& s) {
  using R = RowLoads<Tin, COLS>;
#pragma unroll
  for (int it = 0; it < R::IT; ++it) {
    const int e = threadIdx.x + it * kThreads, r = e / R::PR, c8 = (e % R::PR) * 8;
    if constexpr (std::is_same_v<Tin, Op>) {  // the operand type already: no conversion
      *reinterpret_cast<uint4*>(dst + r * ld + c8) = s.raw[it][0];
      continue;
    }
    const Tin* x = reinterpret_cast<const Tin*>(s.raw[it]);
    alignas(16) Op out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = from_float<Op>(to_float(x[j]));
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = *reinterpret_cast<const uint4*>(out);
  }
}

/// Stages the chunk's rows of one head of a [B, T, heads, D] tensor into shared memory as operand
/// type Op, row-major [C][ld], zero past L rows and past D columns (COLS >= D, a multiple of 16).
/// `row0` points at the chunk's first row of that head, `rs` is the row (token) stride. With `vec`
/// (16-byte aligned rows, D % 8 == 0) every thread issues all its loads before converting.
template <class Tin, class Op, int COLS>
__device__ __forceinline__ void stage_rows(Op* dst, int ld, const Tin* row0, int64_t rs, int L, int D, bool vec) {
  constexpr int PR = COLS / 8;  // 8-element groups per row
  if (vec) {
    RowLoads<Tin, COLS> s;
    load_rows(s, row0, rs, L, D);
    store_rows<Tin, Op, COLS>(dst, ld, s);
    return;
  }
  for (int e = threadIdx.x; e < C * PR; e += kThreads) {
    const int r = e / PR, c8 = (e % PR) * 8;
    alignas(16) Op out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = from_float<Op>((r < L && c8 + j < D) ? to_float(row0[r * rs + c8 + j]) : 0.f);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = *reinterpret_cast<const uint4*>(out);
  }
}

/// L2-normalises (SPEC §1) the C staged rows of x in place and multiplies them by `mul`: two
/// threads per row (128 threads), 64 elements each, 16 bytes at a time. Without the norm only `mul` applies.
/// With `inv` non-null, row r's inverse norm (1 without the norm) goes to inv[r * inv_stride], r < L.
/// With SCALE false the rows are left as they are (only `inv` is written).
template <class Op, bool SCALE = true>
__device__ __forceinline__ void normalise_rows(Op* x, bool l2norm, float mul, float* inv = nullptr,
                                               int64_t inv_stride = 0, int L = 0) {
  static_assert(KP == 128 && C * 2 == kThreads, "two threads per row of 128");
  Op* row = x + (threadIdx.x >> 1) * LDK + (threadIdx.x & 1) * 64;
  alignas(16) Op v[64];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    *reinterpret_cast<uint4*>(v + 8 * j) = *reinterpret_cast<const uint4*>(row + 8 * j);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += to_float(v[8 * j + i]) * to_float(v[8 * j + i]);
  }
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  const float rn = l2norm ? rsqrtf(ss + 1e-6f) : 1.f, f = rn * mul;
  const int r = threadIdx.x >> 1;
  if (inv && (threadIdx.x & 1) == 0 && r < L) inv[r * inv_stride] = rn;
  if constexpr (SCALE) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[8 * j + i] = from_float<Op>(to_float(v[8 * j + i]) * f);
      *reinterpret_cast<uint4*>(row + 8 * j) = *reinterpret_cast<const uint4*>(v + 8 * j);
    }
  }
}

/// Starts the asynchronous copy of `rows` rows of COLS 16-bit elements from global (row stride gld)
/// to shared memory (row stride sld), 16 bytes per copy. NT > 0: the block's thread count, known at
/// compile time (32: the calling warp alone, whichever it is); each thread then keeps one column and
/// steps its row pointers (no index arithmetic per copy).
template <int COLS, int NT = 0, class Op>
__device__ __forceinline__ void copy_tile_async(Op* dst, int sld, const Op* src, int64_t gld, int rows) {
  constexpr int PR = COLS / 8;
  static_assert(NT != 32 || NT % PR == 0, "one warp copies whole rows per pass");
  if constexpr (NT > 0 && NT % PR == 0) {
    constexpr int RS = NT / PR;                                         // rows per pass of the block
    const int t = NT == 32 ? int(threadIdx.x & 31) : int(threadIdx.x);  // NT = 32: one warp copies
    const int r0 = t / PR, c8 = (t % PR) * 8;
    const Op* s = src + r0 * gld + c8;
    Op* d = dst + r0 * sld + c8;
#pragma unroll 4
    for (int r = r0; r < rows; r += RS, s += RS * gld, d += RS * sld) cp_async16(d, s);
  } else {
    for (int e = threadIdx.x; e < rows * PR; e += blockDim.x) {
      const int r = e / PR, c8 = (e % PR) * 8;
      cp_async16(dst + r * sld + c8, src + r * gld + c8);
    }
  }
}

/// Starts the asynchronous copy of a chunk's C rows of 128 16-bit elements from global memory (row
/// stride gld) to shared memory (row stride sld) with NT threads (32: the calling warp); rows from
/// `valid` on are zero-filled and nothing is read for them (past a sequence's end, or the tensor's).
template <int NT, class Op>
__device__ __forceinline__ void copy_rows_zfill_async(Op* dst, int sld, const Op* src, int64_t gld, int valid) {
  constexpr int PR = KP / 8, RS = NT / PR;
  static_assert(NT % PR == 0, "whole rows per pass");
  const int t = NT == 32 ? int(threadIdx.x & 31) : int(threadIdx.x);
  const int r0 = t / PR, c8 = (t % PR) * 8;
#pragma unroll 4
  for (int r = r0; r < C; r += RS) {
    const bool ok = r < valid;
    cp_async16_zfill(dst + r * sld + c8, src + (ok ? r : 0) * gld + c8, ok ? 16 : 0);
  }
}

/// Copies `rows` rows of COLS 16-bit elements from shared memory (row stride sld) to global memory
/// (row stride gld), 16 bytes per thread and step, with threads 0 .. NT - 1 (NT > 0: their count,
/// known at compile time, e.g. the compute warps beside a producer warp; 0: the whole block).
template <int COLS, int NT = 0, class Op>
__device__ __forceinline__ void store_tile(Op* dst, int64_t gld, const Op* src, int sld, int rows) {
  constexpr int PR = COLS / 8;
  if constexpr (NT > 0 && NT % PR == 0) {
    constexpr int RS = NT / PR;
    const int r0 = threadIdx.x / PR, c8 = (threadIdx.x % PR) * 8;
    Op* d = dst + r0 * gld + c8;
    const Op* s = src + r0 * sld + c8;
#pragma unroll 4
    for (int r = r0; r < rows; r += RS, d += RS * gld, s += RS * sld)
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
  } else {
    for (int e = threadIdx.x; e < rows * PR; e += blockDim.x) {
      const int r = e / PR, c8 = (e % PR) * 8;
      *reinterpret_cast<uint4*>(dst + r * gld + c8) = *reinterpret_cast<const uint4*>(src + r * sld + c8);
    }
  }
}

/// Multiplies the two 16-bit elements packed in x by the two packed in f (one packed instruction).
template <class Op>
__device__ __forceinline__ uint32_t mul2(uint32_t x, uint32_t f) {
  using Op2 = std::conditional_t<std::is_same_v<Op, __half>, __half2, __nv_bfloat162>;
  const Op2 r = __hmul2(*reinterpret_cast<const Op2*>(&x), *reinterpret_cast<const Op2*>(&f));
  return *reinterpret_cast<const uint32_t*>(&r);
}
/// The two 16-bit operands packed in x as floats (x: the lower element).
template <class Op>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<Op, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  } else {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
}
/// Packs two floats as two 16-bit operands.
template <class Op>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  alignas(4) Op v[2] = {from_float<Op>(x), from_float<Op>(y)};
  return *reinterpret_cast<const uint32_t*>(v);
}

/// One warp's 16 rows of A X (A's fragments over the C-long inner dimension in `fa`, X row-major
/// [C][ldx] with `cols` columns): store(e, n, x, y) gets each accumulator pair (element e of n-tile n).
template <class Op, class Store>
__device__ __forceinline__ void rows_times(const uint32_t (&fa)[4][4], const Op* X, int ldx, int cols, Store&& store) {
#pragma unroll 1
  for (int n0 = 0; n0 < cols; n0 += 16) {
    float acc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t fb[4];
      load_b_t(fb, X, ldx, kk * 16, n0);
      mma<Op>(acc[0], fa[kk], fb);
      mma<Op>(acc[1], fa[kk], fb + 2);
    }
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int e = 0; e < 4; e += 2) store(e, n0 + 8 * s, acc[s][e], acc[s][e + 1]);
  }
}

/// One warp's 16 rows m0 .. of Tm X (Tm's A fragments in `fa`, X row-major [C][ldx] with `cols` columns):
/// the rows go through `stage` (16 rows of LDK) and out to the workspace tile `tile` 16 bytes at a
/// time (store_rows16: row stride gld, or blocked).
template <class Op>
__device__ __forceinline__ void tm_times(const uint32_t (&fa)[4][4], const Op* X, int ldx, int cols, Op* stage, Op* tile,
                                         int m0, int64_t gld, bool blocked) {
  rows_times<Op>(fa, X, ldx, cols,
                 [&](int e, int n, float x, float y) { store2(stage + acc_row(0, e) * LDK + acc_col(n, e), x, y); });
  __syncwarp();
  store_rows16(tile, m0, gld, stage, LDK, cols, blocked);
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
