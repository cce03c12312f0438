/// @brief Options shared by the dgps tool's commands: model choice, backend, SPEC §1 options.
#pragma once

#include <string>
#include <vector>

#include <dgps/recurrence.hpp>
#include <dgps/tensor.hpp>
#include <dgps/types.hpp>

#include "args.hpp"

namespace dgps_tool {

/// `--model NAME` or the four axes `--decay --gain --precond --solve`.
std::vector<OptionSpec> model_options();
/// `--backend --algorithm --threads`.
std::vector<OptionSpec> backend_options();
/// `--no-l2norm --scale --x --eps --lambda` (SPEC §1 options).
std::vector<OptionSpec> math_options();
/// Concatenation of option lists.
std::vector<OptionSpec> join(std::vector<std::vector<OptionSpec>> lists);

/// The model the options name. Throws UsageError unless exactly one of `--model` or all four axes is
/// given, dgps::Error for an unknown name.
dgps::ModelSpec model_from(const Args& args);
/// dgps::Options from the backend and math options (defaults as in SPEC §1).
dgps::Options options_from(const Args& args);
/// The short name of a named model ("pgdn"), or "custom".
std::string model_label(const dgps::ModelSpec& spec);

/// A contiguous C-order view of `p` with the given sizes (rank <= 4).
template <class T>
dgps::TensorView<T> view_of(T* p, const std::vector<int64_t>& shape) {
  return dgps::view<T>(p, shape);
}

}  // namespace dgps_tool
