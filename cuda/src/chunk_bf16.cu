/// @brief Instantiates the chunkwise forward kernels for bf16 inputs (one file per input type so builds parallelise).
#include "chunk_impl.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_chunkwise<__nv_bfloat16>(const ChunkArgs&, cudaStream_t, const char**);
}  // namespace dgps::cuda::kernels
