/// @brief Instantiates the backward kernels for f32 inputs (one file per input type so builds parallelise).
#include "launch/backward_launch.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_backward<float>(const BwdArgs&, cudaStream_t);
}  // namespace dgps::cuda::kernels
