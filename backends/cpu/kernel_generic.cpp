/// @brief The CPU leaf kernels compiled for the generic instruction set (flags set in backends/cpu/CMakeLists.txt).
#define DGPS_ISA_NS generic
#include "kernel_impl.hpp"
