/// @brief The chunkwise kernels' squash_fast and squash_grad_fast against dgps::maths::squash and squash_slope.
#include <algorithm>
#include <cmath>
#include <vector>

#include <cuda_runtime.h>

// The kernels' headers in the order the chunk_*.cu files include them (squash_fast, squash_grad_fast).
#include "launch/chunk_launch.cuh"
// (after launch/chunk_launch.cuh)
#include "launch/chunk_backward_launch.cuh"

#include "dgps/detail/squash.hpp"
#include "squash_agreement.hpp"

namespace {

namespace chunk = dgps::cuda::kernels::chunk;

/// out[8 i ..]: M by squash_fast, by squash_grad_fast, by maths::squash; dM/dA and dM/dcenter by
/// squash_grad_fast and by maths::squash_slope, for the point (A[i], center[i], log_x[i]).
__global__ void squash_points(const float* A, const float* center, const float* log_x, float eps, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float lx = log_x[i], c = center[i];
  const chunk::SquashConsts k{lx, lx * 1.44269504089f, c, eps};
  float* o = out + 8 * i;
  o[0] = chunk::squash_fast(A[i], c, k.log2_x, eps);
  o[1] = chunk::squash_grad_fast(A[i], k, &o[3], &o[4]);
  o[2] = dgps::maths::squash(A[i], c, lx, eps);
  o[5] = dgps::maths::squash_slope(A[i], o[2], c, lx, eps, &o[6]);
}

double rel(double got, double want) { return std::fabs(got - want) / std::max(std::fabs(want), 1e-30); }

}  // namespace

namespace dgps_gpu_test {

SquashAgreement squash_agreement() {
  const float eps = 1e-6f;
  std::vector<float> As = {-1.f, -1e-3f, -eps, 0.f, 1e-6f, 3e-6f, 1e-4f, 1e-2f,
                           0.1f, 0.5f,   1.f,  2.f, 10.f,  1e3f,  1e6f,  1e10f};
  for (int e = -50; e <= 50; ++e) As.push_back(std::exp(0.37f * float(e)));  // e^-18.5 .. e^18.5
  std::vector<float> A, center, log_x;
  for (const float x : {0.7f, 1.5f, 3.f})
    for (const float c : {-3.f, -1.f, -0.25f, 0.f, 0.5f, 2.f, 5.f})
      for (const float a : As) A.push_back(a), center.push_back(c), log_x.push_back(std::log(x));
  const int n = static_cast<int>(A.size());
  float *dA = nullptr, *dc = nullptr, *dl = nullptr, *dout = nullptr;
  cudaMalloc(&dA, sizeof(float) * n);
  cudaMalloc(&dc, sizeof(float) * n);
  cudaMalloc(&dl, sizeof(float) * n);
  cudaMalloc(&dout, sizeof(float) * 8 * n);
  cudaMemcpy(dA, A.data(), sizeof(float) * n, cudaMemcpyHostToDevice);
  cudaMemcpy(dc, center.data(), sizeof(float) * n, cudaMemcpyHostToDevice);
  cudaMemcpy(dl, log_x.data(), sizeof(float) * n, cudaMemcpyHostToDevice);
  squash_points<<<(n + 127) / 128, 128>>>(dA, dc, dl, eps, n, dout);
  std::vector<float> out(size_t(8) * n);
  cudaMemcpy(out.data(), dout, sizeof(float) * 8 * n, cudaMemcpyDeviceToHost);
  cudaFree(dA), cudaFree(dc), cudaFree(dl), cudaFree(dout);
  SquashAgreement r;
  r.points = n;
  for (int i = 0; i < n; ++i) {
    const float* o = &out[size_t(8) * i];
    r.m_fast = std::max(r.m_fast, rel(o[0], o[2]));
    r.m_grad = std::max(r.m_grad, rel(o[1], o[2]));
    r.zero_mismatch += (o[3] == 0.f) != (o[5] == 0.f) || (o[4] == 0.f) != (o[6] == 0.f);
    if (o[5] != 0.f) r.dmda = std::max(r.dmda, rel(o[3], o[5]));
    if (o[6] != 0.f) r.dmdc = std::max(r.dmdc, rel(o[4], o[6]));
  }
  return r;
}

}  // namespace dgps_gpu_test
