/// @brief `dgps run` and `dgps grad`: forward or backward on a directory of .npy files, through dgps::dynamic.
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <dgps/dynamic.hpp>
#include <dgps/io/npy.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "input_dir.hpp"

namespace dgps_tool {

namespace fs = std::filesystem;

std::vector<OptionSpec> run_options() {
  return join({{{"in", "DIR",
                 "input directory: q k v [g beta g_p beta_p center h0 a0 cu_seqlens].npy "
                 "(grad: also do [dhT daT].npy)"},
                {"out", "DIR", "output directory (created; run: o hT [aT].npy, grad: d<input>.npy)"}},
               model_options(),
               backend_options(),
               math_options()});
}

namespace {

/// One result tensor, written only after the whole computation succeeded.
template <class T>
struct Result {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<T> data;
};

/// Buffer of `numel` elements (at least one, so that an empty tensor still has a non-null pointer).
template <class T>
std::vector<T> buffer(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return std::vector<T>(static_cast<size_t>(n > 0 ? n : 1), T(0));
}

/// Runs forward (or backward) in element type T; returns what ran and every result tensor.
template <class T>
std::pair<dgps::RunInfo, std::vector<Result<T>>> compute(const InputDir& in, const dgps::ModelSpec& spec,
                                                         const dgps::Options& opt, bool backward) {
  std::map<std::string, std::vector<T>> data;
  std::map<std::string, dgps::TensorView<const T>> views;
  for (const auto& [name, a] : in.arrays) {
    auto& d = data[name];
    d = a.template as<T>();
    if (d.empty()) d.resize(1);
    views[name] = view_of<const T>(d.data(), a.shape);
  }
  auto get = [&](const std::string& n) { return views.count(n) ? views.at(n) : dgps::TensorView<const T>(); };
  dgps::Inputs<T> inputs = dgps::inputs<T>(in.shape, get("q"), get("k"), get("v"));
  inputs.decay(get("g")).gain(get("beta")).precond(get("g_p"), get("beta_p"), get("center"));
  inputs.initial_state(get("h0"), get("a0"));
  const int64_t num_cu = static_cast<int64_t>(in.cu_seqlens.size());
  if (num_cu) inputs.varlen(dgps::TensorView<const int64_t>(in.cu_seqlens.data(), {num_cu}));

  std::vector<Result<T>> results;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) -> dgps::TensorView<T> {
    results.push_back({name, shape, buffer<T>(shape)});
    return view_of(results.back().data.data(), results.back().shape);
  };
  const bool has_precond = spec.precond != dgps::precond::Kind::identity;
  const auto& s = in.shape;
  if (!backward) {
    results.reserve(3);
    dgps::Outputs<T> out = dgps::outputs<T>(add("o", {s.batch, s.time, s.v_heads, s.value_dim}));
    out.hT = add("hT", expected_shape("h0", spec, s, in.num_seqs));
    if (has_precond) out.aT = add("aT", expected_shape("a0", spec, s, in.num_seqs));
    const dgps::RunInfo info = dgps::dynamic::forward(spec, inputs, out, opt);
    return {info, std::move(results)};
  }
  results.reserve(float_input_names().size());
  dgps::Grads<T> g;
  std::map<std::string, dgps::TensorView<T>*> slot = {
      {"q", &g.dq},     {"k", &g.dk},           {"v", &g.dv},           {"g", &g.dg},   {"beta", &g.dbeta},
      {"g_p", &g.dg_p}, {"beta_p", &g.dbeta_p}, {"center", &g.dcenter}, {"h0", &g.dh0}, {"a0", &g.da0}};
  for (const auto& n : float_input_names())
    if (in.has(n)) *slot.at(n) = add("d" + n, in.arrays.at(n).shape);
  const dgps::GradsIn<T> gin = {get("do"), get("dhT"), get("daT")};
  const dgps::RunInfo info = dgps::dynamic::backward(spec, inputs, gin, g, opt);
  return {info, std::move(results)};
}

/// compute(), then writes the results (only now is anything written) and a one-line summary.
template <class T>
int run_typed(const InputDir& in, const dgps::ModelSpec& spec, const dgps::Options& opt, const std::string& out_dir,
              bool backward) {
  auto [info, results] = compute<T>(in, spec, opt, backward);
  fs::create_directories(out_dir);
  std::string written;
  for (const auto& r : results) {
    const std::string path = (fs::path(out_dir) / (r.name + ".npy")).string();
    dgps::npy::write(path, dgps::npy::Array::from<T>(in.dtype, r.shape, r.data.data()));
    written += " " + r.name + ".npy";
  }
  std::printf("%s %s with %s: wrote%s to %s\n", backward ? "grad" : "run", model_label(spec).c_str(), info.impl.c_str(),
              written.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace

int cmd_run(const Args& args, bool backward) {
  const std::string in_dir = args.required("in");
  const std::string out_dir = args.required("out");
  const dgps::ModelSpec spec = model_from(args);
  const dgps::Options opt = options_from(args);
  const InputDir in = read_input_dir(in_dir, spec, backward);
  if (in.dtype == dgps::npy::DType::f32) return run_typed<float>(in, spec, opt, out_dir, backward);
  return run_typed<double>(in, spec, opt, out_dir, backward);
}

}  // namespace dgps_tool
