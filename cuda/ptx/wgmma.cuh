/// @brief Hopper warpgroup matrix multiplies (wgmma.mma_async, sm_90a only): shared-memory matrix
/// descriptors, the m64nNk16 products on 16-bit operands (A from registers, B from shared memory) with
/// float32 accumulators, and their fences; bulk copies into shared memory completing on mbarriers.
///
/// Tile layout ("blocked", no swizzle): a tile of R rows x COLS columns of 16-bit elements is stored
/// as 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16 bytes); element (r, c) lies at byte
/// (r / 8) * row_group + (c / 8) * col_group + (r % 8) * 16 + (c % 8) * 2. Two strides are used:
/// tiles the intra-chunk kernel writes to the workspace already blocked ("packed": column-major in
/// groups, col_group = R * 16 bytes, row_group = 128) arrive by one bulk copy each; tiles copied row by
/// row from the inputs (cp.async) use a column group of 144 bytes (16 of padding), so that eight
/// threads copying 16 consecutive bytes of one row each land in eight different bank groups. The
/// same tile is a K-major B operand when its columns run along the reduction (LBO = col_group, SBO =
/// row_group) and an N-major one when its rows do (LBO = row_group, SBO = col_group): PTX ISA, "Shared
/// Memory Matrix Layout", the no-swizzle canonical layouts ((8,m),(T,2k)) : ((1T,SBO),(1,LBO)) and
/// ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace dgps::cuda::kernels::wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DGPS_WGMMA 1
#else
#define DGPS_WGMMA 0
#endif

/// Shared-memory matrix descriptor (no swizzle) of the operand starting at shared address `addr`.
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32);
}

/// Orders this thread's register and shared-memory accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void fence() {
#if DGPS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if DGPS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
/// Waits until at most N of this warpgroup's committed groups are pending.
template <int N>
__device__ __forceinline__ void wait() {
#if DGPS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/// Makes this thread's generic-proxy shared-memory writes (stores, cp.async) visible to wgmma.
__device__ __forceinline__ void proxy_fence() {
#if DGPS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
/// Bulk copies (cp.async.bulk, the copy engine: one thread moves a whole contiguous tile) completing
/// on an mbarrier in shared memory. A barrier is initialised once with one arrival (`bar_init`, then a
/// barrier of the block); the thread that issues a round of copies first announces their total bytes
/// (`bar_expect`), and the round's phase completes when the last byte lands. Every thread that reads
/// the tiles waits for the phase (`bar_wait` with the parity of the round: 0, 1, 0, ...), which also
/// makes the copied bytes visible to it and to its warpgroup's products.
__device__ __forceinline__ void bar_init(uint32_t bar) {
#if DGPS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
               "fence.mbarrier_init.release.cluster;\n" ::"r"(bar)
               : "memory");
#else
  (void)bar;
#endif
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
#if DGPS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#else
  (void)bar, (void)bytes;
#endif
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
#if DGPS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
#endif
}
/// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory to shared
/// address `dst`, completing on barrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if DGPS_WGMMA
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#else
  (void)dst, (void)src, (void)bytes, (void)bar;
#endif
}

/// Copies the box at coordinates (0, x1, 0, x3, x4) of the five-dimensional tensor map `map` (a
/// __grid_constant__ kernel parameter) to shared address `dst` (the copy engine's tensor copy; bytes
/// out of the tensor's bounds are zeros), completing on barrier `bar`.
__device__ __forceinline__ void tensor_copy5(uint32_t dst, const void* map, int x1, int x3, int x4, uint32_t bar) {
#if DGPS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(x1), "r"(0), "r"(x3), "r"(x4), "r"(bar)
      : "memory");
#else
  (void)dst, (void)map, (void)x1, (void)x3, (void)x4, (void)bar;
#endif
}

/// Stores four 8 x 8 matrices of 16-bit elements transposed (stmatrix .trans): register i of each
/// thread holds two elements of matrix i in the mma fragment layout, and lane l gives the shared
/// address of row l % 8 of matrix l / 8 (16 bytes), which receives column l % 8 of that matrix.
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if DGPS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  (void)addr, (void)r0, (void)r1, (void)r2, (void)r3;
#endif
}

/// Keeps the compiler from moving accesses of accumulator x across the asynchronous products.
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }

template <class Op>
struct Name;
template <>
struct Name<__nv_bfloat16> {
  static constexpr bool bf16 = true;
};
template <>
struct Name<__half> {
  static constexpr bool bf16 = false;
};

#define DGPS_WG_R8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                      "+f"(d[i + 6]), "+f"(d[i + 7])
#define DGPS_WG_N64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
               "{%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n" \
               : DGPS_WG_R8(0), DGPS_WG_R8(8), DGPS_WG_R8(16), DGPS_WG_R8(24) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB))
#define DGPS_WG_N128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, " \
               "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n" \
               : DGPS_WG_R8(0), DGPS_WG_R8(8), DGPS_WG_R8(16), DGPS_WG_R8(24), DGPS_WG_R8(32), DGPS_WG_R8(40), \
                 DGPS_WG_R8(48), DGPS_WG_R8(56) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB))

/// d (64 x N, float32: the warpgroup's accumulator fragment, N / 2 per thread) += A (64 x 16) B (16 x N):
/// A from registers (a: the thread's four 16-bit pairs, the mma.m16n8k16 A fragment of its warp's 16
/// rows; an accumulator fragment's n-tiles 2 kk and 2 kk + 1 packed in order are the A fragment of
/// columns 16 kk .. 16 kk + 15), B from shared memory (descriptor db); TB: B is N-major.
/// `accumulate` false: d = A B.
template <class Op, int N, int TB>
__device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, bool accumulate) {
#if DGPS_WGMMA
  const int acc = accumulate ? 1 : 0;
  static_assert(N == 64 || N == 128, "n of 64 or 128");
  if constexpr (N == 64) {
    if constexpr (Name<Op>::bf16)
      DGPS_WG_N64("bf16");
    else
      DGPS_WG_N64("f16");
  } else {
    if constexpr (Name<Op>::bf16)
      DGPS_WG_N128("bf16");
    else
      DGPS_WG_N128("f16");
  }
#else
  (void)d, (void)a, (void)db, (void)accumulate;
#endif
}
#undef DGPS_WG_N64
#undef DGPS_WG_N128
#undef DGPS_WG_R8

}  // namespace dgps::cuda::kernels::wg
