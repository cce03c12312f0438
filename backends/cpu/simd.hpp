/// @brief The SIMD layer of the CPU leaf kernels: the ISA's vector of T, loads, stores, masks and the few operations
/// that need one helper per instruction set (reciprocal estimate, non-temporal stores, prefetch).
#pragma once

#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "isa.hpp"

// The per-ISA units (kernel_<isa>.cpp) name the namespace; a header compiled alone gets the generic one.
#ifndef DGPS_ISA_NS
#define DGPS_ISA_NS generic
#endif

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// The GEMM register block: kMR rows by kNV vectors of accumulators (AVX-512: 24 of 32 registers,
// AVX2: 12 of 16).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kMR = 6, kNV = 4;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
constexpr int kMR = 6, kNV = 2;
#else
constexpr int kVecBytes = 16;
constexpr int kMR = 6, kNV = 2;
#endif

/// The ISA's vector of T, aligned and unaligned (may_alias) flavours.
template <class T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
  typedef T utype __attribute__((vector_size(kVecBytes), aligned(sizeof(T)), may_alias));
  static constexpr int L = kVecBytes / int(sizeof(T));
};
typedef int32_t VI __attribute__((vector_size(kVecBytes)));
using VF = Vec<float>::type;

template <class T>
inline typename Vec<T>::type vload(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::utype*>(p);
}
template <class T>
inline void vstore(T* p, typename Vec<T>::type x) {
  *reinterpret_cast<typename Vec<T>::utype*>(p) = x;
}
template <class T>
inline typename Vec<T>::type vsplat(T x) {
  return typename Vec<T>::type{} + x;
}

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t round_up(int64_t a, int64_t m) { return (a + m - 1) / m * m; }

/// True when every lane of the comparison mask `m` is set.
inline bool all_lanes(VI m) {
#if defined(__AVX512DQ__)
  return _mm512_movepi32_mask((__m512i)m) == 0xffff;
#elif defined(__AVX__)
  return _mm256_movemask_ps((__m256)m) == 0xff;
#else
  bool all = true;
  for (int l = 0; l < Vec<float>::L; ++l) all = all && m[l] != 0;
  return all;
#endif
}

/// 1 / d for normal d below 2^126: the hardware reciprocal estimate and one Newton step (about 1e-7
/// relative).
inline VF recip_v(VF d) {
#if defined(__AVX512F__)
  const VF y = (VF)_mm512_maskz_rcp14_ps(__mmask16(0xffff), (__m512)d);  // (rcp14_ps trips -Wmaybe-uninitialized)
#elif defined(__AVX__)
  const VF y = (VF)_mm256_rcp_ps((__m256)d);
#else
  return 1.0f / d;
#endif
#if defined(__AVX__)
  return y * (2.0f - d * y);
#endif
}

/// *p = x, non-temporal where the ISA has it; p aligned to the vector.
template <class T>
inline void stream_store(T* p, typename Vec<T>::type x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4)
    _mm512_stream_ps(reinterpret_cast<float*>(p), (__m512)x);
  else
    _mm512_stream_pd(reinterpret_cast<double*>(p), (__m512d)x);
#elif defined(__AVX__)
  if constexpr (sizeof(T) == 4)
    _mm256_stream_ps(reinterpret_cast<float*>(p), (__m256)x);
  else
    _mm256_stream_pd(reinterpret_cast<double*>(p), (__m256d)x);
#else
  vstore(p, x);
#endif
}

/// Orders the non-temporal stores before the task ends (another thread reads them next).
inline void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

/// Prefetches `bytes` bytes starting at `p` into the cache hierarchy (a hint; never faults).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

/// Lanes 0, 1, ..., L - 1 (column offsets for the triangular masks of the intra-chunk matrices).
template <class T>
inline typename Vec<T>::type iota_v() {
  typename Vec<T>::type x{};
  for (int l = 0; l < Vec<T>::L; ++l) x[l] = T(l);
  return x;
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
