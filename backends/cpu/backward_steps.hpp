/// @brief Row operations of the CPU chunkwise backward (backward.hpp): the L2 norm's backward, the masks and
/// reductions of the intra-chunk gradients and the gate gradient's suffix sums.
#pragma once

#include <cstdint>

#include "gemm.hpp"
#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Backward of the L2 norm and scale of SPEC §1 (y = mul * xhat, xhat = x * rstd) from the normalised
/// row xhat and rstd: dx = mul * rstd * (dy - xhat (xhat . dy)); dx = mul * dy without the norm.
template <class T>
inline void norm_backward(const T* xhat, T rstd, int64_t K, bool norm, T mul, const T* dy, T* dx) {
  if (!norm) {
    for (int64_t i = 0; i < K; ++i) dx[i] = mul * dy[i];
    return;
  }
  const T ydy = dotv(xhat, dy, K);
  for (int64_t i = 0; i < K; ++i) dx[i] = mul * rstd * (dy[i] - xhat[i] * ydy);
}

/// Moves the diagonal of the c x Cp gradient dAq into ddq and keeps its strict lower triangle (masks in
/// vector lanes, column index j against the row i).
template <class T>
inline void split_diagonal(T* dAq, int64_t c, int64_t Cp, T* ddq) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  const V iota = iota_v<T>();
  for (int64_t i = 0; i < c; ++i) {
    ddq[i] = dAq[i * Cp + i];
    const V iv = vsplat(T(i));
    for (int64_t j = 0; j < Cp; j += L) vstore(dAq + i * Cp + j, sel(iota + T(j) < iv, vload(dAq + i * Cp + j), V{}));
  }
}

/// From dB = dX R^T (rows i < c of Cp): dAkk = -dB on j < i, dbeta_i += sum_j dAkk_ij Bm_ij, and dB becomes
/// beta dAkk (zero elsewhere).
template <class T>
inline void dakk_rows(T* dB, const T* Bm, const T* Bt, int64_t c, int64_t Cp, T* dbet) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  const V iota = iota_v<T>();
  for (int64_t i = 0; i < c; ++i) {
    T* db = dB + i * Cp;
    const T* bm = Bm + i * Cp;
    const V iv = vsplat(T(i)), bt = vsplat(Bt[i]);
    V a0{}, a1{};  // dbeta_i += sum_j dAkk_ij Bm_ij, two accumulators
    for (int64_t j = 0; j < Cp; j += L) {
      const V x = sel(iota + T(j) < iv, -vload(db + j), V{});
      if ((j / L) % 2)
        a1 += x * vload(bm + j);
      else
        a0 += x * vload(bm + j);
      vstore(db + j, x * bt);
    }
    a0 += a1;
    dbet[i] += hsum<T>(a0);
  }
}

/// Diagonal decay: dg[i * ts + ch] = sum over rows i' >= i (of c) of dgam[i' * Kp + ch], ch < K (gamma is a
/// within-chunk prefix sum). The running sums stay in registers, 8 vectors of channels at a time (the same
/// order per channel as a scalar loop).
template <class T>
inline void suffix_sums(const T* dgam, int64_t Kp, int64_t c, int64_t K, T* dg0, int64_t ts) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  int64_t ch0 = 0;
  while (ch0 + L <= K) {
    const int nv = int(imin(8, (K - ch0) / L));
    V run[8];
    for (int u = 0; u < nv; ++u) run[u] = V{};
    for (int64_t i = c - 1; i >= 0; --i)
      for (int u = 0; u < nv; ++u) {
        run[u] += vload(dgam + i * Kp + ch0 + u * L);
        vstore(dg0 + i * ts + ch0 + u * L, run[u]);
      }
    ch0 += int64_t(nv) * L;
  }
  for (int64_t ch = ch0; ch < K; ++ch) {
    T a = 0;
    for (int64_t i = c - 1; i >= 0; --i) dg0[i * ts + ch] = a += dgam[i * Kp + ch];
  }
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
