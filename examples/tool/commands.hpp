/// @brief The dgps tool's commands (info, run, grad, bench): their options and entry points.
#pragma once

#include <vector>

#include "args.hpp"

namespace dgps_tool {

/// `dgps info`: version, backends, CPU ISA, threads, CUDA devices. Returns the exit status.
int cmd_info(const Args& args);

/// Options of `dgps run` and `dgps grad` (the same list).
std::vector<OptionSpec> run_options();
/// `dgps run` / `dgps grad`: .npy inputs from --in, outputs or gradients to --out. Returns the exit status.
int cmd_run(const Args& args, bool backward);

/// Options of `dgps bench`.
std::vector<OptionSpec> bench_options();
/// `dgps bench`: synthetic inputs, timed forward/backward/decode. Returns the exit status.
int cmd_bench(const Args& args);

}  // namespace dgps_tool
