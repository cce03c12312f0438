/// @brief Instantiates the exact preconditioners' kernels for f16 inputs (one file per input type so builds parallelise).
#include "kernels/exact.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_exact<__half>(const ExactArgs&, const Plan&, cudaStream_t);
}  // namespace dgps::cuda::kernels
