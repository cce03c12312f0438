/// @brief Vector exp and log for float (the squash's and the gates' transcendental functions) of the CPU leaf kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// Vector exp / log for float (Cephes-style range reduction + minimax polynomials, ~1 ulp).

/// e^x for float lanes (0 below -87, clamped at 88).
inline VF exp_v(const VF& x) {
  const VF lo = vsplat(-87.0f), hi = vsplat(88.0f);
  const VF xc = sel(x < lo, lo, sel(x > hi, hi, x));
  const VF magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const VF z = xc * 1.44269504088896341f + magic;
  const VF n = z - magic;
  const VI ni = bitcast<VI>(z) - bitcast<VI>(magic);
  VF r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VF p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  VF y = p * r * r + r + 1.0f;
  y = y * bitcast<VF>(shl<23>(ni + 127));
  return sel(x < lo, vsplat(0.0f), y);
}

#if defined(DGPS_CPU_REG_AVX512)
// AVX-512 operations xsimd lacks (the maskz forms: the unmasked intrinsics of GCC 12 trip
// -Wmaybe-uninitialized).
/// The mantissa of x scaled into [1, 2) (vgetmantps).
inline VF mantissa_1_2(const VF& x) {
  return _mm512_maskz_getmant_ps(__mmask16(0xffff), x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
}
/// floor(log2 |x|) as a float (vgetexpps).
inline VF exponent_of(const VF& x) { return _mm512_maskz_getexp_ps(__mmask16(0xffff), x); }
/// table[j & 15] per lane, the 16-entry table held in a register (vpermps).
inline VF lookup16(const VI& j, const VF& table) { return _mm512_maskz_permutexvar_ps(__mmask16(0xffff), j, table); }
#endif

/// Natural log for x >= FLT_MIN (normal, positive) of N vectors, stage by stage across the N so that
/// their dependency chains interleave (the squash's log is on a latency-bound chain).
/// AVX-512: x = 2^e m with m in [1, 2) (getexp, getmant); the top 4 bits of m's fraction pick c_j =
/// 1 + (j + 1/2) / 16 from 16-entry tables held in a register each (vpermps), and log x = e log 2 +
/// log c_j + log1p(y), y = m / c_j - 1 in [-1/33, 1/33], log1p by its Taylor polynomial to y^5
/// (truncation below 2e-10; the float tables keep the absolute error below about 4e-8, 12
/// instructions a vector). Other ISAs: Cephes' range reduction and minimax polynomial in Estrin's
/// form (dependency depth 4 instead of Horner's 9), about 1 ulp.
template <int N>
inline void log_vn(const VF* x, VF* out) {
#if defined(DGPS_CPU_REG_AVX512)
  // 1 / c_j rounded to float, and log c_j = -log of that float (so that y below is m / c_j - 1 exactly
  // up to one rounding).
  alignas(64) static constexpr float kInvC[16] = {
      0.9696969985961914f, 0.9142857193946838f, 0.8648648858070374f, 0.8205128312110901f,
      0.7804877758026123f, 0.7441860437393188f, 0.7111111283302307f, 0.6808510422706604f,
      0.6530612111091614f, 0.6274510025978088f, 0.6037735939025879f, 0.581818163394928f,
      0.5614035129547119f, 0.5423728823661804f, 0.5245901346206665f, 0.5079365372657776f};
  alignas(64) static constexpr float kLogC[16] = {
      0.03077162802219391f, 0.08961215615272522f, 0.14518198370933533f, 0.19782572984695435f,
      0.24783620238304138f, 0.2954642176628113f,  0.34092655777931213f, 0.3844117224216461f,
      0.42608442902565f,    0.4660896956920624f,  0.5045560002326965f,  0.541597306728363f,
      0.5773153305053711f,  0.6118015646934509f,  0.6451380252838135f,  0.6773987412452698f};
  const VF inv_c = vload(kInvC), log_c = vload(kLogC);
  VF y[N], t[N];
  for (int n = 0; n < N; ++n) {
    const VI j = shr<19>(bitcast<VI>(x[n]));  // x > 0; the lookup reads the index's low 4 bits
    y[n] = mantissa_1_2(x[n]) * lookup16(j, inv_c) - 1.0f;
    t[n] = exponent_of(x[n]) * 0.693147180559945309f + lookup16(j, log_c);
  }
  for (int n = 0; n < N; ++n) {
    VF q = y[n] * 0.2f - 0.25f;
    q = q * y[n] + (1.0f / 3);
    q = q * y[n] - 0.5f;
    q = q * y[n] + 1.0f;
    out[n] = q * y[n] + t[n];
  }
#else
  VF m[N], ef[N], z[N], y[N];
  for (int n = 0; n < N; ++n) {  // x = 2^e m, m in [sqrt(1/2), sqrt(2))
    const VI bits = bitcast<VI>(x[n]);
    VI e = (shr<23>(bits) & 0xff) - 126;
    const VF mm = bitcast<VF>((bits & 0x007fffff) | 0x3f000000);  // [0.5, 1)
    const auto small = mm < vsplat(0.707106781186547524f);
    e = sel(int_mask(small), e - 1, e);
    m[n] = sel(small, mm + mm - 1.0f, mm - 1.0f);
    ef[n] = to_float(e);
  }
  for (int n = 0; n < N; ++n) z[n] = m[n] * m[n];
  for (int n = 0; n < N; ++n) {
    const VF q01 = m[n] * -2.4999993993e-1f + 3.3333331174e-1f, q23 = m[n] * -1.6668057665e-1f + 2.0000714765e-1f;
    y[n] = q23 * z[n] + q01;
  }
  for (int n = 0; n < N; ++n) {
    const VF q45 = m[n] * -1.2420140846e-1f + 1.4249322787e-1f, q67 = m[n] * -1.1514610310e-1f + 1.1676998740e-1f;
    const VF z2 = z[n] * z[n];
    y[n] = (q67 * z[n] + q45) * z2 + y[n] + (z2 * z2) * 7.0376836292e-2f;
  }
  for (int n = 0; n < N; ++n) {
    VF t = y[n] * m[n] * z[n] + ef[n] * -2.12194440e-4f;
    t = t - 0.5f * z[n];
    out[n] = m[n] + t + ef[n] * 0.693359375f;
  }
#endif
}

/// Natural log for x >= FLT_MIN (normal, positive).
inline VF log_v(const VF& x) {
  VF y;
  log_vn<1>(&x, &y);
  return y;
}

/// x[i] = exp(x[i]) for i < n (n a multiple of the vector length for float).
template <class T>
void exp_inplace(T* x, int64_t n) {
  if constexpr (sizeof(T) == 4) {
    for (int64_t i = 0; i < n; i += Vec<float>::L) vstore(x + i, exp_v(vload(x + i)));
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
  }
}

/// exp(u) for |u| <= 0.75 without range reduction, N vectors stage by stage: Taylor to degree 9 in
/// Estrin's form (relative error below 4e-8 there).
template <int N>
inline void exp_small_vn(const VF* u, VF* out) {
  VF u2[N], lo[N];
  for (int n = 0; n < N; ++n) {
    u2[n] = u[n] * u[n];
    lo[n] = (u[n] * (1.0f / 6) + 0.5f) * u2[n] + (u[n] + 1.0f);
  }
  for (int n = 0; n < N; ++n) {
    const VF v = u[n], v2 = u2[n], v4 = v2 * v2;
    const VF p45 = v * (1.0f / 120) + (1.0f / 24), p67 = v * (1.0f / 5040) + (1.0f / 720);
    const VF p89 = v * (1.0f / 362880) + (1.0f / 40320);
    out[n] = lo[n] + (p67 * v2 + p45) * v4 + p89 * (v4 * v4);
  }
}
inline VF exp_small_v(const VF& u) {
  VF y;
  exp_small_vn<1>(&u, &y);
  return y;
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
