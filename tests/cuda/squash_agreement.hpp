/// @brief The chunkwise kernels' fast squash against dgps::maths over a grid (test_squash.cu; no CUDA header needed).
#pragma once

namespace dgps_gpu_test {

/// Largest disagreements over the grid of squash_agreement(): relative errors of M (squash_fast and
/// squash_grad_fast against dgps::maths::squash), of dM/dA and dM/dcenter (squash_grad_fast against
/// dgps::maths::squash_slope), and how many grid points had a slope of 0 in one and not in the other.
struct SquashAgreement {
  double m_fast = 0, m_grad = 0, dmda = 0, dmdc = 0;
  int zero_mismatch = 0;
  int points = 0;
};

/// Evaluates the squash on the GPU over a grid of statistics A (negative, zero, -eps, 1e-6 .. 1e10),
/// centers (-3 .. 5) and bounds x (0.7, 1.5, 3), eps = 1e-6, by the chunkwise kernels' approximate
/// functions and by dgps::maths in float32 (logf, expf), and returns the largest disagreements.
SquashAgreement squash_agreement();

}  // namespace dgps_gpu_test
