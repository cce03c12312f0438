/// @brief Instantiates the warp, block-row and decode kernels for f16 inputs (one file per input type so builds parallelise).
#include "rowblock_impl.cuh"

namespace dgps::cuda::kernels {
template cudaError_t launch_recurrent<__half>(const RecArgs&, cudaStream_t, const char**);
template cudaError_t launch_decode<__half>(const RecArgs&, cudaStream_t, const char**, bool);
template cudaError_t launch_forward<__half>(const RecArgs&, cudaStream_t, const char**);
}  // namespace dgps::cuda::kernels
