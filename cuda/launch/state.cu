/// @brief Small state kernels of the CUDA backend (gathering pooled preconditioner states before a decode).
#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels {

namespace {
__global__ void gather_precond_state(const float* a, int64_t s0, int64_t s1, const int64_t* slots, int H, int K,
                                     float* dst) {
  grid_dependency_sync();
  const int n = blockIdx.y, h = blockIdx.x;
  const int64_t src = slots ? slots[n] : n;
  for (int c = threadIdx.x; c < K; c += blockDim.x) dst[(int64_t(n) * H + h) * K + c] = a[src * s0 + h * s1 + c];
}
}  // namespace

cudaError_t launch_gather_precond_state(const float* a, const int64_t* sa, const int64_t* slots, int N, int H, int K,
                                        float* dst, cudaStream_t stream, bool dependent) {
  return launch_ex(gather_precond_state, dim3(H, N), dim3(128), 0, stream, dependent, dim3(1, 1, 1), a, sa[0], sa[1],
                   slots, H, K, dst);
}

}  // namespace dgps::cuda::kernels
