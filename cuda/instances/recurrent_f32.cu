/// @brief Instantiates the warp, block-row and decode kernels for f32 inputs (one file per input type so builds parallelise).
#include "kernels/recurrent_rowblock.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_decode<float>(const RecArgs&, const Plan&, cudaStream_t);
template cudaError_t launch_forward<float>(const RecArgs&, const Plan&, cudaStream_t);
}  // namespace dgps::cuda::kernels
