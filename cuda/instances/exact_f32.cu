/// @brief Instantiates the exact preconditioners' kernels for f32 inputs (one file per input type so builds parallelise).
#include "kernels/exact.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_exact<float>(const ExactArgs&, const Plan&, cudaStream_t);
}  // namespace dgps::cuda::kernels
