/// @brief The dgps tool's GPU path (built when the tool links dgps::cuda): `run`, `grad`, `bench` and `info`
/// with `--backend cuda`.
///
/// The tool's inputs live on the host (.npy files, synthetic arrays); these functions copy them to the
/// device as float32 (the CUDA kernels' widest type: float64 files are converted on the way, and results
/// come back in the files' dtype), call dgps::cuda on the default stream and copy the results back. The
/// CPU path (dgps::dynamic) and this one share the input checks of input_dir.hpp and SPEC's option rules.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <dgps/recurrence.hpp>
#include <dgps/types.hpp>

#include "input_dir.hpp"

namespace dgps_tool::gpu {

/// One line per visible CUDA device: "0: NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)". Empty when the
/// runtime finds none.
std::vector<std::string> devices();

/// A result tensor copied back from the device.
struct HostTensor {
  std::string name;            ///< "o", "hT", "aT" (run) or "d<input>" (grad)
  std::vector<int64_t> shape;  ///< as the CPU path writes it
  std::vector<float> data;
};

/// `dgps run` (backward = false: o, hT, aT) or `dgps grad` (the gradient of every input present, from
/// the cotangents do, dhT, daT) for the validated inputs `in` on the GPU, in float32. Throws
/// dgps::Error for a model or option the CUDA backend does not run (nothing is written then).
dgps::RunInfo compute(const InputDir& in, const dgps::ModelSpec& spec, const dgps::Options& opt, bool backward,
                      std::vector<HostTensor>& results);

/// The host arrays of a synthetic `bench` problem (float32; a tensor the model does not use is empty).
struct BenchInputs {
  const std::vector<float>*q, *k, *v, *g, *beta, *g_p, *beta_p, *center, *d_o;
};

/// A `bench --backend cuda` problem: the synthetic inputs copied to the device once, outputs, gradients
/// and states allocated there, and a reused workspace.
class BenchProblem {
 public:
  /// mode: 0 forward, 1 backward, 2 decode (T steps of one token for each of the B sequences, from
  /// zero states; P_0 = I / lambda for the exact preconditioners).
  BenchProblem(const dgps::ModelSpec& spec, const dgps::Shape& s, const dgps::Options& opt, int mode,
               const BenchInputs& x);
  ~BenchProblem();
  BenchProblem(const BenchProblem&) = delete;
  BenchProblem& operator=(const BenchProblem&) = delete;
  /// One timed unit: the call (decode: all T steps), then a device synchronisation. Returns what ran.
  dgps::RunInfo run();

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace dgps_tool::gpu
