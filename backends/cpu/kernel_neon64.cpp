/// @brief The CPU leaf kernels compiled for aarch64's Advanced SIMD (NEON64, part of the baseline: no flags).
#define DGPS_ISA_NS neon64
#include "kernel_impl.hpp"
