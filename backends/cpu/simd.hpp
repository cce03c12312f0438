/// @brief The SIMD layer of the CPU leaf kernels: the ISA's vector of T (an xsimd batch, or plain loops without
/// xsimd), loads, stores, masks, lane sums, and the operations xsimd lacks, each one small helper per ISA.
///
/// Every kernel_<isa>.cpp unit picks its xsimd architecture here at compile time from its flags (AVX-512BW,
/// AVX2 + FMA3, SSE2 for the generic unit on x86, NEON64 for the
/// neon64 unit on aarch64, whose generic unit takes the plain loops); the run-time choice among the units stays in dispatch.cpp
/// (xsimd's own dispatch is not used). Each unit names a different architecture, so no xsimd instantiation is
/// shared between units compiled with different flags.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "isa.hpp"

// The per-ISA units (kernel_<isa>.cpp) name the namespace; a header compiled alone gets the generic one.
#ifndef DGPS_ISA_NS
#define DGPS_ISA_NS generic
#endif

// DGPS_CPU_PLAIN_LOOPS: a unit that uses the plain loops even with xsimd (the generic unit on aarch64).
#if defined(DGPS_CPU_XSIMD) && !defined(DGPS_CPU_PLAIN_LOOPS) && (defined(__SSE2__) || defined(__aarch64__))
#define DGPS_CPU_SIMD_XSIMD 1
#include <xsimd/xsimd.hpp>
// The per-ISA helpers on x86 registers (an xsimd batch converts to and from its register).
#if defined(__AVX512F__)
#define DGPS_CPU_REG_AVX512 1
#elif defined(__AVX2__)
#define DGPS_CPU_REG_AVX2 1
#endif
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

#if defined(DGPS_CPU_SIMD_XSIMD)
#if defined(__AVX512BW__)
using Arch = xsimd::avx512bw;
#elif defined(__AVX512F__)
using Arch = xsimd::avx512f;
#elif defined(__AVX2__) && defined(__FMA__)
using Arch = xsimd::fma3<xsimd::avx2>;
#elif defined(__AVX2__)
using Arch = xsimd::avx2;
#elif defined(__SSE2__)
using Arch = xsimd::sse2;
#else
using Arch = xsimd::neon64;
#endif
template <class T>
using Batch = xsimd::batch<T, Arch>;
static_assert(sizeof(Batch<float>) == kVecBytes, "the xsimd architecture matches the unit's vector width");
#else
/// Without xsimd: kVecBytes of T as an array, every operation a plain loop over the lanes (the same interface as
/// the subset of xsimd::batch the kernels use).
template <class T>
struct Batch {
  using value_type = T;
  static constexpr int size = kVecBytes / int(sizeof(T));
  /// Lanes of a comparison.
  struct Mask {
    bool m[size];
    friend Mask operator&(const Mask& a, const Mask& b) {
      Mask r;
      for (int l = 0; l < size; ++l) r.m[l] = a.m[l] && b.m[l];
      return r;
    }
  };
  T v[size];
  Batch() = default;
  Batch(T x) {  // NOLINT: implicit, as xsimd's broadcast
    for (int l = 0; l < size; ++l) v[l] = x;
  }
  static Batch load_unaligned(const T* p) {
    Batch r;
    for (int l = 0; l < size; ++l) r.v[l] = p[l];
    return r;
  }
  void store_unaligned(T* p) const {
    for (int l = 0; l < size; ++l) p[l] = v[l];
  }
  template <class F>
  friend Batch lanewise(const Batch& a, const Batch& b, F f) {
    Batch r;
    for (int l = 0; l < size; ++l) r.v[l] = f(a.v[l], b.v[l]);
    return r;
  }
  template <class F>
  friend Mask compare(const Batch& a, const Batch& b, F f) {
    Mask r;
    for (int l = 0; l < size; ++l) r.m[l] = f(a.v[l], b.v[l]);
    return r;
  }
  friend Batch operator+(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x + y); });
  }
  friend Batch operator-(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x - y); });
  }
  friend Batch operator*(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x * y); });
  }
  friend Batch operator/(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x / y); });
  }
  friend Batch operator&(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x & y); });
  }
  friend Batch operator|(const Batch& a, const Batch& b) {
    return lanewise(a, b, [](T x, T y) { return T(x | y); });
  }
  friend Batch operator<<(const Batch& a, int s) {
    return lanewise(a, a, [s](T x, T) { return T(x << s); });
  }
  friend Batch operator>>(const Batch& a, int s) {
    return lanewise(a, a, [s](T x, T) { return T(x >> s); });
  }
  Batch operator-() const {
    return lanewise(*this, *this, [](T x, T) { return T(-x); });
  }
  Batch& operator+=(const Batch& b) { return *this = *this + b; }
  Batch& operator-=(const Batch& b) { return *this = *this - b; }
  friend Mask operator<(const Batch& a, const Batch& b) {
    return compare(a, b, [](T x, T y) { return x < y; });
  }
  friend Mask operator<=(const Batch& a, const Batch& b) {
    return compare(a, b, [](T x, T y) { return x <= y; });
  }
  friend Mask operator>(const Batch& a, const Batch& b) {
    return compare(a, b, [](T x, T y) { return x > y; });
  }
  friend Mask operator>=(const Batch& a, const Batch& b) {
    return compare(a, b, [](T x, T y) { return x >= y; });
  }
  friend Mask operator==(const Batch& a, const Batch& b) {
    return compare(a, b, [](T x, T y) { return x == y; });
  }
};
#endif

/// The ISA's vector of T and its lane count.
template <class T>
struct Vec {
  using type = Batch<T>;
  static constexpr int L = kVecBytes / int(sizeof(T));
};
using VF = Vec<float>::type;
using VI = Vec<int32_t>::type;
using VU = Vec<uint32_t>::type;

template <class T>
inline typename Vec<T>::type vload(const T* p) {
  return Vec<T>::type::load_unaligned(p);
}
template <class T>
inline void vstore(T* p, const typename Vec<T>::type& x) {
  x.store_unaligned(p);
}
template <class T>
inline typename Vec<T>::type vsplat(T x) {
  return typename Vec<T>::type(x);
}

/// a * b + c as one explicit fused multiply-add where the ISA has one (else rounded twice). The kernels are
/// compiled with -ffp-contract=fast, which lets the compiler fuse a * b + c' either way round, differently in
/// different places (Clang does): an update whose rounding must be the same for every element (the exact
/// preconditioners' symmetric P) spells its fusion out with this.
template <class T>
inline typename Vec<T>::type vfma(const typename Vec<T>::type& a, const typename Vec<T>::type& b,
                                  const typename Vec<T>::type& c) {
#if defined(DGPS_CPU_REG_AVX512)  // xsimd 8.1's AVX-512 fma is a * b + c, which the compiler may fuse either way
  if constexpr (sizeof(T) == 8) return typename Vec<T>::type(_mm512_fmadd_pd(a, b, c));
  else return typename Vec<T>::type(_mm512_fmadd_ps(a, b, c));
#elif defined(DGPS_CPU_SIMD_XSIMD)
  return xsimd::fma(a, b, c);  // the FMA instruction on AVX2 + FMA3 and NEON; a * b + c without one
#else
  return a * b + c;
#endif
}

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t round_up(int64_t a, int64_t m) { return (a + m - 1) / m * m; }

#if defined(DGPS_CPU_SIMD_XSIMD)
/// Lane-wise m ? a : b.
template <class T, class A>
inline xsimd::batch<T, A> sel(const xsimd::batch_bool<T, A>& m, const xsimd::batch<T, A>& a,
                              const xsimd::batch<T, A>& b) {
  return xsimd::select(m, a, b);
}
/// The same on int32 lanes, through the float select (xsimd 8.1's integer select for AVX-512BW does not compile).
inline VI sel(const VI::batch_bool_type& m, const VI& a, const VI& b) {
  return xsimd::bitwise_cast<VI>(
      xsimd::select(xsimd::bool_cast(m), xsimd::bitwise_cast<VF>(a), xsimd::bitwise_cast<VF>(b)));
}
/// True when every lane of the comparison `m` is set.
template <class T, class A>
inline bool all_lanes(const xsimd::batch_bool<T, A>& m) {
  return xsimd::all(m);
}
/// The float comparison as a mask of the int32 lanes.
inline VI::batch_bool_type int_mask(const VF::batch_bool_type& m) { return xsimd::bool_cast(m); }
/// Bit casts between the float, int32 and uint32 vectors.
template <class To, class From>
inline To bitcast(const From& x) {
  return xsimd::bitwise_cast<To>(x);
}
/// int32 lanes converted to float.
inline VF to_float(const VI& x) {
#if defined(DGPS_CPU_REG_AVX512)
  return _mm512_maskz_cvtepi32_ps(__mmask16(0xffff), x);  // (as shl)
#else
  return xsimd::to_float(x);
#endif
}
#else
template <class T>
inline Batch<T> sel(const typename Batch<T>::Mask& m, const Batch<T>& a, const Batch<T>& b) {
  Batch<T> r;
  for (int l = 0; l < Batch<T>::size; ++l) r.v[l] = m.m[l] ? a.v[l] : b.v[l];
  return r;
}
template <class M>
inline bool all_lanes(const M& m) {
  bool all = true;
  for (bool b : m.m) all = all && b;
  return all;
}
inline VI::Mask int_mask(const VF::Mask& m) {
  VI::Mask r;
  for (int l = 0; l < VI::size; ++l) r.m[l] = m.m[l];
  return r;
}
template <class To, class From>
inline To bitcast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit casts keep the width");
  To r;
  __builtin_memcpy(&r, &x, sizeof(To));
  return r;
}
inline VF to_float(const VI& x) {
  VF r;
  for (int l = 0; l < VF::size; ++l) r.v[l] = float(x.v[l]);
  return r;
}
#endif

/// x << N and x >> N per lane (arithmetic for int32, logical for uint32 lanes). AVX-512: the maskz forms, as
/// xsimd's unmasked shifts trip GCC 12's -Wmaybe-uninitialized.
template <int N, class V>
inline V shl(const V& x) {
#if defined(DGPS_CPU_REG_AVX512)
  return V(_mm512_maskz_slli_epi32(__mmask16(0xffff), x, N));
#else
  return x << N;
#endif
}
template <int N, class V>
inline V shr(const V& x) {
#if defined(DGPS_CPU_REG_AVX512)
  if constexpr (std::is_signed_v<typename V::value_type>)
    return V(_mm512_maskz_srai_epi32(__mmask16(0xffff), x, N));
  else
    return V(_mm512_maskz_srli_epi32(__mmask16(0xffff), x, N));
#else
  return x >> N;
#endif
}

/// Sum of the lanes of x, in lane order (lane 0 first, as a scalar loop would add them).
template <class T>
inline T hsum(const typename Vec<T>::type& x) {
  alignas(64) T lanes[Vec<T>::L];
  x.store_unaligned(lanes);
  T s = 0;
  for (int l = 0; l < Vec<T>::L; ++l) s += lanes[l];
  return s;
}

/// Lane l of the result: the sum of the lanes of rows[l] (L vectors; a transposing reduction, about two
/// operations per vector where L hsum calls take L each). The lanes are added in another order than hsum's.
template <class T>
inline typename Vec<T>::type lane_sums(const typename Vec<T>::type* rows) {
#if defined(DGPS_CPU_SIMD_XSIMD) && defined(DGPS_CPU_REG_AVX512)
  // xsimd::haddp's AVX-512 forms (and the unmasked shuffles) trip GCC 12's -Wmaybe-uninitialized: rounds of
  // pairwise folds on the maskz shuffles instead, each halving the lanes per row and doubling the rows per vector,
  // the rows taken in the order (q, an involution) that leaves row l's sum in lane l.
  if constexpr (sizeof(T) == 4) {
    constexpr int q[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    constexpr __mmask16 m = 0xffff;
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) {
      const __m512 r0 = rows[q[i]], r1 = rows[q[i + 8]];
      a[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(m, r0, r1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_f32x4(m, r0, r1, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(m, a[i], a[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_maskz_shuffle_f32x4(m, a[i], a[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(m, b[i], b[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_ps(m, b[i], b[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_maskz_shuffle_ps(m, c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_maskz_shuffle_ps(m, c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  } else {
    constexpr int q[8] = {0, 1, 4, 5, 2, 3, 6, 7};
    constexpr __mmask8 m = 0xff;
    __m512d a[4], b[2];
    for (int i = 0; i < 4; ++i) {
      const __m512d r0 = rows[q[i]], r1 = rows[q[i + 4]];
      a[i] = _mm512_add_pd(_mm512_maskz_shuffle_f64x2(m, r0, r1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_f64x2(m, r0, r1, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 2; ++i)
      b[i] = _mm512_add_pd(_mm512_maskz_shuffle_f64x2(m, a[i], a[i + 2], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_maskz_shuffle_f64x2(m, a[i], a[i + 2], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_pd(_mm512_maskz_shuffle_pd(m, b[0], b[1], 0x00), _mm512_maskz_shuffle_pd(m, b[0], b[1], 0xff));
  }
#elif defined(DGPS_CPU_SIMD_XSIMD)
  return xsimd::haddp(rows);
#else
  typename Vec<T>::type r;
  for (int l = 0; l < Vec<T>::L; ++l) {
    T s = 0;
    for (int i = 0; i < Vec<T>::L; ++i) s += rows[l].v[i];
    r.v[l] = s;
  }
  return r;
#endif
}

/// Lanes 0, 1, ..., L - 1 (column offsets for the triangular masks of the intra-chunk matrices).
template <class T>
inline typename Vec<T>::type iota_v() {
  alignas(64) T lanes[Vec<T>::L];
  for (int l = 0; l < Vec<T>::L; ++l) lanes[l] = T(l);
  return vload(lanes);
}

/// 1 / d for normal d below 2^126: the hardware reciprocal estimate and one Newton step (about 1e-7
/// relative).
inline VF recip_v(const VF& d) {
#if defined(DGPS_CPU_REG_AVX512)
  const VF y = _mm512_maskz_rcp14_ps(__mmask16(0xffff), d);  // (rcp14_ps trips -Wmaybe-uninitialized)
  return y * (2.0f - d * y);
#elif defined(DGPS_CPU_REG_AVX2)
  const VF y = _mm256_rcp_ps(d);
  return y * (2.0f - d * y);
#else
  return 1.0f / d;
#endif
}

/// *p = x, non-temporal where the ISA has it; p aligned to the vector.
template <class T>
inline void stream_store(T* p, const typename Vec<T>::type& x) {
#if defined(DGPS_CPU_REG_AVX512)
  if constexpr (sizeof(T) == 4)
    _mm512_stream_ps(reinterpret_cast<float*>(p), x);
  else
    _mm512_stream_pd(reinterpret_cast<double*>(p), x);
#elif defined(DGPS_CPU_REG_AVX2)
  if constexpr (sizeof(T) == 4)
    _mm256_stream_ps(reinterpret_cast<float*>(p), x);
  else
    _mm256_stream_pd(reinterpret_cast<double*>(p), x);
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

/// L 16-bit values from p, zero-extended to the 32-bit lanes.
inline VU load_u16(const uint16_t* p) {
#if defined(DGPS_CPU_REG_AVX512)
  return VU(_mm512_maskz_cvtepu16_epi32(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(DGPS_CPU_REG_AVX2)
  return VU(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  alignas(64) uint32_t lanes[Vec<uint32_t>::L];
  for (int l = 0; l < Vec<uint32_t>::L; ++l) lanes[l] = p[l];
  return vload(lanes);
#endif
}

/// The low 16 bits of the L 32-bit lanes of x (each below 2^16) to p.
inline void store_u16(uint16_t* p, const VU& x) {
#if defined(DGPS_CPU_REG_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(__mmask16(0xffff), x));
#elif defined(DGPS_CPU_REG_AVX2)
  const __m256i v = x;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#else
  alignas(64) uint32_t lanes[Vec<uint32_t>::L];
  vstore(lanes, x);
  for (int l = 0; l < Vec<uint32_t>::L; ++l) p[l] = uint16_t(lanes[l]);
#endif
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
