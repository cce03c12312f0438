/// @brief The CPU leaf kernels' entry points (chunkwise forward and backward SPEC §4, decode SPEC §2), compiled
/// once per ISA.
///
/// Included by kernel_<isa>.cpp with DGPS_ISA_NS set to the ISA's namespace. Everything except the
/// exported `table()` has internal linkage (anonymous namespace) and no standard-library inline code
/// is instantiated here, so the per-ISA copies never collide at link time (no ODR mixing of AVX-512
/// code into the generic path).
///
/// The kernels live in headers by role: simd.hpp (the vector layer), vmath.hpp, squash_simd.hpp, gemm.hpp,
/// transpose.hpp, trickle.hpp, scratch.hpp, convert.hpp, setup.hpp, intra.hpp, chunk_forward.hpp, decode.hpp,
/// backward.hpp, exact_backward.hpp.
#include <cstdint>

#include "backward.hpp"
#include "chunk_forward.hpp"
#include "convert.hpp"
#include "decode.hpp"
#include "exact_backward.hpp"
#include "isa.hpp"
#include "simd.hpp"
#include "squash_simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

void chunk_task(const KernelParams& p, int64_t task, int64_t vsplit, int64_t group) {
  switch (p.dtype) {
    case DType::f64:
      return chunk_task_t<double>(p, task, vsplit, group);
    case DType::bf16:
      return chunk_task_t<float, Bf16Bits>(p, task, vsplit, group);
    case DType::f16:
      return chunk_task_t<float, F16Bits>(p, task, vsplit, group);
    default:
      return chunk_task_t<float>(p, task, vsplit, group);
  }
}

void decode_task(const KernelParams& p, int64_t task) {
  switch (p.dtype) {
    case DType::f64:
      return decode_task_t<double>(p, task);
    case DType::bf16:
      return decode_task_t<float, Bf16Bits>(p, task);
    case DType::f16:
      return decode_task_t<float, F16Bits>(p, task);
    default:
      return decode_task_t<float>(p, task);
  }
}

/// The exported entry (IsaKernels::backward_task): backward_task_t for the call's element type.
void backward_task(const KernelParams& p, int64_t task, int64_t group, double* dcenter) {
  if (p.dtype == DType::f64)
    backward_task_t<double>(p, task, group, dcenter);
  else
    backward_task_t<float>(p, task, group, dcenter);
}

/// The exported entry (IsaKernels::exact_backward_task): float or double (bf16 / f16 run on float copies).
void exact_backward_task(const KernelParams& p, int64_t task) {
  if (p.dtype == DType::f64)
    exact_backward_task_t<double>(p, task);
  else
    exact_backward_task_t<float>(p, task);
}

void squash_lanes(const float* A, int64_t n, float center, float log_x, float eps, float* out) {
  constexpr int L = Vec<float>::L, G = 8;
  for (int64_t i = 0; i < n; i += G * L) {
    VF a[G], m[G];
    for (int u = 0; u < G; ++u) a[u] = vload(A + i + u * L);
    const bool vn = squash_vn<G>(a, m, center, log_x, eps);
    for (int u = 0; u < G; ++u) vstore(out + i + u * L, vn ? m[u] : squash_v(a[u], center, log_x, eps));
  }
  for (int64_t i = 0; i < n; i += L) vstore(out + n + i, squash_v(vload(A + i), center, log_x, eps));
  for (int64_t i = 0; i < n; ++i) out[2 * n + i] = A[i];
  squash_inplace(out + 2 * n, n, center, log_x, eps);
  squash_slope(A, out + 3 * n, out + 4 * n, n, center, log_x, eps);
}

}  // namespace

#define DGPS_STR2(x) #x
#define DGPS_STR(x) DGPS_STR2(x)

IsaKernels table() { return {DGPS_STR(DGPS_ISA_NS), &chunk_task, &decode_task, &backward_task, &exact_backward_task, &squash_lanes}; }

}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
