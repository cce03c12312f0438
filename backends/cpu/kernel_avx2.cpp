/// @brief The CPU leaf kernels compiled for the avx2 instruction set (flags set in backends/cpu/CMakeLists.txt).
#define DGPS_ISA_NS avx2
#include "kernel_impl.hpp"
