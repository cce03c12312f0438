/// @brief Instantiates the backward kernels for f16 inputs (one file per input type so builds parallelise).
#include "launch/backward_launch.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_backward<__half>(const BwdArgs&, cudaStream_t);
}  // namespace dgps::cuda::kernels
