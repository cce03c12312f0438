/// @brief Backend dispatch: Backend {automatic, reference, cpu, cuda}, available_backends(), DGPS_BACKEND.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "dgps/cpu/backend.hpp"
#include "dgps/error.hpp"
#include "dgps/model_spec.hpp"
#include "dgps/types.hpp"
#if defined(DGPS_HAS_CUDA)
#include "dgps/cuda.hpp"
#endif

/// The functions whose bodies depend on whether the including target links dgps::cuda live in an
/// inline namespace named after that choice, so that a program mixing both kinds of translation
/// units (an application linked with dgps::cuda and the precompiled dgps::dynamic, say) gets two
/// distinct sets of symbols instead of an ODR violation. Callers never name it.
#if defined(DGPS_HAS_CUDA)
#define DGPS_CUDA_ABI with_cuda
#else
#define DGPS_CUDA_ABI without_cuda
#endif

namespace dgps {

/// Parses "automatic", "reference", "cpu" or "cuda"; throws dgps::Error otherwise.
inline Backend backend_from_string(std::string_view s) {
  for (Backend b : {Backend::automatic, Backend::reference, Backend::cpu, Backend::cuda})
    if (s == to_string(b)) return b;
  throw Error("unknown backend '" + std::string(s) + "' (expected automatic, reference, cpu or cuda)");
}

/// Parses "automatic", "recurrent" or "chunkwise"; throws dgps::Error otherwise.
inline Algorithm algorithm_from_string(std::string_view s) {
  for (Algorithm a : {Algorithm::automatic, Algorithm::recurrent, Algorithm::chunkwise})
    if (s == to_string(a)) return a;
  throw Error("unknown algorithm '" + std::string(s) + "' (expected automatic, recurrent or chunkwise)");
}

inline namespace DGPS_CUDA_ABI {

/// True when this build has the CUDA backend (the program links dgps::cuda) and a usable GPU is present.
inline bool cuda_available() {
#if defined(DGPS_HAS_CUDA)
  return cuda::available();
#else
  return false;
#endif
}

/// The backends usable in this process, fastest first (the reference backend is always last).
inline std::vector<Backend> available_backends() {
  std::vector<Backend> out;
  if (cuda_available()) out.push_back(Backend::cuda);
  out.push_back(Backend::cpu);
  out.push_back(Backend::reference);
  return out;
}

}  // inline namespace DGPS_CUDA_ABI

namespace detail {
inline namespace DGPS_CUDA_ABI {

/// Resolves `automatic` (honouring DGPS_BACKEND) and checks that the backend is usable.
inline Backend select_backend(Backend requested) {
  Backend b = requested;
  if (b == Backend::automatic) {
    const char* env = std::getenv("DGPS_BACKEND");
    b = (env && *env) ? backend_from_string(env) : Backend::cpu;
    if (b == Backend::automatic) b = Backend::cpu;
  }
  if (b == Backend::cuda && !cuda_available())
    throw Error("backend 'cuda' is not available: this build of dgps has no CUDA backend (configure with "
                "-DDGPS_WITH_CUDA=ON and link dgps::cuda) or no GPU is present");
  return b;
}

}  // inline namespace DGPS_CUDA_ABI

/// Prints what ran when DGPS_VERBOSE=1.
inline void report(const char* op, const RunInfo& info) {
  const char* env = std::getenv("DGPS_VERBOSE");
  if (env && std::string_view(env) == "1")
    std::fprintf(stderr, "dgps: %s ran %s (backend %s, algorithm %s)\n", op, info.impl.c_str(), to_string(info.backend),
                 to_string(info.algorithm));
}

}  // namespace detail

inline namespace DGPS_CUDA_ABI {

/// True when `backend` can run model R with `algorithm` in this build (before any call).
template <class R>
bool supports(Backend backend, Algorithm algorithm = Algorithm::automatic) {
  switch (backend) {
    case Backend::reference: return algorithm != Algorithm::chunkwise;
    case Backend::cuda:
#if defined(DGPS_HAS_CUDA)
      return cuda::supports(spec_of<R>(), algorithm);
#else
      return false;
#endif
    default: return cpu::supports<R>(algorithm);
  }
}

}  // inline namespace DGPS_CUDA_ABI
}  // namespace dgps
