/// @brief The squash of SPEC §2 and its slope on vectors of statistics (CPU leaf kernels), with scalar fallbacks.
#pragma once

#include <cmath>
#include <cstdint>

#include "dgps/detail/squash.hpp"
#include "simd.hpp"
#include "vmath.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// The smallest normal float: the vector paths take A + eps at or above it (log_v's domain).
constexpr float kMinNormal = 1.17549435e-38f;

/// dgps::maths::squash (SPEC §2) for one value. Flattened into this internal function so that no inline
/// function compiled with this unit's flags is shared with another unit through the linker.
template <class T>
[[gnu::flatten]] inline T squash1(T A, T center, T log_x, T eps) {
  return dgps::maths::squash(A, center, log_x, eps);
}

/// dgps::maths::stats_step (SPEC §2) for one channel, flattened as squash1: a A + b kn^2.
template <class T>
[[gnu::flatten]] inline T stats1(T A, T a, T b, T kn) {
  return dgps::maths::stats_step(A, a, b, kn);
}

/// dgps::maths::squash and squash_slope for one value: returns M and stores dM/dA in `*dmda` (0 where
/// A + eps <= 0). Flattened as squash1.
template <class T>
[[gnu::flatten]] inline T squash_grad1(T A, T center, T log_x, T eps, T* dmda) {
  const T m = dgps::maths::squash(A, center, log_x, eps);
  *dmda = dgps::maths::squash_slope(A, m, center, log_x, eps);
  return m;
}

/// The squash of SPEC §2 on one vector of statistics A (lanes with A + eps below the normal range, or
/// NaN, one by one through squash1). Its exponent -log(x) r / (1 + |r|) lies within |log x|, so
/// for x in [0.47, 2.1] (the default is 1.5) exp needs no range reduction.
inline VF squash_v(const VF& A, float center, float log_x, float eps) {
  const VF ae = A + eps;
  if (!all_lanes(ae >= vsplat(kMinNormal))) {
    alignas(64) float m[Vec<float>::L];
    vstore(m, A);
    for (int l = 0; l < Vec<float>::L; ++l) m[l] = squash1(m[l], center, log_x, eps);
    return vload(m);
  }
  const VF r = log_v(ae) - center;
  const VF ar = sel(r < vsplat(0.0f), -r, r);
  const VF u = (-log_x * r) * recip_v(1.0f + ar);
  return std::fabs(log_x) <= 0.75f ? exp_small_v(u) : exp_v(u);
}

/// squash_v on N vectors at once, stage by stage across the N (so the instruction stream interleaves N
/// independent chains: the squash's log, reciprocal and exp are long dependent chains that the
/// out-of-order core overlaps poorly when each vector's chain comes whole, about 95 cycles each).
/// With `iden`, also 1 / (1 + |r|) (for the squash's slope). Returns false, writing nothing, unless
/// every lane of A + eps is normal and |log x| <= 0.75 (then squash_v applies vector by vector).
template <int N>
inline bool squash_vn(const VF* A, VF* out, float center, float log_x, float eps, VF* iden = nullptr) {
  VF ae[N];
  for (int n = 0; n < N; ++n) ae[n] = A[n] + eps;
  auto ok = ae[0] >= vsplat(kMinNormal);
  for (int n = 1; n < N; ++n) ok = ok & (ae[n] >= vsplat(kMinNormal));
  if (!all_lanes(ok) || !(std::fabs(log_x) <= 0.75f)) return false;
  VF r[N], d[N], u[N];
  log_vn<N>(ae, r);
  for (int n = 0; n < N; ++n) {  // u = -log(x) r / (1 + |r|), r = log(A + eps) - center
    r[n] = r[n] - center;
    d[n] = 1.0f + sel(r[n] < vsplat(0.0f), -r[n], r[n]);
  }
  for (int n = 0; n < N; ++n) d[n] = recip_v(d[n]);
  if (iden)
    for (int n = 0; n < N; ++n) iden[n] = d[n];
  for (int n = 0; n < N; ++n) u[n] = (-log_x * r[n]) * d[n];
  exp_small_vn<N>(u, out);
  return true;
}

/// a[i] = squash(a[i]) for i < n (n a multiple of the vector length for float).
template <class T>
void squash_inplace(T* a, int64_t n, T center, T log_x, T eps) {
  if constexpr (sizeof(T) == 4) {
    constexpr int L = Vec<float>::L;
    // One check for the whole row first (the usual case: every A + eps normal), in vector lanes;
    // a NaN fails the comparison and sends the row to the per-vector checks.
    bool all_normal = true;
    if (n > 0) {
      auto ok = vload(a) + eps >= vsplat(kMinNormal);
      for (int64_t i = L; i < n; i += L) ok = ok & (vload(a + i) + eps >= vsplat(kMinNormal));
      all_normal = all_lanes(ok);
    }
    for (int64_t i = 0; i < n; i += L) {
      const VF ae = vload(a + i) + eps;
      if (all_normal || all_lanes(ae >= vsplat(kMinNormal))) {
        const VF r = log_v(ae) - center;
        const VF ar = sel(r < vsplat(0.0f), -r, r);
        vstore(a + i, exp_v(-log_x * (r / (1.0f + ar))));
      } else {
        for (int l = 0; l < L; ++l) a[i + l] = squash1(a[i + l], center, log_x, eps);
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) a[i] = squash1(a[i], center, log_x, eps);
  }
}

/// M[i] = squash(A[i]) (SPEC §2) and D[i] = dM/dA there, M (-log x) / ((1 + |r|)^2 (A + eps)) with
/// r = log(A + eps) - center, in one pass (one log per element); D = 0 where A + eps <= 0 (as the
/// reference). n a multiple of the vector length for float.
template <class T>
void squash_slope(const T* A, T* M, T* D, int64_t n, T center, T log_x, T eps) {
  int64_t i = 0;
  if constexpr (sizeof(T) == 4) {
    constexpr int L = Vec<float>::L, G = 8;  // G vectors at once, interleaved (as the forward)
    for (; i + G * L <= n; i += G * L) {
      VF a[G], m[G], id[G];
      for (int u = 0; u < G; ++u) a[u] = vload(A + i + u * L);
      if (!squash_vn<G>(a, m, center, log_x, eps, id)) break;  // the vector-by-vector loop takes over
      for (int u = 0; u < G; ++u) {
        vstore(M + i + u * L, m[u]);
        vstore(D + i + u * L, m[u] * -log_x * (id[u] * id[u]) * recip_v(a[u] + eps));
      }
    }
    for (; i < n; i += L) {
      const VF ae = vload(A + i) + eps;
      if (all_lanes(ae >= vsplat(kMinNormal))) {
        const VF r = log_v(ae) - center;
        const VF den = 1.0f + sel(r < vsplat(0.0f), -r, r);
        const VF iden = recip_v(den);  // the forward's squash_v rounding
        const VF u = (-log_x * r) * iden;
        const VF m = std::fabs(log_x) <= 0.75f ? exp_small_v(u) : exp_v(u);
        vstore(M + i, m);
        vstore(D + i, m * -log_x * (iden * iden) * recip_v(ae));
      } else {
        for (int l = 0; l < L; ++l) M[i + l] = squash_grad1(A[i + l], center, log_x, eps, D + i + l);
      }
    }
  }
  for (; i < n; ++i) M[i] = squash_grad1(A[i], center, log_x, eps, D + i);
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
