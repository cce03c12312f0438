/// @brief The preconditioner's scalar maths (SPEC §2), written once for the reference, the CPU scalar paths and the
/// CUDA recurrent kernels: the statistics step, the squash and its slopes. Vectorised and fast-math variants are
/// tested against these.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DGPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DGPS_HOST_DEVICE inline
#endif

namespace dgps::maths {

/// One token of a diagonal statistic (SPEC §2): A_t = a A_{t-1} + b kn^2, with a = e^{g_p}, b = beta_p.
template <class T>
DGPS_HOST_DEVICE T stats_step(T A, T a, T b, T kn) {
  return a * A + b * kn * kn;
}

/// The squash (SPEC §2): r = log(A + eps) - center, M = exp(-log(x) r / (1 + |r|)); M = x where A + eps is not
/// positive (log(0) = -inf gives r / (1 + |r|) = -1). `log_x` is log of the squash bound x.
template <class T>
DGPS_HOST_DEVICE T squash(T A, T center, T log_x, T eps) {
  using std::exp, std::fabs, std::log;
  const T ae = A + eps;
  if (!(ae > T(0))) return exp(log_x);
  const T r = log(ae) - center;
  return exp(-log_x * (r / (T(1) + fabs(r))));
}

/// The squash's slopes at A, given M = squash(A, ...): returns dM/dA and stores dM/dcenter in `*dmdc` (may be
/// null); both are 0 where A + eps is not positive (no gradient flows through the clamp).
template <class T>
DGPS_HOST_DEVICE T squash_slope(T A, T M, T center, T log_x, T eps, T* dmdc = nullptr) {
  using std::fabs, std::log;
  const T ae = A + eps;
  if (!(ae > T(0))) {
    if (dmdc) *dmdc = T(0);
    return T(0);
  }
  const T r = log(ae) - center;
  const T den = T(1) + fabs(r);
  const T c = M * log_x / (den * den);
  if (dmdc) *dmdc = c;
  return -c / ae;
}

}  // namespace dgps::maths
