/// @brief doctest main for the dgps test suite; first prints the CPU kernels' instruction set this process selects.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "dgps/cpu/kernels.hpp"

int main(int argc, char** argv) {
  std::printf("dgps_tests: CPU kernels %s (DGPS_MAX_CPU_ISA caps it)\n", dgps::cpu::kernels::isa_name());
  std::fflush(stdout);
  doctest::Context context(argc, argv);
  return context.run();
}
