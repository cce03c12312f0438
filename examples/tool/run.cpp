/// @brief `dgps run` and `dgps grad`: forward or backward on a directory of .npy files, through dgps::dynamic (or,
/// with `--backend cuda` in a build with CUDA, dgps::cuda on device copies: gpu.hpp).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <dgps/backend.hpp>
#include <dgps/dynamic.hpp>
#include <dgps/io/npy.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "input_dir.hpp"
#if defined(DGPS_HAS_CUDA)
#include "gpu.hpp"
#endif

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

/// Buffer of `numel` elements (at least one, so that an empty tensor still has a non-null pointer); dgps::Error
/// when the element count overflows.
template <class T>
std::vector<T> buffer(const std::string& name, const std::vector<int64_t>& shape) {
  const int64_t bytes = dgps::npy::byte_size(dgps::npy::DType::f64, shape, "output " + name);
  return std::vector<T>(static_cast<size_t>(bytes > 0 ? bytes / 8 : 1), T(0));
}

/// "." + name + tag, built by appending (GCC 12's -Wrestrict misfires on the chained operator+ form).
std::string hidden_name(const std::string& name, const std::string& tag) {
  std::string s(".");
  s.append(name).append(tag);
  return s;
}

/// Writes every result into `out_dir` all or nothing: each to a temporary file there, then renamed over its target
/// once all are written; on any failure the directory is left as it was (removed again if this call created it).
template <class T>
std::string write_all(const std::vector<Result<T>>& results, dgps::npy::DType dtype, const std::string& out_dir) {
  const fs::path dir(out_dir);
  bool created = false;
  if (!fs::exists(dir))
    created = fs::create_directories(dir);
  else if (!fs::is_directory(dir))
    throw InputError(out_dir + ": exists and is not a directory");
  const std::string tag = ".tmp" + std::to_string(::getpid());
  std::vector<fs::path> final_paths, temps, backups;
  size_t renamed = 0;
  try {
    for (const auto& r : results) {
      final_paths.push_back(dir / (r.name + ".npy"));
      const auto st = fs::symlink_status(final_paths.back());
      if (fs::exists(st) && !fs::is_regular_file(st) && !fs::is_symlink(st))
        throw InputError(final_paths.back().string() + ": exists and is not a regular file");
    }
    for (const auto& r : results) {
      temps.push_back(dir / hidden_name(r.name + ".npy", tag));
      dgps::npy::write(temps.back().string(), dgps::npy::Array::from<T>(dtype, r.shape, r.data.data()));
    }
    for (const auto& f : final_paths) {  // a link to each file replaced, to restore it if a later rename fails
      backups.emplace_back();
      if (fs::exists(fs::symlink_status(f))) {
        backups.back() = dir / hidden_name(f.filename().string() + ".bak", tag);
        std::error_code link_error;
        fs::create_hard_link(f, backups.back(), link_error);
        if (link_error) fs::copy_file(f, backups.back());
      }
    }
    for (; renamed < final_paths.size(); ++renamed) fs::rename(temps[renamed], final_paths[renamed]);
  } catch (...) {
    std::error_code ec;
    for (size_t i = 0; i < final_paths.size(); ++i) {
      if (i < backups.size() && !backups[i].empty())
        fs::rename(backups[i], final_paths[i], ec);
      else if (i < renamed)
        fs::remove(final_paths[i], ec);
    }
    for (const auto& t : temps) fs::remove(t, ec);
    if (created) fs::remove_all(dir, ec);
    throw;
  }
  std::error_code ec;
  for (const auto& b : backups)
    if (!b.empty()) fs::remove(b, ec);
  std::string written;
  for (const auto& r : results) written += " " + r.name + ".npy";
  return written;
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
    results.push_back({name, shape, buffer<T>(name, shape)});
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

#if defined(DGPS_HAS_CUDA)
/// compute() on the GPU: float32 arithmetic on device copies of the inputs, results in the inputs' type T.
template <class T>
std::pair<dgps::RunInfo, std::vector<Result<T>>> compute_gpu(const InputDir& in, const dgps::ModelSpec& spec,
                                                             const dgps::Options& opt, bool backward) {
  std::vector<gpu::HostTensor> host;
  const dgps::RunInfo info = gpu::compute(in, spec, opt, backward, host);
  std::vector<Result<T>> results;
  for (auto& h : host) results.push_back({h.name, h.shape, std::vector<T>(h.data.begin(), h.data.end())});
  return {info, std::move(results)};
}
#endif

/// compute(), then writes the results (only now is anything written) and a one-line summary.
template <class T>
int run_typed(const InputDir& in, const dgps::ModelSpec& spec, const dgps::Options& opt, const std::string& out_dir,
              bool backward) {
#if defined(DGPS_HAS_CUDA)
  auto [info, results] = dgps::detail::select_backend(opt.backend) == dgps::Backend::cuda
                             ? compute_gpu<T>(in, spec, opt, backward)
                             : compute<T>(in, spec, opt, backward);
#else
  auto [info, results] = compute<T>(in, spec, opt, backward);
#endif
  const std::string written = write_all(results, in.dtype, out_dir);
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
