/// @brief Matrix transposes of the CPU leaf kernels (4 x 4 register blocks; 16 x 16 float tiles on AVX-512).
#pragma once

#include <cstdint>
#include <type_traits>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Four-element vectors of T (and the matching integer shuffle masks) for the 4 x 4 transpose.
template <class T>
struct Quad {
  typedef T type __attribute__((vector_size(4 * sizeof(T)), aligned(sizeof(T)), may_alias));
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> I;
  typedef I mask __attribute__((vector_size(4 * sizeof(T))));
};

/// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: 4 x 4 register blocks (eight shuffles
/// each) inside 16 x 16 tiles, scalar edges.
template <class T>
void transpose_quads(int64_t rows, int64_t cols, const T* src, int64_t lds, T* dst, int64_t ldd) {
  using Q = typename Quad<T>::type;
  using M = typename Quad<T>::mask;
  constexpr int64_t B = 16;
  const int64_t r4 = rows / 4 * 4, c4 = cols / 4 * 4;
  for (int64_t i0 = 0; i0 < r4; i0 += B) {
    const int64_t i1 = imin(r4, i0 + B);
    for (int64_t j0 = 0; j0 < c4; j0 += B) {
      const int64_t j1 = imin(c4, j0 + B);
      for (int64_t i = i0; i < i1; i += 4)
        for (int64_t j = j0; j < j1; j += 4) {
          const Q a = *reinterpret_cast<const Q*>(src + i * lds + j);
          const Q b = *reinterpret_cast<const Q*>(src + (i + 1) * lds + j);
          const Q c = *reinterpret_cast<const Q*>(src + (i + 2) * lds + j);
          const Q d = *reinterpret_cast<const Q*>(src + (i + 3) * lds + j);
          const Q t0 = __builtin_shuffle(a, b, M{0, 4, 1, 5}), t1 = __builtin_shuffle(a, b, M{2, 6, 3, 7});
          const Q t2 = __builtin_shuffle(c, d, M{0, 4, 1, 5}), t3 = __builtin_shuffle(c, d, M{2, 6, 3, 7});
          *reinterpret_cast<Q*>(dst + j * ldd + i) = __builtin_shuffle(t0, t2, M{0, 1, 4, 5});
          *reinterpret_cast<Q*>(dst + (j + 1) * ldd + i) = __builtin_shuffle(t0, t2, M{2, 3, 6, 7});
          *reinterpret_cast<Q*>(dst + (j + 2) * ldd + i) = __builtin_shuffle(t1, t3, M{0, 1, 4, 5});
          *reinterpret_cast<Q*>(dst + (j + 3) * ldd + i) = __builtin_shuffle(t1, t3, M{2, 3, 6, 7});
        }
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < r4 ? c4 : 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

#if defined(__AVX512F__)
/// One 16 x 16 float tile, dst[j * ldd + i] = src[i * lds + j]: sixteen rows in registers, four
/// shuffle stages (64 shuffles per 256 elements, where the 4 x 4 blocks take 128 and four times the
/// loads and stores).
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  typedef float VFu __attribute__((vector_size(64), aligned(4), may_alias));
  VF r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = *reinterpret_cast<const VFu*>(src + i * lds);
  const VI lo{0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29}, hi = lo + 2;
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved (unpcklps, unpckhps)
    t[i] = __builtin_shuffle(r[i], r[i + 1], lo);
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi);
  }
  const VI s0{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, s1 = s0 + 2;
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks transposed inside each 128-bit lane (shufps)
    r[i] = __builtin_shuffle(t[i], t[i + 2], s0);
    r[i + 1] = __builtin_shuffle(t[i], t[i + 2], s1);
    r[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], s0);
    r[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], s1);
  }
  const VI q0{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, q1 = q0 + 4;
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, in two stages (shuff32x4)
    t[i] = __builtin_shuffle(r[i], r[i + 4], q0);
    t[i + 4] = __builtin_shuffle(r[i], r[i + 4], q1);
    t[i + 8] = __builtin_shuffle(r[i + 8], r[i + 12], q0);
    t[i + 12] = __builtin_shuffle(r[i + 8], r[i + 12], q1);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = __builtin_shuffle(t[i], t[i + 8], q0);
    r[i + 8] = __builtin_shuffle(t[i], t[i + 8], q1);
  }
  for (int i = 0; i < 16; ++i) *reinterpret_cast<VFu*>(dst + i * ldd) = r[i];
}
#endif

/// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols. AVX-512 float: whole 16 x 16 tiles in
/// registers (transpose16), the edges by transpose_quads.
template <class T>
void transpose(int64_t rows, int64_t cols, const T* src, int64_t lds, T* dst, int64_t ldd) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    for (int64_t i0 = 0; i0 < r16; i0 += 16)
      for (int64_t j0 = 0; j0 < c16; j0 += 16) transpose16(src + i0 * lds + j0, lds, dst + j0 * ldd + i0, ldd);
    if (c16 < cols) transpose_quads(r16, cols - c16, src + c16, lds, dst + c16 * ldd, ldd);
    if (r16 < rows) transpose_quads(rows - r16, cols, src + r16 * lds, lds, dst + r16, ldd);
    return;
  }
#endif
  transpose_quads(rows, cols, src, lds, dst, ldd);
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
