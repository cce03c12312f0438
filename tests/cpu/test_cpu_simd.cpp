/// @brief The CPU kernels' vectorised squash and slope (backends/cpu/squash_simd.hpp: squash_vn, squash_v,
/// squash_inplace, squash_slope) against the scalar maths of dgps::maths (SPEC §2), for every compiled
/// instruction set this CPU runs, over a grid of statistics A (including A + eps <= 0), centers and bounds x.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../../backends/cpu/isa.hpp"
#include "dgps/detail/squash.hpp"

namespace {

using dgps::cpu::kernels::IsaKernels;

/// The instruction sets of this build that this CPU runs.
std::vector<IsaKernels> runnable_isas() {
  std::vector<IsaKernels> isas{dgps::cpu::kernels::generic::table()};
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    isas.push_back(dgps::cpu::kernels::avx2::table());
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    isas.push_back(dgps::cpu::kernels::avx512::table());
#elif defined(__aarch64__)
  isas.push_back(dgps::cpu::kernels::neon64::table());  // (Advanced SIMD: aarch64 baseline)
#endif
  return isas;
}

/// Statistics: the first half positive and normal (the blocks the 8-vector path takes whole), the second half
/// mixed with values where A + eps is zero, negative or subnormal (the per-lane fallback).
std::vector<float> grid_a(float eps) {
  std::vector<float> a;
  for (int i = 0; i < 256; ++i) a.push_back(std::pow(10.0f, -30.0f + 60.0f * float(i) / 255.0f));
  const float odd[] = {-1.0f, -eps,  -2 * eps, 0.0f, 1e-12f, 1e-6f,   1e-3f,  0.5f,
                       1.0f,  10.0f, 1e3f,     1e6f, 1e20f,  -1e-30f, 1e-40f, 3e-39f};
  for (int i = 0; i < 256; ++i) a.push_back(odd[i % 16] * (i % 3 == 0 ? 1.0f : float(1 + i % 5)));
  return a;
}

}  // namespace

// Tolerance: the vector log (about 4e-8 absolute on AVX-512, ~1 ulp elsewhere), the reciprocal estimate with one
// Newton step (~1e-7 relative) and the polynomial exp (below 4e-8 relative for |u| <= 0.75, ~1 ulp beyond) give
// M within a few 1e-7 and dM/dA within about 1e-6 of the float64 maths; 4e-6 relative leaves headroom.
TEST_CASE("CPU SIMD squash, squash_vn, squash_inplace and squash_slope match dgps::maths (rel err < 4e-6)") {
  constexpr double kTol = 4e-6;
  for (const IsaKernels& isa : runnable_isas()) {
    INFO("isa " << isa.name);
    for (float eps : {1e-6f, 0.0f})
      for (float center : {-2.0f, 0.0f, 1.5f, 5.0f})
        for (float x : {0.5f, 1.5f, 2.0f, 3.0f}) {  // |log 3| > 0.75: the range-reduced exp
          const std::vector<float> a = grid_a(eps);
          const int64_t n = int64_t(a.size());
          std::vector<float> out(size_t(5 * n));
          const float log_x = std::log(x);
          isa.squash_lanes(a.data(), n, center, log_x, eps, out.data());
          int bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double A = a[size_t(i)], lx = std::log(double(x));
            const double m = dgps::maths::squash<double>(A, center, lx, eps);
            const double d = dgps::maths::squash_slope<double>(A, m, center, lx, eps);
            for (int k = 0; k < 5; ++k) {
              const double want = k < 4 ? m : d, got = out[size_t(k * n + i)];
              const double err = std::fabs(got - want) / std::fmax(std::fabs(want), 1e-30);
              if (!(err <= kTol) && !(k == 4 && std::fabs(got - want) <= 1e-30) && bad++ < 5)
                std::printf("%s path %d: A=%g center=%g x=%g eps=%g: got %.9g want %.9g\n", isa.name, k, A,
                            double(center), double(x), double(eps), got, want);
            }
          }
          CHECK(bad == 0);
        }
  }
}
