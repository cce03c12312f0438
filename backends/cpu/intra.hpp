/// @brief Intra-chunk matrices of the CPU chunkwise kernels (SPEC §4): gates, the scalar-decay products, sub-blocks.
#pragma once

#include <cstdint>

#include "gemm.hpp"
#include "simd.hpp"
#include "vmath.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

/// Sub-block rows of the diagonal-decay intra-chunk matrices (a multiple of every vector length).
constexpr int64_t kSub = 16;

/// Scalar decay (or none: gates all 0): row i of the intra-chunk gates into out, out[j] =
/// e^{gamma_i - gamma_j} for j <= i and 0 for i < j < Cp (a difference inside each exponent, SPEC §4).
/// Gam holds at least Cp values (those past the chunk are masked).
template <class T>
void gate_row(const T* Gam, int64_t i, int64_t Cp, T* out) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  const V iota = iota_v<T>();
  for (int64_t j = 0; j < Cp; j += L) {
    const V jv = iota + T(j);
    vstore(out + j, sel(jv <= vsplat(T(i)), vsplat(Gam[i]) - vload(Gam + j), vsplat(T(-1000))));
  }
  exp_inplace(out, Cp);
}

/// Intra-chunk matrices of scalar decay or none (SPEC §4), rows i < c of Cp columns: Aq[i,j] =
/// e^{gamma_i - gamma_j} (Qr_i . KW_j) for j <= i and, online, Bm[i,j] = w_i e^{gamma_i - gamma_j}
/// (Kn_i . KW_j) for j < i, with w = beta (w = 1 when beta is null); zero elsewhere. Kn and Qr have rows
/// of ldk, KWT is KW^T (K x Cp, columns >= c zero); tmp holds Cp values. `Bu`, when given (online),
/// gets Bm with w = 1 (the forward's training cache), Bm itself keeping the same rounding. Aq null: Bm only.
template <class T>
void intra_scalar(int64_t c, int64_t Cp, int64_t K, const T* Kn, const T* Qr, int64_t ldk, const T* KWT, const T* Gam,
                  const T* beta, bool online, T* Bm, T* Aq, T* tmp, T* Bu = nullptr) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  if (online) gemm(c, Cp, K, Kn, ldk, KWT, Cp, Bm, Cp, false, Tri::c_lower);
  if (Aq) gemm(c, Cp, K, Qr, ldk, KWT, Cp, Aq, Cp, false, Tri::c_lower);
  const V iota = iota_v<T>();
  for (int64_t i = 0; i < c; ++i) {
    gate_row(Gam, i, Cp, tmp);
    const T w = beta ? beta[i] : T(1);
    // Selects, not products: the entries above the diagonal that c_lower skips are stale.
    for (int64_t j = 0; j < Cp; j += L) {
      const V jv = iota + T(j), f = vload(tmp + j);
      if (Aq) vstore(Aq + i * Cp + j, sel(jv <= vsplat(T(i)), f * vload(Aq + i * Cp + j), V{}));
      if (online) {
        const V raw = vload(Bm + i * Cp + j);
        if (Bu) vstore(Bu + i * Cp + j, sel(jv < vsplat(T(i)), f * raw, V{}));
        vstore(Bm + i * Cp + j, sel(jv < vsplat(T(i)), (w * f) * raw, V{}));
      }
    }
  }
}

/// Diagonal decay: whether the pairs inside the sub-block of rows [i0, i0 + nb) (Gam rows of Kp) may use
/// the factored gates e^{gamma_i - gamma_i0} e^{gamma_i0 - gamma_j} instead of one exponential per pair:
/// |gamma_i - gamma_i0| <= 40 in every channel, so both factors stay far from float overflow and
/// underflow; strong decays (g = -50) fail it.
template <class T>
bool factorable(const T* Gam, int64_t Kp, int64_t i0, int64_t nb) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr T kFactorRange = 40;
  const T* g0 = Gam + i0 * Kp;
  V mx{};
  for (int64_t i = i0 + 1; i < i0 + nb; ++i)
    for (int64_t ch = 0; ch < Kp; ch += L) {
      const V d = vload(Gam + i * Kp + ch) - vload(g0 + ch), ad = sel(d < V{}, -d, d);
      mx = sel(ad > mx, ad, mx);
    }
  return all_lanes(mx <= vsplat(kFactorRange));
}

/// Diagonal decay, forward: how many leading rows of the sub-block [i0, i0 + nb) stay within the
/// factorable range of row i0 (`factorable` row by row; a NaN gate ends the run). Decided row by row so
/// that a later row's gates never change how an earlier row is computed (outputs stay causal, bitwise).
template <class T>
int64_t factor_rows(const T* Gam, int64_t Kp, int64_t i0, int64_t nb) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr T kFactorRange = 40;
  const T* g0 = Gam + i0 * Kp;
  for (int64_t i = i0 + 1; i < i0 + nb; ++i) {
    V mx{};
    for (int64_t ch = 0; ch < Kp; ch += L) {
      const V d = vload(Gam + i * Kp + ch) - vload(g0 + ch), ad = sel(d < V{}, -d, d);
      mx = sel(ad > mx, ad, mx);
      mx = sel(ad == ad, mx, vsplat(T(2) * kFactorRange));  // NaN: out of range
    }
    if (!all_lanes(mx <= vsplat(kFactorRange))) return i - i0;
  }
  return nb;
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
