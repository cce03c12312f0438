/// @brief Instantiates the chunkwise forward and backward kernels for f16 inputs (one file per input type so builds parallelise).
#include "launch/chunk_launch.cuh"
#include "launch/chunk_backward_launch.cuh"

namespace dgps::cuda::kernels {
template bool chunk_wg_pass<__half>(const ChunkArgs&);
template cudaError_t launch_chunkwise<__half>(const ChunkArgs&, Plan&, cudaStream_t);
template cudaError_t launch_chunk_backward<__half>(const ChunkArgs&, const BwdArgs&, cudaStream_t);
}  // namespace dgps::cuda::kernels
