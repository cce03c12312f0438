/// @brief Reads a directory of SPEC §1 .npy inputs, checks them against each other and the model, names bad files.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <dgps/io/npy.hpp>
#include <dgps/recurrence.hpp>
#include <dgps/types.hpp>

namespace dgps_tool {

/// A problem with one input file (malformed, missing, or inconsistent with the others). The message
/// starts with the file's path; the tool prints it on one line and exits with status 2.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The validated contents of an input directory.
struct InputDir {
  std::string dir;
  dgps::npy::DType dtype = dgps::npy::DType::f64;  ///< the one float dtype of every float input
  dgps::Shape shape;                               ///< inferred from q, v (B, T, H, K, HV, V)
  int64_t num_seqs = 0;                            ///< N: B, or len(cu_seqlens) - 1
  std::vector<int64_t> cu_seqlens;                 ///< empty without a cu_seqlens file
  std::map<std::string, dgps::npy::Array> arrays;  ///< every float input present, by SPEC name

  /// True when the file `<name>.npy` was present.
  bool has(const std::string& name) const { return arrays.count(name) > 0; }
  /// `<dir>/<name>.npy`
  std::string path(const std::string& name) const;
};

/// The float inputs of SPEC §1, in order: q k v g beta g_p beta_p center h0 a0.
const std::vector<std::string>& float_input_names();

/// Reads and validates `<dir>/<name>.npy` for every SPEC §1 input of `spec` (and, with `backward`,
/// the cotangents do, dhT, daT). Other files in the directory are ignored. Throws InputError naming
/// the file for: a malformed .npy (bad magic, truncated, unsupported dtype, Fortran order), a float
/// dtype other than the first input's, an integer dtype for a float input or a float cu_seqlens, a
/// missing required input, an input the model does not use, or a shape that contradicts q and v.
InputDir read_input_dir(const std::string& dir, const dgps::ModelSpec& spec, bool backward);

/// The expected shape of input or cotangent `name` (q ... a0, do, dhT, daT) for `spec` and the
/// inferred sizes; empty when the model has no such tensor.
std::vector<int64_t> expected_shape(const std::string& name, const dgps::ModelSpec& spec, const dgps::Shape& s,
                                    int64_t num_seqs);

}  // namespace dgps_tool
