/// @brief Consumer of the installed dgps::cuda: links the static CUDA backend and runs with or without a GPU.
#include <dgps/cuda.hpp>

#include <cstdio>

int main() {
  std::printf("dgps::cuda available: %s\n", dgps::cuda::available() ? "yes" : "no (no GPU or driver)");
  return 0;
}
