/// @brief Small GEMMs, the unit-triangular solve and dot products of the CPU leaf kernels (register-blocked).
#pragma once

#include <cstdint>
#include <utility>

#include "simd.hpp"
#include "trickle.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// ---------------------------------------------------------------------------------------------
// GEMM: C[m x n] (+)= A[m x kd] B[kd x n], row-major, n a multiple of the vector length.

// AT: A given transposed (k-major, A^T[r][k] at A[k * lda + r]); the same register block, its row
// operands broadcast from consecutive elements. `rs` (with acc): C's rows scaled first, C[r] = rs[r] C[r]
// + (A B)[r] (a state's decay folded into its update, without a pass of its own over C). From k = kt on,
// A is lower-triangular (row r uses k <= kt + r only): the zeros above its diagonal are skipped, not
// multiplied in, so a NaN or Inf in B's later rows never reaches earlier rows of C (0 * NaN is NaN).
template <class T, int MR, int NV, bool AT = false>
inline void gemm_block(int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool acc,
                       const T* rs, int64_t kt) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      c[r][v] = acc ? (rs ? rs[r] * vload(C + r * ldc + v * L) : vload(C + r * ldc + v * L)) : V{};
  const int64_t kf = kt < kd ? kt : kd;
  for (int64_t k = 0; k < kf; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
    for (int r = 0; r < MR; ++r) {
      const T a = AT ? A[k * lda + r] : A[r * lda + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int64_t k = kf; k < kd; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
    for (int r = int(k - kt); r < MR; ++r) {
      const T a = AT ? A[k * lda + r] : A[r * lda + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * L, c[r][v]);
}

template <class T, int NV, int MR = kMR, bool AT = false>
inline void gemm_rows(int mr, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool acc,
                      const T* rs, int64_t kt) {
  if constexpr (MR >= 1) {
    if (mr == MR) return gemm_block<T, MR, NV, AT>(kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
    return gemm_rows<T, NV, MR - 1, AT>(mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
  }
}

/// Triangular structure a product may skip: none; A lower-triangular (A[i][k] = 0 for k > i, so row
/// block i0.. needs k < i0 + rows); or only C's lower triangle wanted (C[i][j] for j <= i).
enum class Tri { none, a_lower, c_lower };

/// gemm_rows for a panel of nv <= NV vectors (nv chosen at run time).
template <class T, bool AT, int NV = kNV>
inline void gemm_panel(int nv, int mr, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                       bool acc, const T* rs, int64_t kt) {
  if constexpr (NV >= 1) {
    if (nv == NV) return gemm_rows<T, NV, kMR, AT>(mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
    return gemm_panel<T, AT, NV - 1>(nv, mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
  }
}

/// The register-block sweep shared by `gemm` and `gemm_at`: column panels of kNV vectors, row blocks
/// of kMR; `krange(i0, mr)` gives the k range [k0, k1) a row block needs, and `cols(i0, mr, j0, nv)` how
/// many of the panel's nv vectors (from column j0 on) it needs (0: none, the block is skipped); `ktri`
/// (a_lower only): the block's k from which A is lower-triangular (gemm_block's kt). AT: A is
/// stored k-major (A^T[r][k] at A[k * lda + r]). `rs`: C's row scales (see gemm_block), or null.
template <class T, bool AT, class KRange, class Cols>
void gemm_sweep(int64_t m, int64_t n, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool acc,
                const T* rs, Trickle<T>* tr, KRange&& krange, Cols&& cols, bool ktri = false) {
  constexpr int L = Vec<T>::L;
  for (int64_t j0 = 0; j0 < n;) {
    const int nv = int(imin(kNV, (n - j0) / L));
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      const int mr = int(imin(kMR, m - i0)), nb = cols(i0, mr, j0, nv);
      if (nb <= 0) continue;
      if (tr) tr->step();
      const auto [k0, k1] = krange(i0, mr);
      const T* a = AT ? A + k0 * lda + i0 : A + i0 * lda + k0;
      gemm_panel<T, AT>(nb, mr, k1 - k0, a, lda, B + k0 * ldb + j0, ldb, C + i0 * ldc + j0, ldc, acc,
                        rs ? rs + i0 : nullptr, ktri ? i0 - k0 : k1 - k0);
    }
    j0 += int64_t(nv) * L;
  }
}

/// `tr`, when given, gets one step() per register block (Trickle); `rs`, with acc, scales C's rows first
/// (C = Diag(rs) C + A B).
template <class T>
void gemm(int64_t m, int64_t n, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          bool acc, Tri tri = Tri::none, Trickle<T>* tr = nullptr, const T* rs = nullptr) {
  gemm_sweep<T, false>(
      m, n, A, lda, B, ldb, C, ldc, acc, rs, tr,
      [&](int64_t i0, int mr) {
        return std::pair<int64_t, int64_t>{0, tri == Tri::a_lower ? imin(kd, i0 + mr) : kd};
      },
      [&](int64_t i0, int mr, int64_t j0, int nv) {  // c_lower: the vectors reaching column i0 + mr - 1
        constexpr int L = Vec<T>::L;
        return tri == Tri::c_lower ? int(imin(nv, (i0 + mr - j0 + L - 1) / L)) : nv;
      },
      tri == Tri::a_lower);
}

/// C[m x n] (+)= A^T B with A stored k-major (kd x m, row stride lda): as `gemm` without a transpose
/// of A first (the register block broadcasts A^T's rows from consecutive elements). `upper`: A^T is
/// upper-triangular (A[k][i] = 0 for k < i), so row block i0.. starts at k = i0. `tr`, `rs`: as `gemm`.
template <class T>
void gemm_at(int64_t m, int64_t n, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
             bool acc, bool upper = false, Trickle<T>* tr = nullptr, const T* rs = nullptr) {
  gemm_sweep<T, true>(
      m, n, A, lda, B, ldb, C, ldc, acc, rs, tr,
      [&](int64_t i0, int) {
        return std::pair<int64_t, int64_t>{upper ? i0 : 0, kd};
      },
      [](int64_t, int, int64_t, int nv) { return nv; });
}

/// sum_i a[i] b[i] for i < n (n a multiple of the vector length), in vector lanes: a scalar loop is
/// one dependent add per element (no reassociation without -ffast-math).
template <class T>
inline T dot_padded(const T* a, const T* b, int64_t n) {
  constexpr int L = Vec<T>::L;
  typename Vec<T>::type acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 += vload(a + i) * vload(b + i);
    acc1 += vload(a + i + L) * vload(b + i + L);
  }
  for (; i < n; i += L) acc0 += vload(a + i) * vload(b + i);
  acc0 += acc1;
  return hsum<T>(acc0);
}

/// sum_i a[i] b[i] with vector accumulators (the compiler may not reorder a scalar float sum).
template <class T>
inline T dotv(const T* a, const T* b, int64_t n) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 += vload(a + i) * vload(b + i);
    acc1 += vload(a + i + L) * vload(b + i + L);
  }
  for (; i + L <= n; i += L) acc0 += vload(a + i) * vload(b + i);
  acc0 += acc1;
  T sum = hsum<T>(acc0);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

/// dst[i] = src[i] for i < n: an inline vector loop for rows of a few hundred bytes (no library call
/// per row).
template <class T>
inline void copy_row(T* dst, const T* src, int64_t n) {
  constexpr int L = Vec<T>::L;
  int64_t i = 0;
  for (; i + L <= n; i += L) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

/// unit_solve on the NB vectors of columns starting at R (see there): each row's block stays in registers while
/// the other rows stream past. NB is a compile-time count: an accumulator array sized at run time (the
/// remainder's `v < nb`) stayed in memory with xsimd's batch types (a load and a store around every FMA;
/// the solve took 2.3x its time).
template <class T, int NB>
inline void unit_solve_cols(int64_t m, const T* A, int64_t si, int64_t sj, T* R, int64_t ldr, bool transposed) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  for (int64_t r = 1; r < m; ++r) {
    const int64_t i = transposed ? m - 1 - r : r;
    const int64_t j0 = transposed ? i + 1 : 0, j1 = transposed ? m : i;
    V acc[NB];
    T* ri = R + i * ldr;
    for (int v = 0; v < NB; ++v) acc[v] = vload(ri + v * L);
    for (int64_t j = j0; j < j1; ++j) {
      const T a = A[i * si + j * sj];
      const T* rj = R + j * ldr;
      for (int v = 0; v < NB; ++v) acc[v] -= a * vload(rj + v * L);
    }
    for (int v = 0; v < NB; ++v) vstore(ri + v * L, acc[v]);
  }
}

/// Unit-triangular substitution in place on the m x n rows of R (n a multiple of the vector length,
/// row stride `ldr`) for a strictly lower-triangular A (rows of `lda`): with `transposed` false it
/// solves (I + A) X = R forward, X_i = R_i - sum_{j < i} A[i][j] X_j; with `transposed` true it solves
/// (I + A)^T X = R backward, X_i = R_i - sum_{j > i} A[j][i] X_j. Blocks of 8 vectors of columns, then
/// single vectors (unit_solve_cols).
template <class T>
void unit_solve(int64_t m, int64_t n, const T* A, int64_t lda, T* R, int64_t ldr, bool transposed) {
  constexpr int L = Vec<T>::L;
  constexpr int NB = 8;
  // Coefficient of row j in row i's update: A[i][j] (forward) or A[j][i] (transposed).
  const int64_t si = transposed ? 1 : lda, sj = transposed ? lda : 1;
  int64_t e0 = 0;
  for (; e0 + NB * L <= n; e0 += NB * L) unit_solve_cols<T, NB>(m, A, si, sj, R + e0, ldr, transposed);
  for (; e0 + L <= n; e0 += L) unit_solve_cols<T, 1>(m, A, si, sj, R + e0, ldr, transposed);
}

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
