/// @brief Instantiates the chunkwise forward and backward kernels for f32 inputs (one file per input type so builds parallelise).
#include "launch/chunk_launch.cuh"
#include "launch/chunk_backward_launch.cuh"

namespace dgps::cuda::kernels {
template bool chunk_wg_pass<float>(const ChunkArgs&);
template cudaError_t launch_chunkwise<float>(const ChunkArgs&, Plan&, cudaStream_t);
template cudaError_t launch_chunk_backward<float>(const ChunkArgs&, const BwdArgs&, cudaStream_t);
}  // namespace dgps::cuda::kernels
