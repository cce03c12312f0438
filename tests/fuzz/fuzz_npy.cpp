/// @brief libFuzzer target: dgps::npy::read on arbitrary bytes must return an array or throw dgps::Error.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include <dgps/error.hpp>
#include <dgps/io/npy.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The reader takes a path (it checks the file type first), so the bytes go through a per-process file.
  static const std::string path = "/tmp/dgps_fuzz_npy_" + std::to_string(::getpid()) + ".npy";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    const dgps::npy::Array a = dgps::npy::read(path);
    const auto values = a.as<double>();  // a valid array converts; its size matches the shape
    if (static_cast<int64_t>(values.size()) != a.numel()) __builtin_trap();
  } catch (const dgps::Error&) {
  }
  return 0;
}
