/// @brief `dgps info`: version, backends, CPU ISA, threads and CUDA devices of this build and machine.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <dgps/backend.hpp>
#include <dgps/cpu/kernels.hpp>
#include <dgps/dynamic.hpp>
#include <dgps/version.hpp>

#include "commands.hpp"
#if defined(DGPS_HAS_CUDA)
#include "gpu.hpp"
#endif

namespace dgps_tool {

namespace {

/// The implementation the CPU backend picks for a PGDN prefill (T = 128, K = V = 64, float): what `run`
/// and `bench` use for problems of that kind.
std::string cpu_impl() {
  const int64_t T = 128, K = 64, V = 64;
  const dgps::Shape shape{1, T, 1, 1, K, V};
  std::vector<float> q(T * K, 0.1f), k(T * K, 0.1f), v(T * V, 1.0f), o(T * V), gate(T, -0.1f), beta(T, 0.5f),
      center(1, -0.2f);
  auto in = dgps::inputs<float>(shape, q.data(), k.data(), v.data());
  in.decay(gate.data()).gain(beta.data()).precond(gate.data(), beta.data(), center.data());
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  return dgps::dynamic::forward(dgps::model_by_name("pgdn"), in, dgps::outputs<float>(o.data()), opt).impl;
}

}  // namespace

int cmd_info(const Args&) {
  std::printf("dgps %s\n", dgps::version_string);
  std::string backends;
  for (dgps::Backend b : dgps::available_backends())
    backends += std::string(backends.empty() ? "" : " ") + to_string(b);
  std::printf("backends: %s\n", backends.c_str());
  std::printf("cpu isa: %s\n", dgps::cpu::kernels::isa_name());  // (the selection, DGPS_MAX_CPU_ISA applied)
  std::printf("cpu implementation (pgdn, f32): %s\n", cpu_impl().c_str());
#if defined(DGPS_HAS_TBB)
  const char* runtime = "oneTBB";
#else
  const char* runtime = "std::thread";
#endif
  std::printf("threads: %u (%s)\n", std::thread::hardware_concurrency(), runtime);
#if defined(DGPS_HAS_CUDA)
  std::printf("cuda: %s\n", dgps::cuda_available() ? "available" : "backend built, but no usable GPU or driver");
  for (const std::string& d : gpu::devices()) std::printf("gpu %s\n", d.c_str());
#else
  std::printf("cuda: CUDA backend not built\n");
#endif
  return 0;
}

}  // namespace dgps_tool
