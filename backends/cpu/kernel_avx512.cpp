/// @brief The CPU leaf kernels compiled for the avx512 instruction set (flags set in backends/cpu/CMakeLists.txt).
#define DGPS_ISA_NS avx512
#include "kernel_impl.hpp"
