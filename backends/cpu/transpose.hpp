/// @brief Matrix transposes of the CPU leaf kernels (4 x 4 register blocks; 16 x 16 float tiles on AVX-512).
///
/// Two-source shuffles are among the operations xsimd 8.1 lacks: the register blocks are one small helper
/// per ISA (SSE / AVX / AVX-512 intrinsics, scalar elsewhere) behind transpose4 and transpose16.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// One 4 x 4 block, dst[j * ldd + i] = src[i * lds + j] for i, j < 4.
template <class T>
inline void transpose4(const T* src, int64_t lds, T* dst, int64_t ldd) {
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 4) {
    const float* s = reinterpret_cast<const float*>(src);
    float* d = reinterpret_cast<float*>(dst);
    const __m128 a = _mm_loadu_ps(s), b = _mm_loadu_ps(s + lds), c = _mm_loadu_ps(s + 2 * lds),
                 e = _mm_loadu_ps(s + 3 * lds);
    const __m128 t0 = _mm_unpacklo_ps(a, b), t1 = _mm_unpackhi_ps(a, b);
    const __m128 t2 = _mm_unpacklo_ps(c, e), t3 = _mm_unpackhi_ps(c, e);
    _mm_storeu_ps(d, _mm_movelh_ps(t0, t2));
    _mm_storeu_ps(d + ldd, _mm_movehl_ps(t2, t0));
    _mm_storeu_ps(d + 2 * ldd, _mm_movelh_ps(t1, t3));
    _mm_storeu_ps(d + 3 * ldd, _mm_movehl_ps(t3, t1));
    return;
  } else {
    const double* s = reinterpret_cast<const double*>(src);
    double* d = reinterpret_cast<double*>(dst);
#if defined(__AVX__)
    const __m256d a = _mm256_loadu_pd(s), b = _mm256_loadu_pd(s + lds), c = _mm256_loadu_pd(s + 2 * lds),
                  e = _mm256_loadu_pd(s + 3 * lds);
    const __m256d t0 = _mm256_unpacklo_pd(a, b), t1 = _mm256_unpackhi_pd(a, b);  // a0 b0 a2 b2, a1 b1 a3 b3
    const __m256d t2 = _mm256_unpacklo_pd(c, e), t3 = _mm256_unpackhi_pd(c, e);
    _mm256_storeu_pd(d, _mm256_permute2f128_pd(t0, t2, 0x20));
    _mm256_storeu_pd(d + ldd, _mm256_permute2f128_pd(t1, t3, 0x20));
    _mm256_storeu_pd(d + 2 * ldd, _mm256_permute2f128_pd(t0, t2, 0x31));
    _mm256_storeu_pd(d + 3 * ldd, _mm256_permute2f128_pd(t1, t3, 0x31));
#else
    for (int bi = 0; bi < 4; bi += 2)  // 2 x 2 blocks
      for (int bj = 0; bj < 4; bj += 2) {
        const __m128d a = _mm_loadu_pd(s + bi * lds + bj), b = _mm_loadu_pd(s + (bi + 1) * lds + bj);
        _mm_storeu_pd(d + bj * ldd + bi, _mm_unpacklo_pd(a, b));
        _mm_storeu_pd(d + (bj + 1) * ldd + bi, _mm_unpackhi_pd(a, b));
      }
#endif
    return;
  }
#else
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}

/// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: 4 x 4 register blocks (eight shuffles
/// each) inside 16 x 16 tiles, scalar edges.
template <class T>
void transpose_quads(int64_t rows, int64_t cols, const T* src, int64_t lds, T* dst, int64_t ldd) {
  constexpr int64_t B = 16;
  const int64_t r4 = rows / 4 * 4, c4 = cols / 4 * 4;
  for (int64_t i0 = 0; i0 < r4; i0 += B) {
    const int64_t i1 = imin(r4, i0 + B);
    for (int64_t j0 = 0; j0 < c4; j0 += B) {
      const int64_t j1 = imin(c4, j0 + B);
      for (int64_t i = i0; i < i1; i += 4)
        for (int64_t j = j0; j < j1; j += 4) transpose4(src + i * lds + j, lds, dst + j * ldd + i, ldd);
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
  constexpr __mmask16 kAll = 0xffff;  // (the unmasked intrinsics of GCC 12 trip -Wuninitialized)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved
    t[i] = _mm512_maskz_unpacklo_ps(kAll, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_ps(kAll, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks transposed inside each 128-bit lane
    r[i] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, in two stages
    t[i] = _mm512_maskz_shuffle_f32x4(kAll, r[i], r[i + 4], _MM_SHUFFLE(2, 0, 2, 0));
    t[i + 4] = _mm512_maskz_shuffle_f32x4(kAll, r[i], r[i + 4], _MM_SHUFFLE(3, 1, 3, 1));
    t[i + 8] = _mm512_maskz_shuffle_f32x4(kAll, r[i + 8], r[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    t[i + 12] = _mm512_maskz_shuffle_f32x4(kAll, r[i + 8], r[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_maskz_shuffle_f32x4(kAll, t[i], t[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
    r[i + 8] = _mm512_maskz_shuffle_f32x4(kAll, t[i], t[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
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

/// A state block [K, n] of a pool view into K-major rows dst (row stride ld): the view's element (c, e) is at
/// src[c * rs + e * cs]. cs == 1 (K-major pool): rows copied; rs == 1 (K-last pool): transposed from its n
/// rows of K; otherwise (only a one-column view can have neither) element by element.
template <class T>
void state_in(const T* src, int64_t rs, int64_t cs, int64_t K, int64_t n, T* dst, int64_t ld) {
  if (cs == 1) {
    for (int64_t c = 0; c < K; ++c) std::memcpy(dst + c * ld, src + c * rs, size_t(n) * sizeof(T));
  } else if (rs == 1) {
    transpose(n, K, src, cs, dst, ld);
  } else {
    for (int64_t c = 0; c < K; ++c)
      for (int64_t e = 0; e < n; ++e) dst[c * ld + e] = src[c * rs + e * cs];
  }
}

/// The inverse of state_in: K-major rows src (row stride ld) [K, n] into the pool view at dst.
template <class T>
void state_out(const T* src, int64_t ld, int64_t K, int64_t n, T* dst, int64_t rs, int64_t cs) {
  if (cs == 1) {
    for (int64_t c = 0; c < K; ++c) std::memcpy(dst + c * rs, src + c * ld, size_t(n) * sizeof(T));
  } else if (rs == 1) {
    transpose(K, n, src, ld, dst, cs);
  } else {
    for (int64_t c = 0; c < K; ++c)
      for (int64_t e = 0; e < n; ++e) dst[c * rs + e * cs] = src[c * ld + e];
  }
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
