/// @brief Input and output element types of the CPU leaf kernels: bf16 / f16 conversions, typed views, row loads.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// ---------------------------------------------------------------------------------------------
// bf16 / f16 inputs and outputs (DType::bf16, DType::f16): converted to float at load and rounded
// (to nearest even) at store; states and computation stay float. Own copies of the conversions
// (not dgps/types.hpp's inline functions) so that no ISA's code is shared through the linker.

/// Bit patterns of a bfloat16 / IEEE half input (layout-compatible with dgps::bf16 / dgps::f16).
struct Bf16Bits {
  uint16_t bits;
};
struct F16Bits {
  uint16_t bits;
};
template <class In>
inline constexpr bool kHalf = std::is_same_v<In, Bf16Bits> || std::is_same_v<In, F16Bits>;

typedef uint32_t VU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VH __attribute__((vector_size(kVecBytes / 2)));
typedef uint16_t VHu __attribute__((vector_size(kVecBytes / 2), aligned(2), may_alias));

/// L halves (bit patterns widened to 32 bits) to L floats.
inline VF half_to_float_v(VU h, bool bf) {
  if (bf) return (VF)(h << 16);
  const VU sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const VU normal = ((e + 112u) << 23) | (m << 13);
  const VU infnan = 0x7f800000u | (m << 13);
  const VU sub = (VU)(__builtin_convertvector((VI)m, VF) * 0x1p-24f);
  const VU r = e == 0u ? sub : (e == 0x1fu ? infnan : normal);
  return (VF)(r | sign);
}

/// L floats to L halves (bit patterns in 32-bit lanes), round to nearest even.
inline VU float_to_half_v(VF x, bool bf) {
  const VU u = (VU)x;
  const VU a = u & 0x7fffffffu;
  if (bf) {
    const VU r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return a > 0x7f800000u ? ((u >> 16) | 0x40u) : r;
  }
  const VU sign = (u >> 16) & 0x8000u;
  const VU rn = a - 0x38000000u;
  const VU normal = (rn + 0xfffu + ((rn >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 leaves a float whose last mantissa bit is worth 2^-24 (a half's
  // subnormal step), so the FPU's round-to-nearest-even does the rounding.
  const VU sub = (VU)((VF)a + 0.5f) - 0x3f000000u;
  VU r = a < 0x38800000u ? sub : normal;
  r = a >= 0x477ff000u ? VU{} + 0x7c00u : r;
  r = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : r;
  return r | sign;
}

/// One input element as the compute type T.
template <class T, class In>
inline T to_c(In x) {
  if constexpr (std::is_same_v<In, Bf16Bits>) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else if constexpr (std::is_same_v<In, F16Bits>) {
    const uint32_t h = x.bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) {
      u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
      const float sub = float(m) * 0x1p-24f;
      std::memcpy(&u, &sub, 4);
      u |= sign;
    } else {
      u = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return T(x);
  }
}

/// dst[i] = src[i] converted to T, i < n.
template <class T, class In>
inline void load_cvt(const In* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<In, T>) {
    std::memcpy(dst, src, size_t(n) * sizeof(T));
  } else {
    static_assert(std::is_same_v<T, float> && kHalf<In>, "half inputs are computed in float");
    constexpr int L = Vec<float>::L;
    constexpr bool bf = std::is_same_v<In, Bf16Bits>;
    int64_t i = 0;
    for (; i + L <= n; i += L) {
      const VH h = *reinterpret_cast<const VHu*>(src + i);
      vstore(dst + i, half_to_float_v(__builtin_convertvector(h, VU), bf));
    }
    for (; i < n; ++i) dst[i] = to_c<T>(src[i]);
  }
}

/// dst[i] = src[i] rounded to the output type Out, i < n.
template <class Out, class T>
inline void store_cvt(const T* src, int64_t n, Out* dst) {
  if constexpr (std::is_same_v<Out, T>) {
    std::memcpy(dst, src, size_t(n) * sizeof(T));
  } else {
    static_assert(std::is_same_v<T, float> && kHalf<Out>, "half outputs are computed in float");
    constexpr int L = Vec<float>::L;
    constexpr bool bf = std::is_same_v<Out, Bf16Bits>;
    int64_t i = 0;
    for (; i + L <= n; i += L)
      *reinterpret_cast<VHu*>(dst + i) = __builtin_convertvector(float_to_half_v(vload(src + i), bf), VH);
    if (i < n) {
      // Tail: through one padded vector (at most L - 1 elements).
      alignas(64) float in[Vec<float>::L] = {};
      for (int64_t j = i; j < n; ++j) in[j - i] = src[j];
      const VU r = float_to_half_v(vload(in), bf);
      for (int64_t j = i; j < n; ++j) dst[j].bits = uint16_t(r[j - i]);
    }
  }
}

template <class T>
inline const T* cptr(const KView& v) {
  return static_cast<const T*>(v.data);
}
template <class T>
inline T* mptr(const KView& v) {
  return static_cast<T*>(v.data);
}

/// Loads one q/k row, L2-normalised (SPEC §1: x / sqrt(sum x^2 + 1e-6)) when `norm`, times `mul`.
/// The sum of squares is accumulated in vector lanes (a tree order, not the sequential one).
/// A bf16/f16 row is converted to float into `out` first. `rstd_out`, when given, gets the factor
/// 1 / sqrt(sum x^2 + 1e-6) (1 without the norm).
template <class T, class In>
inline void load_row(const In* xin, int64_t K, bool norm, T mul, T* out, T* rstd_out = nullptr) {
  if constexpr (!std::is_same_v<In, T>) {
    load_cvt(xin, K, out);
    return load_row<T, T>(out, K, norm, mul, out, rstd_out);
  }
  const T* x = reinterpret_cast<const T*>(xin);
  constexpr int L = Vec<T>::L;
  T rstd = 1;
  if (norm) {
    typename Vec<T>::type acc0{}, acc1{};
    int64_t i = 0;
    for (; i + 2 * L <= K; i += 2 * L) {
      const auto a = vload(x + i), b = vload(x + i + L);
      acc0 += a * a;
      acc1 += b * b;
    }
    for (; i + L <= K; i += L) {
      const auto a = vload(x + i);
      acc0 += a * a;
    }
    acc0 += acc1;
    T ss = 0;
    for (int l = 0; l < L; ++l) ss += acc0[l];
    for (; i < K; ++i) ss += x[i] * x[i];
    rstd = T(1) / std::sqrt(ss + T(1e-6));
  }
  if (rstd_out) *rstd_out = rstd;
  const T f = rstd * mul;
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * f;
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
