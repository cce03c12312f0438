/// @brief Instantiates the chunkwise forward kernels for f32 inputs (one file per input type so builds parallelise).
#include "chunk_impl.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_chunkwise<float>(const ChunkArgs&, cudaStream_t, const char**);
}  // namespace dgps::cuda::kernels
