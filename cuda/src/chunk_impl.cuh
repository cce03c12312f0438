/// @brief The chunkwise forward kernels (SPEC §4) on tensor cores: mma.sync m16n8k16, ldmatrix, float32 accumulation.
///
/// Fragment conventions (PTX ISA, mma.m16n8k16 with 16-bit operands), lane l of a warp:
///   A (16 x 16, row-major): {a0,a1} = A[l/4][2(l%4)+{0,1}], {a2,a3} rows + 8, {a4,a5} cols + 8, {a6,a7} both.
///   B (16 x 8):            {b0,b1} = B[2(l%4)+{0,1}][l/4], {b2,b3} rows + 8.
///   C (16 x 8, float):     {c0,c1} = C[l/4][2(l%4)+{0,1}], {c2,c3} rows + 8.
/// Shared-memory tiles are row-major with rows padded by 8 elements (16 bytes), so the eight 16-byte
/// rows an ldmatrix phase reads fall in different banks.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include <cuda.h>  // CUtensorMap (types only: the driver's encoder is found at run time)
#include <cudaTypedefs.h>

#include "chunk.cuh"
#include "recurrent_impl.cuh"
#include "wgmma.cuh"

// Internal linkage: each input type's translation unit has its own copy of the non-template kernels.
namespace dgps::cuda::kernels::chunk {
namespace {

using namespace layout;
constexpr int kThreads = 128;

template <class Op>
__device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma<__half>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

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

/// 2^x, log2(x) and 1/x with the approximate hardware instructions, denormals flushed to zero.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// The squash of SPEC §2 with the approximate instructions and no branch or select (the chunkwise
/// kernels' results carry 16-bit rounding); log2_x = log2(x). log2(M) = -log2(x) r / (1 + |r|) is formed
/// as -sign(r) v with v = log2(x) (1 - 1 / (1 + |r|)) (one multiply-add, then r's sign by one logic
/// operation), which is log2(x) exactly at r = -inf: where A + eps is not positive (or below the smallest
/// normal float, flushed by lg2), lg2 gives -inf and M = x, the limit SPEC §2 asks for.
__device__ __forceinline__ float squash_fast(float A, float center, float log2_x, float eps) {
  constexpr float kLn2 = 0.69314718056f;
  const float r = fmaf(lg2_ftz(fmaxf(A + eps, 0.f)), kLn2, -center);
  const float v = fmaf(-log2_x, rcp_ftz(1.f + fabsf(r)), log2_x);
  return ex2_ftz(__int_as_float(__float_as_int(v) ^ (~__float_as_int(r) & int(0x80000000u))));
}

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

/// One row's step of a channel's diagonal statistics (SPEC §2), A <- e^g_p A + beta_p kn^2, with the
/// row's e^g_p and beta_p and the channel's normalised key kn: the intra-chunk kernel and the warpgroup
/// state pass (ChunkArgs::kw_state) both form the write keys through it, so that theirs agree bit for bit.
__device__ __forceinline__ float stat_step(float A, float egp, float bp, float kn) {
  return fmaf(egp, A, bp * kn * kn);
}

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

/// Sequence n's diagonal statistics on entry for key head h, channel c: a0's, or 0 without a0 or past K.
__device__ __forceinline__ float stats_entry(const RecArgs& a, int64_t n, int h, int c) {
  return a.a0 && c < a.K ? a.a0[n * a.sa0[0] + h * a.sa0[1] + c] : 0.f;
}
/// Writes sequence n's final diagonal statistics A for key head h, channel c to aT (where given, c < K).
__device__ __forceinline__ void stats_final(const RecArgs& a, int64_t n, int h, int c, float A) {
  if (a.aT && c < a.K) a.aT[n * a.saT[0] + h * a.saT[1] + c] = A;
}

/// The chunk list of a packed batch: first[n] (prefix of ceil(len_n / C)) and map[gc] = (n, c).
__global__ void chunk_map_kernel(const ChunkArgs ca) {
  const int N = ca.a.N;
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int n = 0; n < N; ++n) {
      ca.first[n] = s;
      s += (ca.a.cu_seqlens[n + 1] - ca.a.cu_seqlens[n] + C - 1) / C;
    }
    ca.first[N] = s;
  }
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x)
    for (int64_t c = 0, e = ca.first[n + 1] - ca.first[n]; c < e; ++c)
      ca.map[ca.first[n] + c] = make_int2(n, static_cast<int>(c));
  for (int64_t gc = ca.first[N] + threadIdx.x; gc < ca.chunk_bound; gc += blockDim.x) ca.map[gc] = make_int2(-1, 0);
  // The look-back (ChunkArgs::lookback) writes aT in a sequence's last chunk: an empty sequence's here.
  const RecArgs& a = ca.a;
  if (!ca.lookback || !a.aT) return;
  for (int64_t e = threadIdx.x; e < int64_t(N) * a.H * a.K; e += blockDim.x) {
    const int n = static_cast<int>(e / (int64_t(a.H) * a.K)), h = static_cast<int>(e / a.K % a.H),
              c = static_cast<int>(e % a.K);
    if (ca.first[n + 1] == ca.first[n]) stats_final(a, n, h, c, stats_entry(a, n, h, c));
  }
}

/// Chunks whose own sums a block folds in its look-back (ChunkArgs::lookback): chunk c starts from the
/// statistics leaving chunk c - kLookback - 1 (or from a0), so that a sequence's chain of waits has a
/// link per kLookback + 1 chunks. (4 against 8: 4 word loads and 4 folds fewer per thread; PGDN 0.988-1.003,
/// PKDA 0.985-0.993 of the time over two leases; 2 was slower at T = 32768.)
constexpr int kLookback = 4;

/// Block blockIdx.x of the look-back's one-dimensional grid (ChunkArgs::lookback): its global chunk and
/// value head, a chunk's predecessors at smaller indices (value heads fastest, then sequences, then the
/// chunk index with equal-length sequences; value heads, then the global chunk with packed ones).
__device__ __forceinline__ void lookback_item(const ChunkArgs& ca, int64_t* gc, int* hv) {
  const int64_t x = blockIdx.x, r = x / ca.a.HV;
  *hv = static_cast<int>(x % ca.a.HV);
  *gc = ca.a.cu_seqlens ? r : (r % ca.a.N) * ca.chunks_per_seq + r / ca.a.N;
}

/// One 64-bit word of the look-back (ChunkArgs::lb), written and read whole by single accesses (relaxed,
/// GPU scope: from L2, never a stale L1 line): x in the lower half, y (or 0) in the upper half with its
/// sign bit set, so that a word is either zero (not yet written in this call) or complete.
__device__ __forceinline__ void st_word(uint64_t* p, float x, float y = 0.f) {
  const uint64_t w = (uint64_t(__float_as_uint(y) | 0x80000000u) << 32) | __float_as_uint(x);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ uint64_t ld_word(const uint64_t* p) {
  uint64_t w;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ bool word_written(uint64_t w) { return (w >> 63) != 0; }
__device__ __forceinline__ float word_x(uint64_t w) { return __uint_as_float(static_cast<uint32_t>(w)); }
__device__ __forceinline__ float word_y(uint64_t w) {
  return __uint_as_float(static_cast<uint32_t>(w >> 32) & 0x7fffffffu);
}

/// One warp (lane: its lane) forms the weights of a chunk's statistics from zero (ChunkArgs::lookback):
/// S[c] = sum_j w_j kn_j[c]^2 with w_j = beta_p,j prod_{l > j} e^g_p,l, from the rows' e^g_p and beta_p
/// (s_gp, s_bp; rows past the chunk's end: 1 and 0) into s_w[0 .. C - 1], and the chunk's product of
/// e^g_p into s_w[C] (suffix products over the lanes, two rows per lane).
__device__ __forceinline__ void lookback_weights(const float* s_gp, const float* s_bp, float* s_w, int lane) {
  static_assert(C == 64, "two rows per lane");
  const float a0 = s_gp[2 * lane], a1 = s_gp[2 * lane + 1];
  float x = a0 * a1;  // then the product over rows 2 lane .. C - 1
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float up = __shfl_down_sync(0xffffffffu, x, d);
    if (lane + d < 32) x *= up;
  }
  float next = __shfl_down_sync(0xffffffffu, x, 1);  // the product over rows 2 lane + 2 ..
  if (lane == 31) next = 1.f;
  s_w[2 * lane] = a1 * next * s_bp[2 * lane];
  s_w[2 * lane + 1] = next * s_bp[2 * lane + 1];
  if (lane == 0) s_w[C] = x;
}

/// The diagonal statistics entering chunk gc (value head hv, key head h, position p) for channel
/// threadIdx.x, by the look-back of ChunkArgs::lookback, from the chunk's normalised k rows (sK, row stride
/// LDK) and the weights of lookback_weights (s_w). Publishes the chunk's own product and statistics from
/// zero, reads those of the kLookback chunks before it and the statistics leaving the one before them
/// (again until all are written), folds them in chunk order, publishes the statistics leaving the chunk,
/// and writes aT (the sequence's last chunk) and, with kw_state, Ain. Every thread publishes and reads its
/// channel's words by itself (no barrier, no fence).
template <class Op>
__device__ float lookback_ain(const ChunkArgs& ca, int64_t gc, int hv, int h, const ChunkPos& p, const Op* sK,
                              const float* s_w) {
  const RecArgs& a = ca.a;
  const int c = threadIdx.x;
  static_assert(kThreads == KP, "a thread per channel");
  // Chunks s .. ci - 1 of the sequence (global g0 ..) are folded onto a0 (s = 0) or onto the statistics
  // leaving chunk s - 1. Their words are read first, so that the loads' latency passes under the chunk's
  // own sums; the words past m (and the entry word with s = 0) are read from valid places and ignored.
  const int64_t e = gc * a.HV + hv, tiles = ca.chunk_bound * a.HV, stride = int64_t(a.HV) * KP;
  uint64_t *lbS = ca.lb, *lbI = ca.lb + tiles * KP;
  const int64_t ci = p.c, s = ci > kLookback ? ci - kLookback : 0, g0 = gc - ci + s;
  const int m = static_cast<int>(ci - s);
  const uint64_t* pS = lbS + (g0 * a.HV + hv) * KP + c;
  const uint64_t* pI = s > 0 ? lbI + ((g0 - 1) * a.HV + hv) * KP + c : pS;
  uint64_t w[kLookback], wi;
  auto load_words = [&] {  // (word u >= m: word m - 1's place again, a pointer step and a select per word)
    wi = ld_word(pI);
    const uint64_t* q = pS;
#pragma unroll
    for (int u = 0; u < kLookback; ++u) {
      if (u > 0) q = u < m ? q + stride : q;
      w[u] = ld_word(q);
    }
  };
  auto all_written = [&] {
    bool ok = s == 0 || word_written(wi);
#pragma unroll
    for (int u = 0; u < kLookback; ++u) ok &= u >= m || word_written(w[u]);
    return ok;
  };
  load_words();
  // The chunk's own statistics from zero: 64 independent products.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int r = 0; r < C; r += 4) {
    const float4 wv = *reinterpret_cast<const float4*>(s_w + r);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float x = to_float(sK[(r + u) * LDK + c]);
      acc[u] = fmaf(f4_at(wv, u) * x, x, acc[u]);
    }
  }
  const float S = (acc[0] + acc[1]) + (acc[2] + acc[3]), P = s_w[C];
  st_word(lbS + e * KP + c, S, P);
  while (!all_written()) load_words();
  float X = s > 0 ? word_x(wi) : stats_entry(a, p.n, h, c);
#pragma unroll
  for (int u = 0; u < kLookback; ++u) X = u < m ? fmaf(word_y(w[u]), X, word_x(w[u])) : X;
  const float A_out = fmaf(P, X, S);
  st_word(lbI + e * KP + c, A_out);
  if (hv == h * a.group) {
    if (ca.kw_state) ca.Ain[(gc * a.H + h) * KP + c] = X;  // (only the warpgroup pass's write keys read it)
    if (a.aT) {
      int64_t first, count, len;
      seq_chunks(ca, p.n, &first, &count, &len);
      if (ci == count - 1) stats_final(a, p.n, h, c, A_out);
    }
  }
  return X;
}

/// Inclusive prefix sums over a chunk's C = 64 values held two per lane (values 2 lane and 2 lane + 1
/// in g0, g1) by one warp: on return g0 and g1 are the sums through those positions.
__device__ __forceinline__ void warp_scan_pairs(float& g0, float& g1, int lane) {
  static_assert(C == 64, "two values per lane");
  g1 += g0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, g1, d);
    if (lane >= d) g0 += up, g1 += up;
  }
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

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
/// cp_async16 that reads `bytes` (16 or 0) from src and zero-fills the rest of the 16 bytes.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
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

/// Per (chunk, key head) work item, thread c = key channel: the chunk's effect on the diagonal
/// statistics, A_out = prod(a) A_in + sum_j prod_{l > j}(a_l) beta_p,j k_j[c]^2 (SPEC §4), as (prod, sum).
/// The weights prod_{l > j}(a_l) beta_p,j / |k_j|^2 do not depend on the channel: warp 0 forms them once
/// from the cumulative log decay (exponent differences, each at most 1), so each channel's sum is 64
/// independent products (a first-order recurrence per channel took three times the instructions).
/// Persistent: block b takes items b, b + gridDim.x, ... (as many blocks as fit: precond_sums_blocks) and copies
/// the next item's k rows (cp.async, 16-bit rows of 128: the operand type itself) into its second
/// buffer while it sums the current one, so that the loads never wait for the sums (one item per block,
/// loads then sums in step over the whole grid, kept the memory 43% busy). Other inputs stage the next
/// item's rows synchronously. On Hopper the statistics' scan is its programmatic dependent.
template <class Tin, class Op>
__global__ void __launch_bounds__(kThreads) precond_sums_kernel(const ChunkArgs ca) {
  const RecArgs& a = ca.a;
  __shared__ __align__(16) Op sK[2][C * LDK];
  __shared__ __align__(16) float s_w[C];
  __shared__ float s_g[2][C], s_bp[2][C], s_rn[C], s_tot;
  grid_dependents_launch();  // the scan may be scheduled (it waits for this grid's sums)
  constexpr bool kAsync = sizeof(Tin) == 2 && std::is_same_v<Tin, Op>;
  const bool async = kAsync && ca.vec_qk && a.K == KP;
  const int64_t items = ca.chunk_bound * a.H;
  const int tid = threadIdx.x, lane = tid & 31;
  struct Item {
    int64_t gc = 0;  ///< global chunk
    int h = 0;       ///< key head
    ChunkPos p;      ///< the chunk's position (p.n < 0: none, past a packed batch's end)
  };
  // Item w (its chunk, head and position); starts its rows' copies into buffer b (rows past L zero) and
  // loads its gates (thread r < L: row r; rows past L: g_p = 0, beta_p = 0) into registers.
  auto fetch = [&](int64_t w, int b, float& gpv, float& bpv) {
    Item it;
    it.gc = w % ca.chunk_bound;
    it.h = static_cast<int>(w / ca.chunk_bound);
    it.p = chunk_pos(ca, it.gc);
    const ChunkPos& p = it.p;
    const int h = it.h;
    gpv = 0.f, bpv = 0.f;
    if (p.n < 0) return it;
    if (tid < p.L) {
      const int64_t t = p.t0 + tid;
      gpv = load_gate(a.g_p, p.b * a.sgp[0] + t * a.sgp[1] + h * a.sgp[2], a.gate_dtype);
      bpv = load_gate(a.beta_p, p.b * a.sbp[0] + t * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
    }
    const Tin* k = static_cast<const Tin*>(a.k) + p.b * a.sk[0] + p.t0 * a.sk[1] + h * a.sk[2];
    if constexpr (kAsync) {
      if (async) {
        copy_rows_zfill_async<kThreads>(sK[b], LDK, k, a.sk[1], p.L);
        return it;
      }
    }
    stage_rows<Tin, Op, KP>(sK[b], LDK, k, a.sk[1], p.L, a.K, ca.vec_qk);
    return it;
  };
  int64_t w = blockIdx.x;
  float gpv = 0.f, bpv = 0.f;
  Item next;
  if (w < items) next = fetch(w, 0, gpv, bpv);
  cp_commit();
  for (int b = 0; w < items; w += gridDim.x, b ^= 1) {
    if (tid < C) s_g[b][tid] = gpv, s_bp[b][tid] = bpv;
    const Item cur = next;
    if (w + gridDim.x < items) next = fetch(w + gridDim.x, b ^ 1, gpv, bpv);
    cp_commit();
    cp_wait<1>();  // this item's rows have landed (the next item's stay in flight)
    __syncthreads();
    if (cur.p.n >= 0) {  // (uniform over the block)
      normalise_rows<Op, false>(sK[b], a.l2norm, 1.f, s_rn, 1, C);  // the rows' inverse norms only
      __syncthreads();
      if (tid < 32) {  // G_j = sum_{l <= j} g_p,l (two rows per lane), then w_j = e^(G_C - G_j) beta_p,j / |k_j|^2
        float g0 = s_g[b][2 * lane], g1 = s_g[b][2 * lane + 1];
        warp_scan_pairs(g0, g1, lane);
        const float tot = __shfl_sync(0xffffffffu, g1, 31);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = 2 * lane + u;
          s_w[j] = expf(tot - (u ? g1 : g0)) * s_bp[b][j] * s_rn[j] * s_rn[j];
        }
        if (lane == 0) s_tot = tot;
      }
      __syncthreads();
      const Op* kb = sK[b];
      const int c = tid;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < C; r += 4) {
        const float4 wv = *reinterpret_cast<const float4*>(s_w + r);
        const float w4[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float x = to_float(kb[(r + u) * LDK + c]);
          acc[u] = fmaf(w4[u] * x, x, acc[u]);
        }
      }
      ca.sums[(cur.gc * a.H + cur.h) * KP + c] = make_float2(expf(s_tot), (acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
    __syncthreads();  // buffer b, s_w and s_tot are free for the item after next
  }
}

/// Per (sequence, key head), thread c: the statistics entering each chunk (from a0 or 0), and aT.
__global__ void __launch_bounds__(kThreads) precond_scan_kernel(const ChunkArgs ca) {
  // The sums first (on Hopper this is their programmatic dependent), then the intra-chunk kernel may be
  // scheduled (it waits for Ain).
  grid_dependency_sync();
  const RecArgs& a = ca.a;
  const int n = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t e0 = (first * a.H + h) * KP + c;
  stats_final(a, n, h, c, scan_chunk_sums<false>(ca.sums + e0, ca.Ain + e0, int64_t(a.H) * KP, count,
                                                 stats_entry(a, n, h, c)));
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

/// Loads 16 channels (8 at c0, 8 at c0 + 64) of a row of 16-bit operands as floats.
template <class Op>
__device__ __forceinline__ void load16(float* x, const Op* row, int c0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    alignas(16) Op v[8];
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(row + c0 + 64 * h);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[8 * h + j] = to_float(v[j]);
  }
}
__device__ __forceinline__ void load16(float* x, const float* row, int c0) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 8; j += 4)
      *reinterpret_cast<float4*>(x + 8 * h + j) = *reinterpret_cast<const float4*>(row + c0 + 64 * h + j);
}

/// Backward mode: one warp scales column j of its 16 staged rows of P (row stride LDC) by beta_j, so
/// that the workspace holds P Diag(beta) (the state pass's o = ... + P Diag(beta) r, the prep kernel's
/// Diag(beta) P^T do).
template <class Op>
__device__ __forceinline__ void times_beta_cols(Op* rows, const float* s_beta) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 16 * C / 2; e += 32) {
    const int r = e / (C / 2), j = (e % (C / 2)) * 2;
    Op* x = rows + r * LDC + j;
    store2(x, to_float(x[0]) * s_beta[j], to_float(x[1]) * s_beta[j + 1]);
  }
  __syncwarp();
}

/// Largest spread of gamma over a 16-row block for which the diagonal block also runs on tensor
/// cores: its products then carry a factor up to e^spread (bf16 reaches e^88, f16 e^11).
template <class Op>
constexpr float kDiagSpread = std::is_same_v<Op, __half> ? 9.f : 60.f;

/// The lean Diagonal-decay layout (intra_kernel with raw_v): the chunk's per-channel gamma kept only at
/// each 16-row block's first and last rows (`Gb` [8][KP]: rows 16a, 16a + 15 as rows 2a, 2a + 1); the
/// rows between are summed again from the chunk's gates, in the scan's order (so bit for bit the same).
struct GateRows {
  const void* g = nullptr;  ///< the gate of the chunk's first token, channel 0, this value head
  int64_t rs = 0;           ///< token stride of the gates
  int dtype = 0, L = 0, K = 0;
  /// Gate of row r (in the chunk), channel c; 0 past L rows and past K channels (as in the scan).
  __device__ __forceinline__ float at(int r, int c) const {
    return r < L && c < K ? load_gate(g, r * rs + c, dtype) : 0.f;
  }
};

/// Row of the lean layout's gamma (`Gb` [8][KP]) that holds chunk row r, r % 16 in {0, 15}.
__device__ __forceinline__ int gamma_block_row(int r) { return r / 16 * 2 + (r % 16 != 0); }

/// Row r's per-channel gamma: G's row, or in the lean layout (LEAN) its copy in Gb, r % 16 in {0, 15}.
/// (The layout is a compile-time choice: testing a shared pointer for null at run time made every
/// read of it a generic load.)
template <bool LEAN>
__device__ __forceinline__ const float* gamma_row(const float* G, const float* Gb, int r) {
  if constexpr (LEAN) return Gb + gamma_block_row(r) * KP;
  return G + r * LDG;
}

/// The outer factors of one row's N (4 or 8) channels at element offset `at` of the key tiles (packed
/// multiplies): K's and Q's by e^(g - ga), KW's by e^(gz - g) into KWh; g the row's gamma of those
/// channels, ga and gz its block's first and last rows'.
template <class Op, int N>
__device__ __forceinline__ void scale_outer(Op* sK, Op* sQ, const Op* sKW, Op* sKWh, int at, const float* g,
                                            const float* ga, const float* gz) {
  using V = std::conditional_t<N == 8, uint4, uint2>;
  V xk = *reinterpret_cast<const V*>(sK + at);
  V xq = *reinterpret_cast<const V*>(sQ + at);
  V xw = *reinterpret_cast<const V*>(sKW + at);
  uint32_t* pk = reinterpret_cast<uint32_t*>(&xk);
  uint32_t* pq = reinterpret_cast<uint32_t*>(&xq);
  uint32_t* pw = reinterpret_cast<uint32_t*>(&xw);
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const float g0 = g[j], g1 = g[j + 1];
    const uint32_t fa = pack2<Op>(__expf(g0 - ga[j]), __expf(g1 - ga[j + 1]));
    const uint32_t fz = pack2<Op>(__expf(gz[j] - g0), __expf(gz[j + 1] - g1));
    pk[j / 2] = mul2<Op>(pk[j / 2], fa);
    pq[j / 2] = mul2<Op>(pq[j / 2], fa);
    pw[j / 2] = mul2<Op>(pw[j / 2], fz);
  }
  *reinterpret_cast<V*>(sK + at) = xk;
  *reinterpret_cast<V*>(sQ + at) = xq;
  *reinterpret_cast<V*>(sKWh + at) = xw;
}

/// Diagonal decay (SPEC §4), warp w owns the 16-row block a = w (rows m0 = 16w ..): rows m0 .. m0 + 15
/// of Akk = Diag(beta) Bm (Bm Diag(beta) in backward mode) and of P, with e^(gamma_i - gamma_j) per
/// channel formed from differences in the exponent so that strong decays stay finite:
///   e^(gamma_i - gamma_j) = e^(gamma_i - gamma_16a) e^(gamma_16a - gamma_16b+15) e^(gamma_16b+15 - gamma_j)
/// for row i in block a and column j in block b. The outer factors go into the tiles once, in place
/// (K and Q rows of block a: e^(gamma_i - gamma_16a) <= 1; KW rows into `sKWh`: e^(gamma_16b+15 -
/// gamma_j) <= 1); the middle one, per channel, scales the A fragments on the way to the tensor cores
/// (<= 1 for b < a). The diagonal block (b = a, middle factor up to e^spread) joins them when gamma
/// spreads over it by at most kDiagSpread; otherwise it is summed elementwise from the raw tiles first
/// (lanes: 4 row groups x 8 channel groups of 16 channels). Writes P's rows to `sPst` (staging,
/// [C][LDC]), Akk's diagonal block to sAd and the blocks left of it to sAh, zeros above the diagonal.
/// Leaves the block's K, Q rows scaled as above (the caller rescales them by e^gamma_16a). Contains a
/// __syncthreads: every thread of the block calls it. Lean layout (LEAN, `Gb`, see GateRows): gamma's
/// rows between the blocks' first and last come from `gr`, and P goes straight from the accumulators to
/// the workspace tile `Pg` (blocked layout) instead of `sPst`.
template <class Op, bool LEAN>
__device__ __forceinline__ void diag_decay_akk_p(Op* sQ, Op* sK, const Op* sKW, Op* sKWh, const float* G,
                                                 const float* s_beta, bool online, bool bwd, int m0, Op* sPst,
                                                 float* sAd, __half* sAh, const float* Gb, const GateRows& gr,
                                                 Op* Pg) {
  const int lane = threadIdx.x & 31, w = m0 / 16;
  constexpr bool lean = LEAN;
  auto p_at = [&](int i, int j) { return lean ? Pg + blocked_at(i, j & ~7) + (j & 7) : sPst + i * LDC + j; };
  const float* gA = gamma_row<LEAN>(G, Gb, m0);  // gamma_16a
  const float* gZ = gamma_row<LEAN>(G, Gb, m0 + 15);  // gamma_16a+15
  float spread = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) spread = fmaxf(spread, gA[4 * lane + u] - gZ[4 * lane + u]);
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) spread = fmaxf(spread, __shfl_xor_sync(0xffffffffu, spread, d));
  const bool fast = spread <= kDiagSpread<Op>;
  if (!fast) {  // the diagonal block elementwise: lane = (row group rg, channel group cg); rows rg, rg + 4, ...
    const int rg = lane >> 3, cg = lane & 7, c0 = cg * 8;
    const unsigned mask = 0xffu << (8 * rg);
    // Lean layout: gamma of row m0 + n from row m0's by adding the gates of rows m0 + 1 .. m0 + n.
    auto add_rows = [&](float* x, int from, int to) {
      for (int t = from; t <= to; ++t)
#pragma unroll
        for (int c = 0; c < 16; ++c) x[c] += gr.at(t, c0 + c % 8 + (c / 8) * 64);
    };
    for (int ii = rg; ii < 16; ii += 4) {
      const int i = m0 + ii;
      float qi[16], ki[16], gi[16], gj[16];
      load16(qi, sQ + i * LDK, c0);
      load16(ki, sK + i * LDK, c0);
      if (lean) {
        load16(gi, gA, c0);
        add_rows(gi, m0 + 1, i);
        load16(gj, gA, c0);
      } else {
        load16(gi, G + i * LDG, c0);
      }
      for (int jj = 0; jj <= ii; ++jj) {
        const int j = m0 + jj;
        float kw[16];
        load16(kw, sKW + j * LDK, c0);
        if (!lean)
          load16(gj, G + j * LDG, c0);
        else if (jj > 0)
          add_rows(gj, j, j);
        float sa = 0.f, sp = 0.f;
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float x = kw[c] * __expf(gi[c] - gj[c]);
          sa += ki[c] * x, sp += qi[c] * x;
        }
#pragma unroll
        for (int d = 1; d < 8; d <<= 1) {
          sa += __shfl_xor_sync(mask, sa, d);
          sp += __shfl_xor_sync(mask, sp, d);
        }
        if (cg == 0) {
          *p_at(i, j) = from_float<Op>(sp);
          if (online) sAd[w * 272 + ii * 17 + jj] = jj < ii ? s_beta[bwd ? j : i] * sa : 0.f;
        }
      }
    }
    for (int e = lane; e < 256; e += 32) {  // zeros above the diagonal
      const int ii = e / 16, jj = e % 16;
      if (jj <= ii) continue;
      *p_at(m0 + ii, m0 + jj) = from_float<Op>(0.f);
      if (online) sAd[w * 272 + ii * 17 + jj] = 0.f;
    }
    __syncwarp();
  }
  // The outer factors into this block's rows: lane l scales channels 8 (l % 16) .. + 7 of rows
  // m0 + l / 16, + 2, ... (packed multiplies). Lean layout: lane l scales channels 4 l .. + 3 of every
  // row of the block in order, summing gamma from row m0's as it goes.
  // The gates of the block's 15 later rows are all loaded before the first is added (one memory round
  // trip instead of one per few rows: they come from L2, and the warp has nothing else to do meanwhile).
  auto lean_outer = [&](auto type) {  // the gate's element type chosen once, as in the scan
    using GT = decltype(type);
    const GT* gp = static_cast<const GT*>(gr.g);
    const int c4 = 4 * lane;
    GT d[15][4];
#pragma unroll
    for (int u = 0; u < 15; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = m0 + 1 + u;
        d[u][j] = r < gr.L && c4 + j < gr.K ? gp[r * gr.rs + c4 + j] : GT(0.f);
      }
    float ga[4], gz[4], g[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) ga[j] = gA[c4 + j], gz[j] = gZ[c4 + j], g[j] = ga[j];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      if (u > 0)
#pragma unroll
        for (int j = 0; j < 4; ++j) g[j] += to_float(d[u - 1][j]);
      scale_outer<Op, 4>(sK, sQ, sKW, sKWh, (m0 + u) * LDK + c4, g, ga, gz);
    }
  };
  if (lean) {
    if (gr.dtype == 1)
      lean_outer(__nv_bfloat16{});
    else if (gr.dtype == 2)
      lean_outer(__half{});
    else
      lean_outer(float{});
  }
  const int c8 = (lane % 16) * 8;
  float ga[8], gz[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) ga[j] = gA[c8 + j], gz[j] = gZ[c8 + j];
#pragma unroll 2
  for (int r = m0 + lane / 16; r < (lean ? m0 : m0 + 16); r += 2) {
    scale_outer<Op, 8>(sK, sQ, sKW, sKWh, r * LDK + c8, G + r * LDG + c8, ga, gz);
  }
  __syncthreads();  // every block's KW rows are scaled
  float accA[8][4], accP[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) accA[i][e] = accP[i][e] = 0.f;
  const int nb = fast ? w + 1 : w;  // column blocks on tensor cores
#pragma unroll 1
  for (int k0 = 0; k0 < KP; k0 += 16) {
    uint32_t fk[4], fq[4];
    load_a(fk, sK, LDK, m0, k0);
    load_a(fq, sQ, LDK, m0, k0);
    const int c0 = k0 + 2 * (lane & 3);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b >= nb) break;
      const float* gB = gamma_row<LEAN>(G, Gb, 16 * b + 15);  // gamma_16b+15
      const uint32_t f0 = pack2<Op>(__expf(gA[c0] - gB[c0]), __expf(gA[c0 + 1] - gB[c0 + 1]));
      const uint32_t f1 = pack2<Op>(__expf(gA[c0 + 8] - gB[c0 + 8]), __expf(gA[c0 + 9] - gB[c0 + 9]));
      // A fragment registers 0, 1 hold columns c0, c0 + 1; registers 2, 3 columns c0 + 8, c0 + 9.
      const uint32_t sk[4] = {mul2<Op>(fk[0], f0), mul2<Op>(fk[1], f0), mul2<Op>(fk[2], f1), mul2<Op>(fk[3], f1)};
      const uint32_t sq[4] = {mul2<Op>(fq[0], f0), mul2<Op>(fq[1], f0), mul2<Op>(fq[2], f1), mul2<Op>(fq[3], f1)};
      uint32_t fb[4];
      load_b(fb, sKWh, LDK, 16 * b, k0);
      if (online) {
        mma<Op>(accA[2 * b], sk, fb);
        mma<Op>(accA[2 * b + 1], sk, fb + 2);
      }
      mma<Op>(accP[2 * b], sq, fb);
      mma<Op>(accP[2 * b + 1], sq, fb + 2);
    }
  }
  // Column block nt / 2 against this warp's row block w (uniform over the warp): left of it no mask,
  // the diagonal block masked (or summed elementwise above), right of it zero.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int bj = nt / 2;
    if (bj == w && !fast) continue;  // summed elementwise above
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = acc_row(m0, e), j = acc_col(nt * 8, e);
      if (bj > w) {
        store2(p_at(i, j), 0.f, 0.f);
        continue;
      }
      const bool dblock = bj == w;
      store2(p_at(i, j), !dblock || j <= i ? accP[nt][e] : 0.f, !dblock || j + 1 <= i ? accP[nt][e + 1] : 0.f);
      if (!online) continue;
      float x0 = s_beta[bwd ? j : i] * accA[nt][e], x1 = s_beta[bwd ? j + 1 : i] * accA[nt][e + 1];
      if (dblock) {
        x0 = j < i ? x0 : 0.f, x1 = j + 1 < i ? x1 : 0.f;
        sAd[w * 272 + (i % 16) * 17 + j % 16] = x0;
        sAd[w * 272 + (i % 16) * 17 + j % 16 + 1] = x1;
      } else {
        *reinterpret_cast<__half2*>(sAh + i * LDC + j) = __floats2half2_rn(x0, x1);
      }
    }
  }
}

/// Per (chunk, value head): the state-independent part of SPEC §4 (see chunk.cuh). 4 warps; warp w
/// owns rows 16w .. 16w + 15 of every C-row product (but Akk and P with scalar or no decay: their lower
/// block triangle balanced over the warps). LEAN: the lean Diagonal-decay layout below, its
/// own instantiation (the launch picks it for Diagonal decay with raw v rows), so that its registers
/// do not change the other models' code. QUAD (kQuadIdentity, kQuadATK): the quad layout below (four
/// blocks per SM), launched for the forward with scalar or no decay, raw q rows and raw v rows, of the
/// Identity or the DiagonalATK preconditioner (intra_quad).
template <class Tin, class Op, bool LEAN = false, int QUAD = 0>
__global__ void __launch_bounds__(kThreads, QUAD ? 4 : 3) intra_kernel(const ChunkArgs ca) {
  static_assert(!(LEAN && QUAD), "one layout");
  const RecArgs& a = ca.a;
  const bool online = QUAD || a.online, bwd = !QUAD && ca.bwd;  // (QUAD: raw v rows, an Online solve)
  const int LDV = ca.Vpad + 8;
  const bool has_p = QUAD ? QUAD == kQuadATK : a.precond != kPrecondIdentity;
  const bool atk = QUAD ? QUAD == kQuadATK : a.precond == kPrecondATK;
  const bool diag = LEAN || (!QUAD && a.decay == kDecayDiagonal);  // (LEAN: Diagonal decay always)
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sQ = reinterpret_cast<Op*>(smem);  // [C][LDK] normalised, scaled q (qr for DiagonalATQ)
  Op* sK = sQ + C * LDK;                 // [C][LDK] read key k, later k ⊙ e^gamma
  Op* sKWb = sK + C * LDK;               // [C][LDK] write key kw (DiagonalATK; Diagonal decay: kw scaled)
  Op* sEnd = sKWb + (atk || diag ? C * LDK : 0);
  // Scalar or no decay: Tm [C][LDC], then the solve region (the v tile reuses it once Tm is formed).
  // Diagonal decay (intra_smem_bytes(atk, true)): the solve region without its scratch, then the
  // per-channel gamma [C][LDG]; P is staged in Tinv's place, gamma's region holds the solve's scratch
  // once the decayed tiles are out and then the v tile, and Tm takes Akk's place after the solve.
  // DiagonalATK with scalar or no decay (`atk_nd`, a third key tile: intra_smem_bytes(true, false)
  // keeps three blocks per SM): the solve region without its scratch; the tiles go out before the
  // solve, so the scratch lives in the q tile and the v tile in kw's; P is staged in Tinv's place and
  // Tm is formed in place of Tinv.
  // Diagonal decay with raw v rows (`lean`, intra_lean_smem_bytes(): three blocks per SM): gamma only at
  // each 16-row block's first and last rows ([8][KP] after Akk; GateRows), P straight to the workspace,
  // and once the decayed tiles are out, Tinv and the solve's scratch in the q tile. It has no v tile
  // (sV null) and no P staging (sPst would alias the q tile): both are used only without raw_v, and the
  // kernel returns after Tm with raw_v.
  // The quad layout (QUAD, intra_quad_smem_bytes(): four blocks per SM): the q and k tiles (and kw's with
  // DiagonalATK), nothing else. P goes from the accumulators straight to the workspace (blocked layout);
  // each warp writes its rows of Akk into its own (already read) rows of the q tile: the blocks left of
  // the diagonal in their first C columns (sAh, row stride LDK), the diagonal block in float32 in the
  // rows' tails (row stride LDK / 2 floats). After the products Tinv and the solve's scratch take the k
  // tile (kw's tile is out by then), Tm is formed in Tinv's place, and the kernel returns after Tm (no
  // v tile, no tiles out but gamma and kw).
  const bool atk_nd = atk && !diag, lean = LEAN;  // (LEAN is launched for diag && ca.raw_v only)
  const bool no_tm = diag || atk_nd || QUAD;  // (no Tm tile of its own)
  Op* sTm = no_tm ? nullptr : sEnd;                                      // [C][LDC]
  float* sAd = reinterpret_cast<float*>(no_tm ? sEnd : sEnd + C * LDC);  // [4][16][17] Akk's diagonal blocks
  // [C][LDH] Akk below the diagonal blocks; LDH its row stride, LDD the diagonal blocks' (in floats)
  __half* sAh = QUAD ? reinterpret_cast<__half*>(sQ) : reinterpret_cast<__half*>(sAd + 4 * 16 * 17);
  const int LDH = QUAD ? LDK : LDC, LDD = QUAD ? LDK / 2 : 17;
  float* sGb = lean ? reinterpret_cast<float*>(sAh + C * LDC) : nullptr;  // [8][KP] lean: gamma's block rows
  // [C][LDC] Tinv (lower block triangle), then [C][LDG] the per-channel gamma (Diagonal decay)
  __half* sTh = lean ? reinterpret_cast<__half*>(sQ) : QUAD ? reinterpret_cast<__half*>(sK) : sAh + C * LDC;
  float* sG = lean || QUAD ? nullptr : reinterpret_cast<float*>(sTh + C * LDC);
  __half* sXh = lean || QUAD ? sTh + C * LDC
                : diag ? reinterpret_cast<__half*>(sG) : atk_nd ? reinterpret_cast<__half*>(sQ) : sTh + C * LDC;
  Op* sV = QUAD ? nullptr : diag ? reinterpret_cast<Op*>(sG) : atk_nd ? sKWb : reinterpret_cast<Op*>(sAd);  // [C][LDV]
  Op* sPst = QUAD ? nullptr : diag || atk_nd ? reinterpret_cast<Op*>(sTh) : sTm;  // P's staging (QUAD: none)
  if (diag) sTm = reinterpret_cast<Op*>(sAh);
  if (atk_nd || QUAD) sTm = reinterpret_cast<Op*>(sTh);  // Tm = Tinv Diag(beta), formed element by element in place
  __shared__ __align__(16) float s_gam[C], s_gp[C], s_bp[C], s_eg[C];
  __shared__ __align__(16) float s_beta[C];  // read 16 bytes at a time when Tm is formed
  __shared__ __align__(16) float s_lbw[C + 4];  // the look-back's weights and product (lookback_weights)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t gc = blockIdx.x;
  int hv = blockIdx.y;
  if (ca.lookback) lookback_item(ca, &gc, &hv);
  const int h = hv / a.group;
  const ChunkPos p = chunk_pos(ca, gc);
  if (p.n < 0) return;
  const int L = p.L;
  Op* sKW = atk ? sKWb : sK;
  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  const Tin* v = static_cast<const Tin*>(a.v);

  // The v rows are staged only after the solve: start bringing them into L2 now (one 128-byte line
  // per thread and step) so that the late stage_rows finds them there. (With raw_v the state pass
  // reads them instead.)
  if (!QUAD && !ca.raw_v) {
    const char* v0 = reinterpret_cast<const char*>(v + p.b * a.sv[0] + p.t0 * a.sv[1] + hv * a.sv[2]);
    const int lines = (a.V * int(sizeof(Tin)) + 127) / 128;
    const int64_t row_bytes = a.sv[1] * int64_t(sizeof(Tin));
    for (int e = tid; e < L * lines; e += kThreads)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(v0 + (e / lines) * row_bytes + (e % lines) * 128));
  }
  // Diagonal preconditioner: the head's center now, and channel tid's statistics entering the chunk
  // (load_ain) once the q and k rows' loads are in flight, so that their latency overlaps the staging
  // instead of stalling the statistics' scan below. The statistics come from precond_scan_kernel, of
  // which this kernel is a programmatic dependent launch on Hopper: it waits for it only there. (The
  // forward's look-back, ChunkArgs::lookback, forms them after the rows are normalised: lookback_ain.)
  float A_in = 0.f, center = 0.f;
  if (has_p && tid < a.K) center = load_gate(a.center, h, a.gate_dtype);
  auto load_ain = [&] {
    if (!has_p || ca.lookback) return;  // (the look-back forms A_in below)
    grid_dependency_wait();
    if (tid < a.K) A_in = ca.Ain[(gc * a.H + h) * KP + tid];
  };
  // Gates of the chunk's tokens; rows past L: g = 0, beta = 0 (they write nothing).
  if (tid < C) {
    float g = 0.f, be = 0.f, gp = 1.f, bp = 0.f;  // gp holds exp(g_p)
    if (tid < L) {
      const int64_t t = p.t0 + tid;
      if (a.decay == kDecayScalar) g = load_gate(a.g, p.b * a.sg[0] + t * a.sg[1] + hv * a.sg[2], a.gate_dtype);
      be = a.beta ? load_gate(a.beta, p.b * a.sbeta[0] + t * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype) : 1.f;
      if (has_p) {
        gp = expf(load_gate(a.g_p, p.b * a.sgp[0] + t * a.sgp[1] + h * a.sgp[2], a.gate_dtype));
        bp = load_gate(a.beta_p, p.b * a.sbp[0] + t * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
      }
    }
    s_gam[tid] = g, s_beta[tid] = be, s_gp[tid] = gp, s_bp[tid] = bp;
    if (ca.pg) {  // the warpgroup state pass forms the write keys (ChunkArgs::kw_state)
      float* pg = ca.pg + (gc * a.HV + hv) * 2 * C;
      pg[tid] = gp, pg[C + tid] = bp;
    }
  }
  // Diagonal decay: thread c scans channel c's gamma over the chunk (g = 0 past L and past K, so
  // row C - 1 holds gamma_C); s_gam stays 0 and the scalar factors below are 1.
  if (diag) {
    const int c = tid, rows = c < a.K ? L : 0;
    const int64_t g0 = p.b * a.sg[0] + p.t0 * a.sg[1] + hv * a.sg[2] + c;
    auto scan = [&](auto type) {  // the gate's element type chosen once, not per load
      using G = decltype(type);
      const G* gp = static_cast<const G*>(a.g) + g0;
      float gs = 0.f;
#pragma unroll 1
      for (int r0 = 0; r0 < C; r0 += 32) {  // 32 loads in flight per thread
        float gv[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) gv[u] = r0 + u < rows ? to_float(gp[(r0 + u) * a.sg[1]]) : 0.f;
#pragma unroll
        for (int u = 0; u < 32; ++u) {
          gs += gv[u];
          const int r = r0 + u;
          if (!lean)
            sG[r * LDG + c] = gs;
          else if (r % 16 == 0 || r % 16 == 15)
            sGb[gamma_block_row(r) * KP + c] = gs;
        }
      }
    };
    if (a.gate_dtype == 1)
      scan(__nv_bfloat16{});
    else if (a.gate_dtype == 2)
      scan(__half{});
    else
      scan(float{});
  }
  // Raw q, k, v rows, then q and k normalised in place (q also scaled).
  {
    const int64_t t0 = p.t0;
    const Tin* q0 = q + p.b * a.sq[0] + t0 * a.sq[1] + h * a.sq[2];
    const Tin* k0 = k + p.b * a.sk[0] + t0 * a.sk[1] + h * a.sk[2];
    if (sizeof(Tin) == 2 && ca.vec_qk) {  // both tiles' loads in flight at once (32 registers each)
      RowLoads<Tin, KP> rq, rk;
      load_rows(rq, q0, a.sq[1], L, a.K);
      load_rows(rk, k0, a.sk[1], L, a.K);
      load_ain();
      store_rows<Tin, Op, KP>(sQ, LDK, rq);
      store_rows<Tin, Op, KP>(sK, LDK, rk);
    } else {
      stage_rows<Tin, Op, KP>(sQ, LDK, q0, a.sq[1], L, a.K, ca.vec_qk);
      stage_rows<Tin, Op, KP>(sK, LDK, k0, a.sk[1], L, a.K, ca.vec_qk);
      load_ain();
    }
  }
  __syncthreads();
  {
    // Backward mode with `rq`: the inverse norms of the chunk's rows (one value head per key head writes).
    // Raw rows for the state pass (ca.rn): every row's inverse norm (rows past L are zero rows there).
    const bool inv = !QUAD && ca.rq && hv % a.group == 0;
    const int64_t row0 = a.cu_seqlens ? p.t0 : p.b * a.T + p.t0;
    float* rn = ca.rn ? ca.rn + (gc * a.HV + hv) * 2 * C : nullptr;
    normalise_rows(sQ, a.l2norm, a.scale, inv ? ca.rq + row0 * a.H + h : rn, inv ? a.H : 1, inv ? L : C);
    normalise_rows(sK, a.l2norm, 1.f, inv ? ca.rk + row0 * a.H + h : rn ? rn + C : nullptr, inv ? a.H : 1,
                   inv ? L : C);
  }
  if (warp == 0) {  // gamma: cumulative log decay within the chunk (warp scan, two tokens per lane)
    float g0 = s_gam[2 * lane], g1 = s_gam[2 * lane + 1];
    warp_scan_pairs(g0, g1, lane);
    s_gam[2 * lane] = g0, s_gam[2 * lane + 1] = g1;
  }
  if (has_p && ca.lookback && warp == 1) lookback_weights(s_gp, s_bp, s_lbw, lane);
  __syncthreads();
  if (tid < C) s_eg[tid] = __expf(s_gam[tid]);
  if (has_p && ca.lookback) A_in = lookback_ain(ca, gc, hv, h, p, sK, s_lbw);
  // Diagonal preconditioner: thread c scans channel c's statistics from the chunk's entry value.
  if (has_p) {
    const int c = tid;
    Op* out = (atk ? sKWb : sQ) + c;  // column c of kw (DiagonalATK) or qr (DiagonalATQ)
    if (c < a.K) {
      float A = A_in;
      const float log2_x = a.log_x * 1.44269504089f;
      // 8 rows at a time: the statistics' chain first, then 8 independent squashes. Rows past L keep A
      // (g_p = 0, beta_p = 0 there) and have k = q = 0, so their kw (qr) is 0.
#pragma unroll 1
      for (int r0 = 0; r0 < C; r0 += 8) {
        float kn[8], Ar[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) kn[u] = to_float(sK[(r0 + u) * LDK + c]);
        const Float8 e8(s_gp + r0), b8(s_bp + r0);  // the 8 rows' e^g_p and beta_p (broadcast loads)
#pragma unroll
        for (int u = 0; u < 8; ++u) Ar[u] = A = stat_step(A, e8[u], b8[u], kn[u]);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float M = squash_fast(Ar[u], center, log2_x, a.eps);
          Op* o = out + (r0 + u) * LDK;
          *o = from_float<Op>((atk ? kn[u] : to_float(*o)) * M);
        }
      }
    }
    if (atk && c >= a.K)  // columns past K of kw are zero (q's already are)
      for (int r = 0; r < C; ++r) out[r * LDK] = from_float<Op>(0.f);
  }
  __syncthreads();

  // Q (or qr) and KW to the workspace with the chunk's gamma (the state pass applies the decays to
  // its accumulator rows), then K ⊙ e^gamma in place for W. Diagonal decay: the decays are applied
  // here per channel, Q ⊙ e^gamma and KW ⊙ e^(gamma_C - gamma), from the tiles diag_decay_akk_p left
  // (Q, K scaled by e^(gamma - gamma_16a), KW by e^(gamma_16a+15 - gamma) in sKWb).
  const int64_t tile = (gc * a.HV + hv) * C * KP;
  auto tiles_out = [&] {
    Op* Qn = static_cast<Op*>(ca.Qn) + tile;
    Op* KWn = ca.KWn ? static_cast<Op*>(ca.KWn) + tile : nullptr;  // (none: raw_kw, kw_state)
    static_assert(kThreads == 128 && KP == 128, "each thread keeps its 8 channels");
    if (diag) {
      // Thread tid keeps channels c8 = 8 (tid % 16) .. + 7 and rows tid / 16 + 8 h of every 16-row
      // block: the block's factors e^gamma_16a and e^(gamma_C - gamma_16a+15) once, then its two rows
      // together (their loads in flight at once, their stores from different registers).
      const int c8 = (tid % 16) * 8;
#pragma unroll 1
      for (int a16 = 0; a16 < C; a16 += 16) {
        float fea[8], fez[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          fea[j] = __expf(gamma_row<LEAN>(sG, sGb, a16)[c8 + j]);
          fez[j] = __expf(gamma_row<LEAN>(sG, sGb, C - 1)[c8 + j] - gamma_row<LEAN>(sG, sGb, a16 + 15)[c8 + j]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = a16 + tid / 16 + 8 * h, at = ca.blocked ? blocked_at(r, c8) : r * KP + c8;
          uint4 xq = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
          uint4 xw = *reinterpret_cast<const uint4*>(sKWb + r * LDK + c8);
          uint4 xk = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
          uint32_t* pq = reinterpret_cast<uint32_t*>(&xq);
          uint32_t* pw = reinterpret_cast<uint32_t*>(&xw);
          uint32_t* pk = reinterpret_cast<uint32_t*>(&xk);
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            const uint32_t fa = pack2<Op>(fea[j], fea[j + 1]), fz = pack2<Op>(fez[j], fez[j + 1]);
            pq[j / 2] = mul2<Op>(pq[j / 2], fa);
            pk[j / 2] = mul2<Op>(pk[j / 2], fa);
            pw[j / 2] = mul2<Op>(pw[j / 2], fz);
          }
          *reinterpret_cast<uint4*>(Qn + at) = xq;
          *reinterpret_cast<uint4*>(KWn + at) = xw;
          *reinterpret_cast<uint4*>(sK + r * LDK + c8) = xk;
          if (ca.bwd) *reinterpret_cast<uint4*>(static_cast<Op*>(ca.Kn) + tile + r * KP + c8) = xk;
          if (ca.raw_v)  // K ⊙ e^gamma in W's place
            *reinterpret_cast<uint4*>(static_cast<Op*>(ca.W) + tile + at) = xk;
        }
      }
    }
#pragma unroll
    for (int e = tid; e < (diag || QUAD == kQuadIdentity ? 0 : C * KP / 8); e += kThreads) {  // (raw rows: none)
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8, at = ca.blocked ? blocked_at(r, c8) : r * KP + c8;
      if (!ca.raw_q) *reinterpret_cast<uint4*>(Qn + at) = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
      if (KWn) *reinterpret_cast<uint4*>(KWn + at) = *reinterpret_cast<const uint4*>(sKW + r * LDK + c8);
      if (bwd)  // the read keys
        *reinterpret_cast<uint4*>(static_cast<Op*>(ca.Kn) + tile + r * KP + c8) =
            *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
    }
    if (tid < C) ca.gam[(gc * a.HV + hv) * C + tid] = s_gam[tid];
    if (diag) {
      ca.egC[(gc * a.HV + hv) * KP + tid] = __expf(gamma_row<LEAN>(sG, sGb, C - 1)[tid]);
      return;
    }
    // No W: the state pass scales its own raw k rows (chunk_workspace allocates W by the same test).
    if (QUAD || (ca.raw_v && (ca.raw_q || ca.raw_kw))) return;
    __syncthreads();  // KW may be K itself
    for (int e = tid; e < C * KP / 8; e += kThreads) {
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8;
      alignas(16) Op xk[8];
      *reinterpret_cast<uint4*>(xk) = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
#pragma unroll
      for (int j = 0; j < 8; ++j) xk[j] = from_float<Op>(to_float(xk[j]) * s_eg[r]);
      *reinterpret_cast<uint4*>(sK + r * LDK + c8) = *reinterpret_cast<const uint4*>(xk);
      // raw_v without raw rows: K ⊙ e^gamma itself in W's place (blocked), for the state pass's K S
      if (ca.raw_v)
        *reinterpret_cast<uint4*>(static_cast<Op*>(ca.W) + tile + blocked_at(r, c8)) = *reinterpret_cast<const uint4*>(xk);
    }
  };

  // Akk = beta_i (K KW^T)_ij e^(gamma_i - gamma_j) (j < i) and P = (Q KW^T)_ij e^(gamma_i - gamma_j) (j <= i).
  const int m0 = warp * 16;
  // This warp's diagonal block of Akk (row stride LDD floats).
  auto diag_block = [&] { return QUAD ? reinterpret_cast<float*>(sQ + m0 * LDK + C) : sAd + warp * 272; };
  if (diag && ca.bwd) {  // backward mode: the undecayed rows for the gradient kernel
    Op* Qu = static_cast<Op*>(ca.Qu) + tile;
    Op* Ku = static_cast<Op*>(ca.Ku) + tile;
    Op* KWu = static_cast<Op*>(ca.KWu) + tile;
    for (int e = tid; e < C * KP / 8; e += kThreads) {
      const int r = e / (KP / 8), c8 = (e % (KP / 8)) * 8;
      *reinterpret_cast<uint4*>(Qu + r * KP + c8) = *reinterpret_cast<const uint4*>(sQ + r * LDK + c8);
      *reinterpret_cast<uint4*>(Ku + r * KP + c8) = *reinterpret_cast<const uint4*>(sK + r * LDK + c8);
      if (atk) *reinterpret_cast<uint4*>(KWu + r * KP + c8) = *reinterpret_cast<const uint4*>(sKW + r * LDK + c8);
    }
    __syncthreads();  // diag_decay_akk_p scales the rows in place
  }
  if (diag) {
    GateRows gr;
    if (lean) {
      gr.g = static_cast<const char*>(a.g) +
             (p.b * a.sg[0] + p.t0 * a.sg[1] + hv * a.sg[2]) * (a.gate_dtype == 0 ? 4 : 2);
      gr.rs = a.sg[1], gr.dtype = a.gate_dtype, gr.L = L, gr.K = a.K;
    }
    Op* Pg = static_cast<Op*>(ca.P) + (gc * a.HV + hv) * C * C;
    diag_decay_akk_p<Op, LEAN>(sQ, sK, sKW, sKWb, sG, s_beta, a.online, ca.bwd, m0, sPst, sAd, sAh, sGb, gr, Pg);
    if (!lean) {  // (lean: P went straight to the workspace)
      __syncwarp();
      if (ca.bwd) times_beta_cols(sPst + m0 * LDC, s_beta);
      store_rows16(Pg, m0, C, sPst + m0 * LDC, LDC, C, ca.blocked);
    }
  } else {
    // The lower block triangle's ten 16 x 16 blocks, balanced over the warps (row block w alone would
    // give warp w w + 1 of them, and warp 3 four): block slot bs (< nbs) of warp w is block (row_of(bs),
    // col_of(bs)): warp 0 (0, 0), (3, 0), (3, 1); warp 1 (1, 0), (1, 1); warp 2 (2, 0), (2, 1), (2, 2);
    // warp 3 (3, 2), (3, 3). Each warp keeps its own diagonal block and writes the zeros right of it.
    const int nbs = warp == 0 || warp == 2 ? 3 : 2;
    auto row_of = [&](int bs) { return warp == 0 && bs > 0 ? 3 : warp; };
    auto col_of = [&](int bs) { return warp == 3 ? bs + 2 : warp == 0 ? (bs > 0 ? bs - 1 : 0) : bs; };
    float accA[6][4], accP[6][4];
#pragma unroll
    for (int i = 0; i < 6; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) accA[i][e] = accP[i][e] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t fk[4], fq[4], fk3[4], fq3[4];  // this warp's row block's fragments; warp 0: also row block 3's
      load_a(fk, sK, LDK, m0, k0);
      load_a(fq, sQ, LDK, m0, k0);
      if (warp == 0) {
        load_a(fk3, sK, LDK, 48, k0);
        load_a(fq3, sQ, LDK, 48, k0);
      }
#pragma unroll
      for (int bs = 0; bs < 3; ++bs) {
        if (bs >= nbs) break;
        const bool r3 = warp == 0 && bs > 0;
        uint32_t ak[4], aq[4], fb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) ak[u] = r3 ? fk3[u] : fk[u], aq[u] = r3 ? fq3[u] : fq[u];
        load_b(fb, sKW, LDK, 16 * col_of(bs), k0);
        if (online) {
          mma<Op>(accA[2 * bs], ak, fb);
          mma<Op>(accA[2 * bs + 1], ak, fb + 2);
        }
        mma<Op>(accP[2 * bs], aq, fb);
        mma<Op>(accP[2 * bs + 1], aq, fb + 2);
      }
    }
    Op* P = static_cast<Op*>(ca.P) + (gc * a.HV + hv) * C * C;
    // QUAD: P's pairs straight to the workspace (blocked: an n-tile's 16 rows are 256 contiguous bytes).
    auto p_at = [&](int i, int j) { return QUAD ? P + blocked_at(i, j & ~7) + (j & 7) : sPst + i * LDC + j; };
    // QUAD: every warp's q fragments are read (row block 3's by warps 0 and 3) before Akk's rows take their place.
    if (QUAD) __syncthreads();
    for (int nt = 2 * warp + 2; nt < 8; ++nt) {  // P's blocks right of this warp's diagonal block are zero
      const int j = acc_col(nt * 8, 0);
      store2(p_at(acc_row(m0, 0), j), 0.f, 0.f);
      store2(p_at(acc_row(m0, 2), j), 0.f, 0.f);
    }
    // The blocks left of the diagonal need no mask, the diagonal block (col_of = row_of) does.
#pragma unroll
    for (int bs = 0; bs < 3; ++bs) {
      if (bs >= nbs) break;
      const int ra = row_of(bs), bj = col_of(bs), r0 = 16 * ra;
      const float gi[2] = {s_gam[acc_row(r0, 0)], s_gam[acc_row(r0, 2)]};
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int nt = 2 * bs + t, j = acc_col(16 * bj + 8 * t, 0);
        const float gj0 = s_gam[j], gj1 = s_gam[j + 1];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = acc_row(r0, e);
          float d0 = __expf(gi[e / 2] - gj0), d1 = __expf(gi[e / 2] - gj1);
          if (bj == ra) d0 = j <= i ? d0 : 0.f, d1 = j + 1 <= i ? d1 : 0.f;
          store2(p_at(i, j), accP[nt][e] * d0, accP[nt][e + 1] * d1);  // (staged: copied below)
          if (!online) continue;
          // Diag(beta) Bm, or Bm Diag(beta) in backward mode (T2)
          float x0 = s_beta[bwd ? j : i] * accA[nt][e] * d0;
          float x1 = s_beta[bwd ? j + 1 : i] * accA[nt][e + 1] * d1;
          if (bj == ra) {  // (this warp's own diagonal block)
            float* sAdw = diag_block();
            x0 = j < i ? x0 : 0.f, x1 = j + 1 < i ? x1 : 0.f;
            sAdw[(i % 16) * LDD + j % 16] = x0;
            sAdw[(i % 16) * LDD + j % 16 + 1] = x1;
          } else {
            *reinterpret_cast<__half2*>(sAh + i * LDH + j) = __floats2half2_rn(x0, x1);
          }
        }
      }
    }
    if (!QUAD) {  // the staged rows of P out (row block 3's came from two warps)
      __syncthreads();
      if (bwd) times_beta_cols(sPst + m0 * LDC, s_beta);
      store_rows16(P, m0, C, sPst + m0 * LDC, LDC, C, ca.blocked);
    }
  }
  __syncthreads();
  if (diag || atk_nd) {  // the tiles out now: gamma's region (or the q tile) is the solve's scratch from here on
    tiles_out();
    __syncthreads();
  }

  // Tinv = (I + Akk)^{-1} (unit lower triangular): the 16 x 16 diagonal blocks by substitution in
  // float32 (warp w, lane = column), then, one row of blocks at a time, the blocks below them on
  // tensor cores (f16 operands, float32 accumulation; warp bj computes block (bi, bj)):
  // T[bi][bj] = -T[bi][bi] sum_{l=bj}^{bi-1} A[bi][l] T[l][bj].
  if (online) {
    if (lane < 16) {
      const float* Ad = diag_block();
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float s = i == lane ? 1.f : 0.f;
#pragma unroll
        for (int l = 0; l < i; ++l) s -= Ad[i * LDD + l] * x[l];
        x[i] = s;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) sTh[(warp * 16 + i) * LDC + warp * 16 + lane] = __float2half_rn(x[i]);
    }
    __syncthreads();
    __half* X = sXh + warp * 16 * 24;
    for (int bi = 1; bi < 4; ++bi) {
      if (warp < bi) {
        const int bj = warp;
        float acc[2][4] = {};
        for (int lb = bj; lb < bi; ++lb) {
          uint32_t fa[4], fb[4];
          load_a(fa, sAh, LDH, bi * 16, lb * 16);
          load_b_t(fb, sTh, LDC, lb * 16, bj * 16);
          mma<__half>(acc[0], fa, fb);
          mma<__half>(acc[1], fa, fb + 2);
        }
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 4; e += 2) store2(X + acc_row(0, e) * 24 + acc_col(8 * t, e), acc[t][e], acc[t][e + 1]);
        __syncwarp();
        float y[2][4] = {};
        uint32_t fa[4], fb[4];
        load_a(fa, sTh, LDC, bi * 16, bi * 16);
        load_b_t(fb, X, 24, 0, 0);
        mma<__half>(y[0], fa, fb);
        mma<__half>(y[1], fa, fb + 2);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int e = 0; e < 4; e += 2)
            store2(sTh + acc_row(bi * 16, e) * LDC + acc_col(bj * 16 + 8 * t, e), -y[t][e], -y[t][e + 1]);
        __syncwarp();
      }
      __syncthreads();
    }
  }
  // Tm = Tinv Diag(beta) (Offline: Diag(beta)); backward mode: Tm = T2 = Tinv (Offline: I), also
  // written to the workspace.
  // Eight entries per thread and step, read 16 bytes at a time (in place for atk_nd: the same slots).
  Op* T2 = bwd ? static_cast<Op*>(ca.T2) + (gc * a.HV + hv) * C * C : nullptr;
  Op* Tmw = ca.raw_v ? static_cast<Op*>(ca.Tm) + (gc * a.HV + hv) * C * C : nullptr;  // blocked, for the state pass
  static_assert(C * C / 8 % kThreads == 0, "whole steps");
#pragma unroll
  for (int e = tid; e < C * C / 8; e += kThreads) {
    const int i = e / (C / 8), j0 = (e % (C / 8)) * 8;
    // Tinv below the diagonal: groups of 8 columns left of i lie in blocks the solve wrote (a group
    // holding i too has exact zeros right of i and 1 at i); groups from i on hold 1 at i only.
    uint4 th = make_uint4(0, 0, 0, 0);
    if (online && j0 < i) th = *reinterpret_cast<const uint4*>(sTh + i * LDC + j0);
    const __half2* th2 = reinterpret_cast<const __half2*>(&th);
    const float4 b0 = *reinterpret_cast<const float4*>(s_beta + j0), b1 = *reinterpret_cast<const float4*>(s_beta + j0 + 4);
    const float bj[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    uint4 t8;
    uint32_t* t2 = reinterpret_cast<uint32_t*>(&t8);
#pragma unroll
    for (int q2 = 0; q2 < 4; ++q2) {
      float2 t = __half22float2(th2[q2]);
      const int j = j0 + 2 * q2;
      t.x = j == i ? 1.f : t.x, t.y = j + 1 == i ? 1.f : t.y;
      t2[q2] = bwd ? pack2<Op>(t.x, t.y) : pack2<Op>(t.x * bj[2 * q2], t.y * bj[2 * q2 + 1]);
    }
    *reinterpret_cast<uint4*>(sTm + i * LDC + j0) = t8;
    if (T2) *reinterpret_cast<uint4*>(T2 + i * C + j0) = t8;
    if (Tmw) *reinterpret_cast<uint4*>(Tmw + blocked_at(i, j0)) = t8;
  }
  __syncthreads();  // Tm is formed: the Akk / inverse region is free from here on
  if (!diag && !atk_nd) tiles_out();
  if (QUAD || ca.raw_v) return;  // the state pass makes W S and U from Tm, the k rows and the raw v rows
  {  // v rows into the (now free) Akk / inverse region
    const Tin* v0 = v + p.b * a.sv[0] + p.t0 * a.sv[1] + hv * a.sv[2];
    if (ca.Vpad == 64)
      stage_rows<Tin, Op, 64>(sV, LDV, v0, a.sv[1], L, a.V, ca.vec_v);
    else
      stage_rows<Tin, Op, 128>(sV, LDV, v0, a.sv[1], L, a.V, ca.vec_v);
  }
  __syncthreads();

  // U = Tm V and W = Tm (K ⊙ e^gamma): warp w's 16 rows, k over the chunk's C tokens.
  uint32_t fa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) load_a(fa[kk], sTm, LDC, m0, kk * 16);
  // Results go through this warp's 16 rows of the (no longer needed) q tile, then out 16 bytes at a time.
  Op* stage = sQ + m0 * LDK;
  tm_times<Op>(fa, sV, LDV, ca.Vpad, stage, static_cast<Op*>(ca.U) + (gc * a.HV + hv) * C * ca.Vpad, m0, ca.Vpad,
               ca.blocked);
  if (a.online) {
    __syncwarp();
    tm_times<Op>(fa, sK, LDK, KP, stage, static_cast<Op*>(ca.W) + tile, m0, KP, ca.blocked);
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

/// Starts the copy (NT threads, as copy_tile_async) of a chunk's row factors for the sequential passes
/// into dst: gamma (C floats) and after it, for raw rows, their inverse norms (2 C floats); with
/// Diagonal decay e^gamma_C (128 floats) instead. head_chunk: (global chunk) x HV + value head.
template <int NT, class Op>
__device__ __forceinline__ void copy_row_factors(Op* dst, const ChunkArgs& ca, int64_t head_chunk, bool diag) {
  const int64_t tile = head_chunk * C;
  if (diag)
    copy_tile_async<2 * KP, NT>(dst, 2 * KP, reinterpret_cast<const Op*>(ca.egC + head_chunk * KP), 2 * KP, 1);
  else
    copy_tile_async<2 * C, NT>(dst, 2 * C, reinterpret_cast<const Op*>(ca.gam + tile), 2 * C, 1);
  if (ca.rn) copy_tile_async<4 * C, NT>(dst + 2 * C, 4 * C, reinterpret_cast<const Op*>(ca.rn + 2 * tile), 4 * C, 1);
}

/// The tile buffers of the sequential passes, warp-specialised: one producer warp copies each
/// chunk's tiles (cp.async) ahead while the NT compute threads work, so the compute warps issue no
/// copies (the copy loops were 28-30% of their time at T = 32768, one warp per scheduler). The hand-
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

/// Per (sequence, value head, VT value columns): the sequential pass over the sequence's chunks, on
/// WARPS warps. The float32 state rows RW w .. RW w + RW - 1 (RW = 128 / WARPS) live in warp w's
/// accumulators, its operand copy in sS. In the C-row products warp w owns rows 16 (w % 4) .. + 15
/// and the value columns of group w / 4. The next chunks' tiles are copied while the current one is
/// computed: by a fifth warp with 4 compute warps (ProducerPipe), by the compute warps themselves
/// with 8. With CKPT (backward mode) it writes the state entering each chunk and the chunk's R (the
/// residuals r) instead of o.
template <class Tin, class Op, int VT, int WARPS, bool CKPT, int NBUF>
__global__ void __launch_bounds__(WARPS * 32 + (WARPS == 4 ? 32 : 0)) state_kernel(const ChunkArgs ca) {
  const RecArgs& a = ca.a;
  // With 4 compute warps, warp 4 copies the tiles (ProducerPipe, NBUF buffers); with 8 the compute
  // warps copy one chunk ahead themselves (NBUF = 2; a producer made the B = 8 checkpointing pass slower).
  constexpr bool PROD = WARPS == 4;
  static_assert(PROD || NBUF == 2, "buffers");
  constexpr int THREADS = WARPS * 32;
  constexpr int LDV = VT + 8;
  constexpr int NT = VT / 8;                    // n-tiles of the state
  constexpr int RW = KP / WARPS, MT = RW / 16;  // state rows and m-tiles per warp
  constexpr int CG = WARPS / 4;                 // column groups of the C-row products
  constexpr int NTW = NT / CG;                  // their n-tiles per warp
  static_assert(NTW % 2 == 0 && MT >= 1, "tile split");
  constexpr int BUF = state_buffer_elems(VT);
  extern __shared__ __align__(16) unsigned char smem[];
  Op* sBuf = reinterpret_cast<Op*>(smem);  // NBUF x {W, Q, KW [C][LDK], U [C][LDV], P [C][LDC], gamma [C] float}
  Op* sS = sBuf + NBUF * BUF;              // [KP][LDV]
  Op* sR = sS + KP * LDV;                  // [C][LDV] R = U - W S
  Op* sRs = sR + C * LDV;                  // [C][LDV] R ⊙ e^(gamma_C - gamma), zero past L

  const int warp = threadIdx.x >> 5;
  const bool diag = a.decay == kDecayDiagonal;
  const int n = blockIdx.z, hv = blockIdx.y, v0 = blockIdx.x * VT;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : 0, b = a.cu_seqlens ? 0 : n;

  auto issue = [&](int64_t ci, int bi, auto nt) {  // chunk ci into buffer bi, copied by nt threads
    constexpr int CT = decltype(nt)::value;
    Op* buf = sBuf + bi * BUF;
    const int64_t tile = ((first + ci) * a.HV + hv) * C;
    if (a.online) copy_tile_async<KP, CT>(buf, LDK, static_cast<const Op*>(ca.W) + tile * KP, KP, C);
    // q and k rows of the inputs (ChunkArgs::raw_q, raw_kw: 16-bit inputs, zero past the sequence),
    // else the intra kernel's tiles.
    const int rows = static_cast<int>(imin64(C, len - ci * C));
    const int64_t t = bos + ci * C, h = hv / a.group;
    if (ca.raw_q)
      copy_rows_zfill_async<CT>(buf + C * LDK, LDK,
                                static_cast<const Op*>(a.q) + b * a.sq[0] + t * a.sq[1] + h * a.sq[2], a.sq[1], rows);
    else
      copy_tile_async<KP, CT>(buf + C * LDK, LDK, static_cast<const Op*>(ca.Qn) + tile * KP, KP, C);
    if (ca.raw_kw)
      copy_rows_zfill_async<CT>(buf + 2 * C * LDK, LDK,
                                static_cast<const Op*>(a.k) + b * a.sk[0] + t * a.sk[1] + h * a.sk[2], a.sk[1], rows);
    else
      copy_tile_async<KP, CT>(buf + 2 * C * LDK, LDK, static_cast<const Op*>(ca.KWn) + tile * KP, KP, C);
    copy_tile_async<VT, CT>(buf + 3 * C * LDK, LDV, static_cast<const Op*>(ca.U) + tile * ca.Vpad + v0, ca.Vpad, C);
    copy_tile_async<C, CT>(buf + 3 * C * LDK + C * LDV, LDC, static_cast<const Op*>(ca.P) + tile * C, C, C);
    copy_row_factors<CT>(buf + 3 * C * LDK + C * LDV + C * LDC, ca, (first + ci) * a.HV + hv, diag);
    if (!PROD) cp_commit();
  };
  using Pipe = ProducerPipe<NBUF, THREADS>;
  typename Pipe::Slot slot;  // the current chunk's buffer
  if constexpr (PROD) {
    if (warp == WARPS) {  // the producer
      Pipe::produce(count, [&](int64_t ci, int bi) { issue(ci, bi, std::integral_constant<int, 32>{}); });
      return;
    }
  } else if (count > 0) {
    issue(0, 0, std::integral_constant<int, THREADS>{});
  }

  float S[MT][NT][4];
  // f(state element, its row, its global value column) for every accumulator element of this thread.
  auto each_state = [&](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(S[mt][nt][e], acc_row(RW * warp + 16 * mt, e), v0 + acc_col(8 * nt, e));
  };
  each_state([&](float& x, int row, int col) {
    x = (a.h0 && row < a.K && col < a.V) ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + row * a.sh0[2] + col] : 0.f;
    sS[row * LDV + col - v0] = from_float<Op>(x);
  });
  Tin* o = static_cast<Tin*>(a.o);
  const bool want_o = !CKPT || o != nullptr;  // backward mode: o too for a training forward (P holds P Diag(beta))
  const int m0 = 16 * (warp % 4), c0 = (warp / 4) * NTW * 8;
  // Backward mode: the gains of rows m0 + lane / 4 (+ 8) of chunk ci (0 past the sequence).
  auto load_gains = [&](int64_t ci, float* gains) {
    const int64_t t = bos + ci * C + acc_row(m0, 0);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const bool ok = ci * C + acc_row(m0, 0) + 8 * u < len;
      gains[u] = !ok      ? 0.f
                 : a.beta ? load_gate(a.beta, b * a.sbeta[0] + (t + 8 * u) * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype)
                          : 1.f;
    }
  };
  float gain_next[2] = {1.f, 1.f};
  if (CKPT && count > 0) load_gains(0, gain_next);
  for (int64_t ci = 0; ci < count; ++ci) {
    const int L = static_cast<int>(imin64(C, len - ci * C));
    if constexpr (PROD) {
      Pipe::wait_full(slot);
    } else if (ci + 1 < count) {
      issue(ci + 1, slot.buf ^ 1, std::integral_constant<int, THREADS>{});
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    sync_compute<THREADS>();  // also orders the previous chunk's sS writes before this chunk's reads
    const Op* sW = sBuf + slot.buf * BUF;
    const Op* sQ = sW + C * LDK;
    const Op* sKW = sW + 2 * C * LDK;
    const Op* sU = sW + 3 * C * LDK;
    const Op* sP = sU + C * LDV;
    const float* sG =
        reinterpret_cast<const float*>(sP + C * LDC);  // gamma of the chunk's tokens (Diagonal: e^gamma_C)
    const float* sRn = sG + C;                           // raw rows: inverse norms of q, then of k
    const float gl = diag ? 0.f : sG[L - 1], gC = __expf(gl);
    const int64_t vtile = ((first + ci) * a.HV + hv) * int64_t(ca.Vpad);  // (chunk, head) tile, in rows of Vpad
    if (CKPT) store_tile<VT, THREADS>(static_cast<Op*>(ca.S0) + vtile * KP + v0, ca.Vpad, sS, LDV, KP);
    // R = U - W S and Q S for rows m0 .. m0 + 15.
    float ws[NTW][4], acc_o[NTW][4];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ws[nt][e] = acc_o[nt][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t fw[4], fq[4];
      if (want_o) load_a(fq, sQ, LDK, m0, k0);
      if (a.online) load_a(fw, sW, LDK, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sS, LDV, k0, c0 + nt * 8);
        if (want_o) {
          mma<Op>(acc_o[nt], fq, fb);
          mma<Op>(acc_o[nt + 1], fq, fb + 2);
        }
        if (a.online) {
          mma<Op>(ws[nt], fw, fb);
          mma<Op>(ws[nt + 1], fw, fb + 2);
        }
      }
    }
    // Rows i of O get e^gamma_i (O = (Q ⊙ e^gamma) S + P R); R's copy for the state update gets
    // e^(gamma_C - gamma_i), zero past L.
    const int ra = acc_row(m0, 0), rb = ra + 8;
    // (Diagonal decay: the intra-chunk kernel applied both per channel to Q and KW.)
    // Raw rows (ChunkArgs::raw_q, raw_kw): their inverse norms (and q's scale) join these factors.
    const float eo[2] = {diag ? 1.f : __expf(sG[ra]) * (ca.raw_q ? sRn[ra] * a.scale : 1.f),
                         diag ? 1.f : __expf(sG[rb]) * (ca.raw_q ? sRn[rb] * a.scale : 1.f)};
    float es[2] = {ra < L ? (diag ? 1.f : __expf(gl - sG[ra]) * (ca.raw_kw ? sRn[C + ra] : 1.f)) : 0.f,
                   rb < L ? (diag ? 1.f : __expf(gl - sG[rb]) * (ca.raw_kw ? sRn[C + rb] : 1.f)) : 0.f};
    if (CKPT) {  // R = r here: the update's rows get the gains (loaded one chunk ahead)
      es[0] *= gain_next[0], es[1] *= gain_next[1];
      if (ci + 1 < count) load_gains(ci + 1, gain_next);
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = acc_row(m0, e), j = acc_col(c0 + 8 * nt, e);
        const float r0 = to_float(sU[i * LDV + j]) - ws[nt][e], r1 = to_float(sU[i * LDV + j + 1]) - ws[nt][e + 1];
        store2(sR + i * LDV + j, r0, r1);
        store2(sRs + i * LDV + j, r0 * es[e >> 1], r1 * es[e >> 1]);
        acc_o[nt][e] *= eo[e >> 1], acc_o[nt][e + 1] *= eo[e >> 1];
      }
    sync_compute<THREADS>();
    if (CKPT) store_tile<VT, THREADS>(static_cast<Op*>(ca.Rr) + vtile * C + v0, ca.Vpad, sR, LDV, C);
      // O += P R.
#pragma unroll
    for (int k0 = 0; k0 < (want_o ? C : 0); k0 += 16) {
      uint32_t fp[4];
      load_a(fp, sP, LDC, m0, k0);
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t fb[4];
        load_b_t(fb, sR, LDV, k0, c0 + nt * 8);
        mma<Op>(acc_o[nt], fp, fb);
        mma<Op>(acc_o[nt + 1], fp, fb + 2);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = acc_row(m0, e), col = v0 + acc_col(c0 + 8 * nt, e);
        if (want_o && i < L)
          write_pair(o + b * a.so[0] + (bos + ci * C + i) * a.so[1] + hv * a.so[2] + col, acc_o[nt][e],
                     acc_o[nt][e + 1], ca.pair_o, col < a.V, col + 1 < a.V);
      }
      // S <- e^gamma_C S + KW^T (R ⊙ e^(gamma_C - gamma)) (Diagonal decay: state row c times e^gamma_C[c]).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float d0 = diag ? sG[acc_row(RW * warp + 16 * mt, 0)] : gC;
      const float d1 = diag ? sG[acc_row(RW * warp + 16 * mt, 2)] : gC;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= e < 2 ? d0 : d1;
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        uint32_t fk[4];
        load_a_t(fk, sKW, LDK, RW * warp + 16 * mt, k0);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t fb[4];
          load_b_t(fb, sRs, LDV, k0, nt * 8);
          mma<Op>(S[mt][nt], fk, fb);
          mma<Op>(S[mt][nt + 1], fk, fb + 2);
        }
      }
    }
    sync_compute<THREADS>();  // every warp is done reading sS, sR, sRs and this chunk's buffer
    if constexpr (PROD) {
      Pipe::release(slot, ci, count);
      slot.next();
    } else {
      slot.buf ^= 1;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store2(sS + acc_row(RW * warp + 16 * mt, e) * LDV + acc_col(8 * nt, e), S[mt][nt][e], S[mt][nt][e + 1]);
  }
  if (a.hT)
    each_state([&](float& x, int row, int col) {
      if (row < a.K && col < a.V) a.hT[int64_t(n) * a.shT[0] + hv * a.shT[1] + row * a.shT[2] + col] = x;
    });
}

/// Starts the asynchronous copy (threads 0 .. NT - 1) of a chunk's C rows of COLS 16-bit elements from
/// global memory (row stride gld) into a blocked tile at dst (wgmma.cuh; column groups of kWgColGroup
/// bytes): eight consecutive threads copy 16 consecutive bytes of one row each, into eight different
/// bank groups. Rows from `valid` on are zero-filled and nothing is read for them. Each thread steps
/// one source pointer; its destination offsets are compile-time constants past its own.
template <int COLS, int NT, class Op>
__device__ __forceinline__ void copy_blocked_async(unsigned char* dst, const Op* src, int64_t gld, int valid) {
  constexpr int PR = COLS / 8, RPP = NT / PR, RG = PR * kWgColGroup;  // RPP rows per pass
  static_assert(NT % PR == 0 && RPP % 8 == 0 && C % RPP == 0, "whole row groups per pass");
  const int t = threadIdx.x, r0 = t / PR, j = t % PR;
  const Op* s = src + r0 * gld + 8 * j;
  const int64_t step = RPP * gld;
  dst += (r0 / 8) * RG + (r0 % 8) * 16 + j * kWgColGroup;
#pragma unroll
  for (int r = 0; r < C; r += RPP, s += step) {
    const bool ok = r + r0 < valid;
    cp_async16_zfill(dst + (r / 8) * RG, ok ? s : src, ok ? 16 : 0);
  }
}

/// Starts the asynchronous copy (NT threads, NT a multiple of C) of a chunk's C rows of 128 16-bit
/// elements (row stride gld) into a packed blocked tile at dst (column groups of C rows x 16 bytes):
/// thread t copies row t % C of column groups t / C, t / C + NT / C, ... Rows from `valid` on are
/// zero-filled and nothing is read for them. (The warpgroup state pass's fallback for a sequence's
/// last, partial chunk of packed sequences, whose rows past its end the tensor copy would read from
/// the next sequence.)
template <int NT, class Op>
__device__ __forceinline__ void copy_packed_async(unsigned char* dst, const Op* src, int64_t gld, int valid) {
  static_assert(NT % C == 0, "whole rows per pass");
  const int r = threadIdx.x % C;
  const bool ok = r < valid;
#pragma unroll
  for (int grp = threadIdx.x / C; grp < KP / 8; grp += NT / C)
    cp_async16_zfill(dst + grp * C * 16 + r * 16, ok ? src + r * gld + 8 * grp : src, ok ? 16 : 0);
}

/// state_wg_kernel's compile-time paths (its MODE bits): Diagonal decay, raw v rows, the write keys formed
/// in the pass (ChunkArgs::kw_state).
constexpr int kWgDiag = 1, kWgRawV = 2, kWgKW = 4;

/// The forward's sequential pass (state_kernel without backward mode) on Hopper's warpgroup products
/// (sm_90a; wgmma.cuh), for 64 x WGS value columns. It keeps the transposed state: warpgroup g holds
/// S^T for value columns 64 g .. 64 g + 63 (64 x 128, float32) in its accumulators, so every product
/// of the chunk takes its A operand from registers (an accumulator converted to 16 bits is an A
/// fragment) and its B operand from the chunk's tiles, and nothing the chain produces goes through
/// shared memory:
///   R^T = U^T - S^T W^T and O^T = S^T Q^T (8 + 8 products of 64 x 64 x 16),
///   O^T <- O^T Diag(e^gamma) + R^T P^T (4) and S^T <- e^gamma_C S^T + (R^T Diag(e^(gamma_C - gamma))) KW
///   (4 of 64 x 128 x 16).
/// The next chunk's tiles are copied while the current one is computed (two buffers): thread 0 issues
/// one bulk copy per tile the intra-chunk kernel wrote blocked (W, Q, KW, P, U, the row factors),
/// completing on the buffer's mbarrier. Raw q and k rows (ChunkArgs::raw_q, raw_kw) come by tensor
/// copies through the maps tq and tk (ChunkArgs::tma_rows; a packed sequence's last, partial chunk by
/// cp.async), or else by every thread (cp.async) into padded column groups.
/// With ChunkArgs::raw_v (Online, V = 128, 128 columns) the intra-chunk kernel wrote the solve Tm instead
/// of W and U, and R^T comes from the k rows and the raw v rows (map tv over v; raw k through tk):
///   Z^T = S^T K^T (8 products, K the raw k rows), Y^T = V^T - Z^T Diag(e^gamma rn_k) in registers,
///   R^T = Y^T Tm^T (4 more products, A = Y^T from registers), since W S = Tm Diag(e^gamma) K S;
/// without raw rows (kg) K is the intra-chunk kernel's K ⊙ e^gamma in W's place and Y^T = V^T - Z^T.
/// Split state pass (ChunkArgs::split; 128 columns with raw_v): block z runs segment z % segments of
/// sequence z / segments. With TR (pass 1, segments but the last) block x = 0 starts from S = I and
/// reads no v rows (its state at the segment's end is the segment's transition A), x = 1 from S = 0
/// (the offset B); neither forms O, so no q rows and no P are copied; each writes S^T to Tseg. Without
/// TR (pass 2) each segment starts from Sseg (split_scan_kernel's) and the last one writes hT.
/// O^T leaves through a staging tile (stmatrix, transposed to token rows) written 16 bytes per thread
/// where o's rows allow it (ChunkArgs::vec_o, 16-bit o), else element by element.
/// MODE (compile-time paths, so that a launch issues no code of the others): kWgDiag for Diagonal
/// decay, kWgRawV for raw v rows (ChunkArgs::raw_v; 128 columns), kWgKW for the write keys formed in the
/// pass (ChunkArgs::kw_state: a third warpgroup forms them while the two compute warpgroups run the
/// chain); the launcher picks it (launch_state_wg).
template <class Tin, class Op, int WGS, bool TR = false, int MODE = TR ? kWgRawV : 0>
__global__ void __launch_bounds__(WGS * 128 + (MODE & kWgKW ? 128 : 0), 1)
    state_wg_kernel(const ChunkArgs ca, const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                    const __grid_constant__ CUtensorMap tv) {
#if DGPS_WGMMA
  const RecArgs& a = ca.a;
  constexpr int VT = 64 * WGS, NT = WGS * 128;
  constexpr int CGP = kWgColGroup;   // column group of the raw rows' tiles
  constexpr int RGK = KP / 8 * CGP;  // and their row group
  constexpr int CGB = C * 16;        // column group of the packed tiles (row group: 128 bytes)
  constexpr int BUF = wg_buffer_bytes(VT);
  constexpr int UOFF = wg_u_off(), POFF = wg_p_off(VT), GOFF = wg_g_off(VT), QOFF = wg_q_off(VT), KWOFF = wg_kw_off(VT);
  constexpr int TMOFF = wg_tm_off(VT), OOFF = wg_o_off(VT);
  extern __shared__ __align__(128) unsigned char smem[];
  // The warp index through a shuffle: ptxas then knows it is uniform, and the products are not on a
  // divergent path (which would serialise them).
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), g = warp / 4;
  const int m0 = 16 * (warp % 4), wt = threadIdx.x % 128;
  float* s_eo = reinterpret_cast<float*>(smem + 2 * BUF) + g * 3 * C;  // the warpgroup's row factors of O
  float* s_es = s_eo + C;                                              // of R's copy for the update
  float* s_ez = s_es + C;                                              // and of K's rows in Z (raw_v)
  const uint32_t bar0 = smem_addr(smem + 2 * BUF + sizeof(float) * 3 * C * WGS);  // buffer b's mbarrier: bar0 + 8 b
  const uint32_t barw0 = bar0 + 16;  // kw_state: buffer b's write-key inputs' mbarrier, barw0 + 8 b
  // Diagonal decay and raw v rows at compile time (MODE): the code of the paths a launch does not take
  // would otherwise be issued under false predicates.
  constexpr bool diag = MODE & kWgDiag, rv = MODE & kWgRawV, kwf = MODE & kWgKW;
  static_assert(!kwf || (rv && !diag && WGS == 2), "kw_state: raw rows, 128 columns");
  const bool raw = ca.raw_q || ca.raw_kw;
  // raw_v: the raw v rows in U's place; Z's k rows are KW's tile when that is raw k (raw_kw), raw k rows
  // copied into W's place when q's rows are raw but KW is not k (rk), or else the intra-chunk kernel's
  // K ⊙ e^gamma (normalised and decayed already) in W's place (kg).
  // (128 columns only: the host sets raw_v with 128-column tiles, and v's tile is then one packed key tile.)
  const bool rk = rv && raw && !ca.raw_kw, kg = rv && !raw;
  static_assert(!rv || 2 * C * VT == kWgPacked, "raw v rows: a 128-column v tile is one packed key tile");
  static_assert(!TR || rv, "the split pass runs 128-column tiles with raw v rows");
  // Chunk ci's raw rows by cp.async (its copies then need a proxy fence and a barrier before the products)?
  auto rows_by_threads = [&](int rows) { return (raw || rv) && (!ca.tma_rows || (a.cu_seqlens && rows < C)); };
  // Split pass: segment `seg` of sequence n (TR: part 0 the transition, 1 the offset); TR reads the q
  // rows, P and (part 0) v rows not at all.
  const bool split = ca.split > 1;
  const int segs = split ? ca.split - TR : 1, n = blockIdx.z / segs, seg = blockIdx.z % segs, hv = blockIdx.y;
  const int part = TR ? blockIdx.x : 0, v0 = (TR ? 0 : blockIdx.x * VT) + 64 * g;  // the warpgroup's first column
  const bool need_v = !TR || part == 1;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t c0 = split ? seg * ca.seg_chunks : 0, cend = split ? imin64(count, c0 + ca.seg_chunks) : count;
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : 0, b = a.cu_seqlens ? 0 : n;
  if (!a.online) {  // Offline solve: W's tiles stay zero (never copied), so R = U
    for (int e = threadIdx.x; e < 2 * kWgPacked / 16; e += NT)
      *reinterpret_cast<uint4*>(smem + (e / (kWgPacked / 16)) * BUF + (e % (kWgPacked / 16)) * 16) = uint4{};
  }
  if (threadIdx.x == 0) {
    wg::bar_init(bar0);
    wg::bar_init(bar0 + 8);
    wg::bar_init(barw0);
    wg::bar_init(barw0 + 8);
  }
  __syncthreads();
  // Bytes of one chunk's bulk copies (the same for every chunk).
  const uint32_t bulk_bytes = (a.online && (!rv || kg) ? kWgPacked : 0) + (rv ? 2 * C * C : 2 * C * VT) +
                              (TR ? 0 : 2 * C * C) + (diag ? 4 * KP : 4 * C + (ca.rn && !kwf ? 8 * C : 0)) +
                              (ca.raw_q || TR ? 0 : kWgPacked) + (ca.raw_kw || kwf ? 0 : kWgPacked);
  // kw_state: the write keys' inputs (the raw k rows where a tensor copy brings them, the rows' inverse
  // norms, the statistics entering the chunk, the rows' e^g_p and beta_p) are issued first and complete
  // on their own mbarrier, so that the KW warpgroup starts before the chunk's other tiles have landed.
  const uint32_t kw_bytes = 8 * C + kWgFactorBytes - kWgAinOff;
  const bool rq = ca.raw_q && !TR, rvc = rv && need_v;  // raw q rows, raw v rows copied
  auto issue = [&](int64_t ci, int bi) {  // chunk ci into buffer bi
    unsigned char* buf = smem + bi * BUF;
    const int64_t hc = (first + ci) * a.HV + hv, tile = hc * C;
    const int rows = static_cast<int>(imin64(C, len - ci * C));
    const int64_t t = bos + ci * C, h = hv / a.group;
    const bool by_threads = rows_by_threads(rows);
    if (by_threads) {
      const Op* q0 = static_cast<const Op*>(a.q) + b * a.sq[0] + t * a.sq[1] + h * a.sq[2];
      const Op* k0 = static_cast<const Op*>(a.k) + b * a.sk[0] + t * a.sk[1] + h * a.sk[2];
      const Op* x0 = static_cast<const Op*>(a.v) + b * a.sv[0] + t * a.sv[1] + hv * a.sv[2];  // raw_v: VT = 128
      if (ca.tma_rows) {
        if (rq) copy_packed_async<NT>(buf + QOFF, q0, a.sq[1], rows);
        if (ca.raw_kw) copy_packed_async<NT>(buf + KWOFF, k0, a.sk[1], rows);
      } else {
        if (rq) copy_blocked_async<KP, NT>(buf + QOFF, q0, a.sq[1], rows);
        if (ca.raw_kw) copy_blocked_async<KP, NT>(buf + KWOFF, k0, a.sk[1], rows);
      }
      // W's and U's places hold packed tiles only (a padded one would overrun them).
      if (rk) copy_packed_async<NT>(buf, k0, a.sk[1], rows);
      if (rvc) copy_packed_async<NT>(buf + UOFF, x0, a.sv[1], rows);
    }
    cp_commit();
    if (threadIdx.x == 0) {
      const uint32_t bar = bar0 + 8 * bi, dst = smem_addr(buf);
      const int ti = static_cast<int>(t), hi = static_cast<int>(h), bn = static_cast<int>(b);  // tensor coordinates
      if (kwf) {  // (the norms of k (with q's) are the write keys' inputs: copied here, not below)
        const uint32_t bw = barw0 + 8 * bi;
        wg::bar_expect(bw, kw_bytes + (by_threads ? 0 : kWgPacked));
        if (!by_threads) wg::tensor_copy5(dst, &tk, ti, hi, bn, bw);
        wg::bulk_copy(dst + GOFF + 4 * C, ca.rn + 2 * tile, 8 * C, bw);
        wg::bulk_copy(dst + GOFF + kWgAinOff, ca.Ain + ((first + ci) * a.H + h) * KP, 4 * KP, bw);
        wg::bulk_copy(dst + GOFF + kWgPgOff, ca.pg + hc * 2 * C, 8 * C, bw);
      }
      if ((raw || rv) && !by_threads) {  // the raw rows' tiles by tensor copies
        wg::bar_expect(bar, bulk_bytes + (rq + ca.raw_kw + (rk && !kwf) + rvc) * kWgPacked);
        if (rq) wg::tensor_copy5(dst + QOFF, &tq, ti, hi, bn, bar);
        if (ca.raw_kw) wg::tensor_copy5(dst + KWOFF, &tk, ti, hi, bn, bar);
        if (rk && !kwf) wg::tensor_copy5(dst, &tk, ti, hi, bn, bar);
        if (rvc) wg::tensor_copy5(dst + UOFF, &tv, ti, hv, bn, bar);
      } else {
        wg::bar_expect(bar, bulk_bytes);
      }
      if (a.online && (!rv || kg)) wg::bulk_copy(dst, static_cast<const Op*>(ca.W) + tile * KP, kWgPacked, bar);
      if (rv)
        wg::bulk_copy(dst + TMOFF, static_cast<const Op*>(ca.Tm) + tile * C, 2 * C * C, bar);
      else
        wg::bulk_copy(dst + UOFF, static_cast<const Op*>(ca.U) + tile * ca.Vpad + blockIdx.x * VT * C, 2 * C * VT, bar);
      if (!TR) wg::bulk_copy(dst + POFF, static_cast<const Op*>(ca.P) + tile * C, 2 * C * C, bar);
      if (diag) {
        wg::bulk_copy(dst + GOFF, ca.egC + hc * KP, 4 * KP, bar);
      } else {
        wg::bulk_copy(dst + GOFF, ca.gam + tile, 4 * C, bar);
        if (ca.rn && !kwf) wg::bulk_copy(dst + GOFF + 4 * C, ca.rn + 2 * tile, 8 * C, bar);
      }
      if (!ca.raw_q && !TR) wg::bulk_copy(dst + QOFF, static_cast<const Op*>(ca.Qn) + tile * KP, kWgPacked, bar);
      if (!kwf && !ca.raw_kw) {
        wg::bulk_copy(dst + KWOFF, static_cast<const Op*>(ca.KWn) + tile * KP, kWgPacked, bar);
      }
    }
  };
  // kw_state: warpgroup WGS (the block's last 128 threads, their registers mostly handed to the compute
  // warpgroups) forms each chunk's write keys into KW's place (padded) while the compute warpgroups run
  // the chain: from the chunk's raw k rows in W's place (rk) and its statistics' factors, by the
  // operations of the intra-chunk kernel (stat_step, squash_fast) on the same values; thread wt takes
  // channel wt. It waits for its inputs' copies (the buffer's write-key mbarrier: they are issued before
  // the chunk's other tiles; waiting for all of them put the compute warpgroups' wait for KW at 18% of
  // their time) and, where the compute threads copy the rows (cp.async), for their named barrier
  // kRowsBar + buffer; it then arrives at kKwBar + buffer, where the compute warpgroups wait before the
  // update's products. (One chunk ahead at most: a buffer's next copies start only after the compute
  // warpgroups passed its KW barrier.)
  constexpr int kKwBar = 4, kRowsBar = 6, KWT = NT + 128;
  // setmaxnreg moves registers within the block's allocation (384 threads: 168 each at launch), so the
  // three warpgroups' shares must fit it, or the compute warpgroups' increase waits forever.
  constexpr int kKwRegs = 40, kComputeRegs = 232;
  static_assert(kKwRegs + 2 * kComputeRegs <= 3 * (65536 / 384 / 8 * 8), "registers of the block");
  if constexpr (kwf) {
    if (g == WGS) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kKwRegs) : "memory");
      const float center = load_gate(a.center, hv / a.group, a.gate_dtype), log2_x = a.log_x * 1.44269504089f;
      const int at = (wt / 8) * C * 8 + wt % 8;  // element (row t, channel wt) of a packed tile: at + 8 t
      // KW padded (column groups kWgColGroup bytes apart), so that a warp's stores of one row fall in
      // four different 16-byte bank groups: element (t, wt) at atw + (t / 8) RGK / 2 + 8 (t % 8).
      const int atw = (wt / 8) * (CGP / 2) + wt % 8;
      for (int64_t ci = c0; ci < cend; ++ci) {
        const int bk = static_cast<int>((ci - c0) & 1);
        if (rows_by_threads(static_cast<int>(imin64(C, len - ci * C))))
          asm volatile("bar.sync %0, %1;\n" ::"r"(kRowsBar + bk), "n"(KWT) : "memory");
        wg::bar_wait(barw0 + 8 * bk, static_cast<uint32_t>((ci - c0) >> 1) & 1);
        const unsigned char* buf = smem + bk * BUF;
        const Op* kr = reinterpret_cast<const Op*>(buf);
        Op* kw = reinterpret_cast<Op*>(smem + bk * BUF + KWOFF);
        const float* f = reinterpret_cast<const float*>(buf + GOFF);
        const float *rnk = f + 2 * C, *egp = f + kWgPgOff / 4, *bp = egp + C;
        float A = f[kWgAinOff / 4 + wt];
        // The 8 rows' factors are read 16 bytes at a time (Float8: one broadcast load per four rows).
#pragma unroll 1
        for (int t0 = 0; t0 < C; t0 += 8) {
          float kn[8], Ar[8];
          {
            const Float8 r8(rnk + t0);
#pragma unroll
            for (int u = 0; u < 8; ++u) kn[u] = to_float(kr[at + 8 * (t0 + u)]) * r8[u];
#pragma unroll
            for (int u = 0; u < 8; u += 2) round_pair<Op>(kn[u], kn[u + 1]);  // the intra kernel's 16-bit kn
          }
          {
            const Float8 e8(egp + t0), b8(bp + t0);
#pragma unroll
            for (int u = 0; u < 8; ++u) Ar[u] = A = stat_step(A, e8[u], b8[u], kn[u]);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u)
            kw[atw + (t0 / 8) * (RGK / 2) + 8 * u] = from_float<Op>(kn[u] * squash_fast(Ar[u], center, log2_x, a.eps));
        }
        wg::proxy_fence();  // the update's products read KW through the async proxy
        asm volatile("bar.arrive %0, %1;\n" ::"r"(kKwBar + bk), "n"(KWT) : "memory");
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kComputeRegs) : "memory");
  }
  if (cend > c0) issue(c0, 0);
  // The B operands' descriptors: Q and KW packed, or raw rows copied by the threads into padded column groups.
  const bool q_pad = ca.raw_q && !ca.tma_rows, kw_pad = (ca.raw_kw && !ca.tma_rows) || kwf;  // kwf: padded KW
  const uint32_t q_cg = q_pad ? CGP : CGB, q_rg = q_pad ? RGK : 128;
  const uint32_t kw_cg = kw_pad ? CGP : CGB, kw_rg = kw_pad ? RGK : 128;
  // raw_v: the rows of k in Z (KW's tile, or packed in W's place); v's tile is packed.
  const uint32_t k_cg = ca.raw_kw ? kw_cg : CGB, k_rg = ca.raw_kw ? kw_rg : 128;

  // S^T: value column acc_row(m0, e) of the warpgroup (row) and key acc_col(8 i, e) (column) in ST[4 i + e].
  // (Split: from I or 0 in pass 1, from the segment's start state in pass 2; S^T's columns past K stay zero.)
  float ST[64];
  const float* s0 = split ? ca.Sseg + ((int64_t(n) * a.HV + hv) * segs + seg) * KP * KP : nullptr;
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    const int c = v0 + acc_row(m0, j % 4), k = acc_col(8 * (j / 4), j % 4);
    if (TR)
      ST[j] = part == 0 && c == k && k < a.K ? 1.f : 0.f;
    else if (split)
      ST[j] = s0[c * KP + k];
    else
      ST[j] = (a.h0 && k < a.K && c < a.V) ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + k * a.sh0[2] + c] : 0.f;
  }
  Tin* o = static_cast<Tin*>(a.o);
  int bi = 0;
  for (int64_t ci = c0; ci < cend; ++ci) {
    const int L = static_cast<int>(imin64(C, len - ci * C));
    if (ci + 1 < cend) {
      sync_compute<NT>();  // every warp is done with chunk ci - 1's buffer
      issue(ci + 1, bi ^ 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    // Chunk ci's raw rows have landed: visible to the products of every warpgroup. (Also on the last
    // chunk, where no copy was issued above: every warp is done with the previous chunk's s_eo, s_es.)
    const bool by_threads = rows_by_threads(L);
    if (by_threads) wg::proxy_fence();
    if (by_threads || ci + 1 == cend) sync_compute<NT>();
    if (kwf && by_threads) asm volatile("bar.arrive %0, %1;\n" ::"r"(kRowsBar + bi), "n"(KWT) : "memory");
    const uint32_t phase = static_cast<uint32_t>((ci - c0) >> 1) & 1;  // buffer bi's round
    wg::bar_wait(bar0 + 8 * bi, phase);  // and its bulk copies
    if (kwf) wg::bar_wait(barw0 + 8 * bi, phase);
    unsigned char* buf = smem + bi * BUF;
    const uint32_t W_a = smem_addr(buf), Q_a = W_a + QOFF, KW_a = W_a + KWOFF, P_a = W_a + POFF;
    const uint32_t K_a = ca.raw_kw ? KW_a : W_a, TM_a = W_a + TMOFF;  // raw_v: Z's k rows, Tm
    const Op* sU = reinterpret_cast<const Op*>(buf + UOFF);
    const float* sG = reinterpret_cast<const float*>(buf + GOFF);  // gamma (Diagonal decay: e^gamma_C)
    const float* sRn = sG + C;                                     // raw rows: inverse norms of q, then of k
    // R^T and O^T from S^T (16-bit A fragments).
    float rt[32], ot[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) rt[j] = ot[j] = 0.f;
    {
      uint32_t sa[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x) sa[kk][x] = pack2<Op>(ST[8 * kk + 2 * x], ST[8 * kk + 2 * x + 1]);
      // rt = S^T W^T (raw_v: Z^T = S^T K^T), ot = S^T Q^T
      const uint32_t r_a = rv ? K_a : W_a, r_cg = rv ? k_cg : CGB, r_rg = rv ? k_rg : 128;
      // R's products first, in a group of their own: the chain S -> R -> S waits on them alone, and O's
      // (off the chain) run on the tensor cores while R's factors are formed.
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) wg::mma<Op, 64, 0>(rt, sa[kk], wg::desc(r_a + kk * 2 * r_cg, r_cg, r_rg), true);
      wg::commit();
      if constexpr (!TR) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) wg::mma<Op, 64, 0>(ot, sa[kk], wg::desc(Q_a + kk * 2 * q_cg, q_cg, q_rg), true);
        wg::commit();
      }
      // Meanwhile the chunk's row factors (scalar or no decay; with Diagonal decay the intra-chunk kernel
      // applied the decays to the tiles): O's rows get e^gamma_t (and raw q's norm and scale), R's copy
      // for the update e^(gamma_C - gamma_t) (and raw k's norm), zero past L; raw_v: Z's columns
      // e^gamma_t and raw k's norm.
      if constexpr (!diag) {
        const float gl = sG[L - 1];
        if (wt < C) {
          s_eo[wt] = __expf(sG[wt]) * (ca.raw_q ? sRn[wt] * a.scale : 1.f);
          if (rv) s_ez[wt] = kg ? 1.f : __expf(sG[wt]) * sRn[C + wt];
        } else {
          s_es[wt - C] = wt - C < L ? __expf(gl - sG[wt - C]) * (ca.raw_kw ? sRn[wt] : 1.f) : 0.f;
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + g) : "memory");
      }
      wg::wait<TR ? 0 : 1>();  // R's group (O's may still run)
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(rt[j]);
      if constexpr (rv) {
        // R^T = (V^T - Z^T Diag(e^gamma rn_k)) Tm^T (Diagonal decay: no raw k rows, Y^T = V^T - Z^T). V^T's
        // A fragments by ldmatrix.trans from v's packed tile: matrix q of each four holds value rows
        // 8 (q & 1) .. and tokens 8 (2 kk + q / 2) .., lane l addresses row l % 8 of matrix l / 8.
        const int l = threadIdx.x & 31;
        const unsigned char* vrow =
            buf + UOFF + ((64 * g + m0) / 8 + ((l >> 3) & 1)) * CGB + (8 * (l >> 4) + (l & 7)) * 16;
        uint32_t ya[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t vf[4] = {0u, 0u, 0u, 0u};
          if (need_v) ldsm_x4_t(vf, vrow + kk * 16 * 16);
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
            const float2 v = unpack2<Op>(vf[x]);
            ya[kk][x] = diag ? pack2<Op>(v.x - rt[j], v.y - rt[j + 1])
                             : pack2<Op>(v.x - rt[j] * s_ez[t], v.y - rt[j + 1] * s_ez[t + 1]);
          }
        }
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 64, 0>(rt, ya[kk], wg::desc(TM_a + kk * 2 * CGB, CGB, 128), kk > 0);
        wg::commit();
      }
      wg::wait<0>();
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(rt[j]), wg::pin(ot[j]);
    }
    // R^T = U^T - S^T W^T (raw_v: formed above); its 16-bit fragments as is (for O) and scaled (for the
    // update; Diagonal decay: zero past L only); O^T's columns scaled; the state decayed.
    uint32_t rb[4][4], ra[4][4];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = acc_row(m0, j % 4), t = acc_col(8 * (j / 4), j % 4);
      if constexpr (!rv) rt[j] = to_float(sU[blocked_at(t, 64 * g + (c & ~7)) + (c & 7)]) - rt[j];
      if constexpr (!diag) ot[j] *= s_eo[t];
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
        rb[kk][x] = pack2<Op>(rt[j], rt[j + 1]);
        if constexpr (!diag) ra[kk][x] = pack2<Op>(rt[j] * s_es[t], rt[j + 1] * s_es[t + 1]);
      }
    if constexpr (diag) {
      if (L == C) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int x = 0; x < 4; ++x) ra[kk][x] = rb[kk][x];
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int j = 8 * kk + 2 * x, t = acc_col(8 * (j / 4), j % 4);
            ra[kk][x] = pack2<Op>(t < L ? rt[j] : 0.f, t + 1 < L ? rt[j + 1] : 0.f);
          }
      }
      // S^T's column k decays by e^gamma_C[k] (sG): a thread's columns come in adjacent pairs.
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float2 e = *reinterpret_cast<const float2*>(sG + acc_col(8 * i, 0));
        ST[4 * i] *= e.x, ST[4 * i + 1] *= e.y, ST[4 * i + 2] *= e.x, ST[4 * i + 3] *= e.y;
      }
    } else {
      const float gC = __expf(sG[L - 1]);
#pragma unroll
      for (int j = 0; j < 64; ++j) ST[j] *= gC;
    }
    if constexpr (kwf) asm volatile("bar.sync %0, %1;\n" ::"r"(kKwBar + bi), "n"(KWT) : "memory");  // KW written
    wg::fence();
    if constexpr (!TR)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 64, 0>(ot, rb[kk], wg::desc(P_a + kk * 2 * CGB, CGB, 128), true);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg::mma<Op, 128, 1>(ST, ra[kk], wg::desc(KW_a + kk * 2 * kw_rg, kw_rg, kw_cg), true);
    wg::commit();
    wg::wait<0>();
#pragma unroll
    for (int j = 0; j < 64; ++j) wg::pin(ST[j]);
    if constexpr (!TR) {
#pragma unroll
      for (int j = 0; j < 32; ++j) wg::pin(ot[j]);
      const int64_t orow0 = b * a.so[0] + (bos + ci * C) * a.so[1] + hv * a.so[2];
      bool staged = false;
      if constexpr (sizeof(Tin) == 2) staged = ca.vec_o;
      if (staged) {
        // O^T's 16-bit fragments transposed by stmatrix into the token rows of the block's stage (row
        // stride OLD: 16 bytes of padding put a matrix's eight rows in different banks), then each
        // token row's 128 bytes of this warpgroup to o, 16 bytes per thread. Matrix q of each four:
        // value rows 8 (q & 1) .., tokens 8 (2 i + q / 2) ..; lane l addresses token row l % 8 of matrix l / 8.
        constexpr int OLD = 2 * VT + 16;
        unsigned char* stage = smem + OOFF;
        const int l = threadIdx.x & 31;
        const uint32_t st0 = smem_addr(stage + (8 * (l >> 4) + (l & 7)) * OLD + (64 * g + m0 + 8 * ((l >> 3) & 1)) * 2);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          wg::stsm_x4_t(st0 + 16 * i * OLD, pack2<Op>(ot[8 * i], ot[8 * i + 1]),
                        pack2<Op>(ot[8 * i + 2], ot[8 * i + 3]), pack2<Op>(ot[8 * i + 4], ot[8 * i + 5]),
                        pack2<Op>(ot[8 * i + 6], ot[8 * i + 7]));
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + g) : "memory");
        const int r0 = wt / 8, col = v0 + 8 * (wt % 8);  // col: o's column (the stage's: col - v0 + 64 g)
        if (col < a.V)
#pragma unroll
          for (int p = 0; p < C / 16; ++p) {
            const int r = r0 + 16 * p;
            if (r < L)
              *reinterpret_cast<uint4*>(o + orow0 + r * a.so[1] + col) =
                  *reinterpret_cast<const uint4*>(stage + r * OLD + (col - v0 + 64 * g) * 2);
          }
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int c = v0 + acc_row(m0, j % 4), t = acc_col(8 * (j / 4), j % 4);
          if (t < L && c < a.V) o[orow0 + t * a.so[1] + c] = from_float<Tin>(ot[j]);
        }
      }
    }
    bi ^= 1;
  }
  if (TR) {  // S^T at the segment's end: A^T (part 0) or B^T (part 1)
    float* d = ca.Tseg + (((int64_t(n) * a.HV + hv) * segs + seg) * 2 + part) * KP * KP;
#pragma unroll
    for (int j = 0; j < 64; ++j) d[(v0 + acc_row(m0, j % 4)) * KP + acc_col(8 * (j / 4), j % 4)] = ST[j];
  } else if (a.hT && (!split || seg == segs - 1))
#pragma unroll
    for (int j = 0; j < 64; ++j) {
      const int c = v0 + acc_row(m0, j % 4), k = acc_col(8 * (j / 4), j % 4);
      if (k < a.K && c < a.V) a.hT[int64_t(n) * a.shT[0] + hv * a.shT[1] + k * a.shT[2] + c] = ST[j];
    }
#else
  (void)ca;
#endif
}

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
/// (transposed, like the warpgroup pass's accumulators). Float32 on the CUDA cores; a block per (sequence,
/// value head) and kScanCols value columns, two threads per key (8 columns each). A_{j+1}^T is copied into
/// shared memory (cp.async, two buffers of 64 KB) while step j computes: one memory round trip per step.
constexpr int kScanCols = 16;
constexpr size_t kScanSmem = sizeof(float) * (2 * KP * KP + KP * kScanCols);
__global__ void __launch_bounds__(2 * KP) split_scan_kernel(const ChunkArgs ca) {
  constexpr int CW = kScanCols / 2;
  const RecArgs& a = ca.a;
  const int nh = blockIdx.x, n = nh / a.HV, hv = nh % a.HV, k = threadIdx.x % KP;
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
  load(0);  // (split > 1)
  float s[CW];
#pragma unroll
  for (int c = 0; c < CW; ++c)
    s[c] = a.h0 && k < a.K && c0 + c < a.V ? a.h0[int64_t(n) * a.sh0[0] + hv * a.sh0[1] + k * a.sh0[2] + c0 + c] : 0.f;
  for (int j = 0;; ++j) {
    float* d = ca.Sseg + (int64_t(nh) * ca.split + j) * KP * KP + int64_t(c0) * KP + k;
#pragma unroll
    for (int c = 0; c < CW; ++c) d[c * KP] = s[c];
    if (j + 1 == ca.split) break;
    __syncthreads();  // every thread is done with S_{j-1} and A_{j-1}'s buffer
#pragma unroll
    for (int c = 0; c < CW; ++c) sS[k * kScanCols + cl + c] = s[c];
    const float* Bt = T0 + (int64_t(j) * 2 + 1) * KP * KP + int64_t(c0) * KP + k;
#pragma unroll
    for (int c = 0; c < CW; ++c) s[c] = Bt[c * KP];
    if (j + 2 < ca.split) {
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
  int sms = 132, dev = 0, per = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
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

/// The backward's entry (chunk_backward_impl.cuh): the intra-chunk kernel and the state pass of a
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
