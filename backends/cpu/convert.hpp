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

/// m ? x : y on uint32 lanes, m a comparison of the lanes as int32 (the values compared are below 2^31, where
/// the signed order is the unsigned one).
template <class M>
inline VU sel_u(const M& m, const VU& x, const VU& y) {
  return bitcast<VU>(sel(m, bitcast<VI>(x), bitcast<VI>(y)));
}

/// L halves (bit patterns widened to 32 bits) to L floats.
inline VF half_to_float_v(const VU& h, bool bf) {
  if (bf) return bitcast<VF>(shl<16>(h));
  const VU sign = shl<16>(h & 0x8000u), e = shr<10>(h) & 0x1fu, m = h & 0x3ffu;
  const VU normal = shl<23>(e + 112u) | shl<13>(m);
  const VU infnan = 0x7f800000u | shl<13>(m);
  const VU sub = bitcast<VU>(to_float(bitcast<VI>(m)) * 0x1p-24f);
  const VI ei = bitcast<VI>(e);
  const VU r = sel_u(ei == 0, sub, sel_u(ei == 0x1f, infnan, normal));
  return bitcast<VF>(r | sign);
}

/// L floats to L halves (bit patterns in 32-bit lanes), round to nearest even.
inline VU float_to_half_v(const VF& x, bool bf) {
  const VU u = bitcast<VU>(x);
  const VU a = u & 0x7fffffffu;
  const VI ai = bitcast<VI>(a);
  if (bf) {
    const VU r = shr<16>(u + 0x7fffu + (shr<16>(u) & 1u));
    return sel_u(ai > 0x7f800000, shr<16>(u) | 0x40u, r);
  }
  const VU sign = shr<16>(u) & 0x8000u;
  const VU rn = a - 0x38000000u;
  const VU normal = shr<13>(rn + 0xfffu + (shr<13>(rn) & 1u));
  // Below 2^-14: adding 0.5 leaves a float whose last mantissa bit is worth 2^-24 (a half's
  // subnormal step), so the FPU's round-to-nearest-even does the rounding.
  const VU sub = bitcast<VU>(bitcast<VF>(a) + 0.5f) - 0x3f000000u;
  VU r = sel_u(ai < 0x38800000, sub, normal);
  r = sel_u(ai >= 0x477ff000, VU(0x7c00u), r);
  r = sel_u(ai > 0x7f800000, 0x7e00u | (shr<13>(a) & 0x3ffu), r);
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
    for (; i + L <= n; i += L)
      vstore(dst + i, half_to_float_v(load_u16(reinterpret_cast<const uint16_t*>(src + i)), bf));
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
    for (; i + L <= n; i += L) store_u16(reinterpret_cast<uint16_t*>(dst + i), float_to_half_v(vload(src + i), bf));
    if (i < n) {
      // Tail: through one padded vector (at most L - 1 elements).
      alignas(64) float in[Vec<float>::L] = {};
      for (int64_t j = i; j < n; ++j) in[j - i] = src[j];
      alignas(64) uint32_t r[Vec<float>::L];
      vstore(r, float_to_half_v(vload(in), bf));
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
    T ss = hsum<T>(acc0);
    for (; i < K; ++i) ss += x[i] * x[i];
    rstd = T(1) / std::sqrt(ss + T(1e-6));
  }
  if (rstd_out) *rstd_out = rstd;
  const T f = rstd * mul;
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * f;
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
