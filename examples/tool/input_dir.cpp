/// @brief Reading and cross-checking a directory of .npy inputs (see input_dir.hpp).
#include "input_dir.hpp"

#include <filesystem>

namespace dgps_tool {

namespace fs = std::filesystem;
using dgps::npy::DType;

namespace {

/// "[1, 64, 2, 16]"
std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// NumPy's name of a dtype ("float32").
const char* dtype_text(DType d) {
  static constexpr const char* n[] = {"float32", "float64", "int32", "int64"};
  return n[int(d)];
}

/// True for float32 and float64.
bool is_float(DType d) { return d == DType::f32 || d == DType::f64; }

/// How a model treats an input file.
enum class Use { required, optional, unused };

/// Whether model `spec` needs, accepts or rejects the tensor `name`.
Use use_of(const std::string& name, const dgps::ModelSpec& spec, bool backward) {
  using namespace dgps;
  const bool has_precond = spec.precond != precond::Kind::identity;
  if (name == "q" || name == "k" || name == "v") return Use::required;
  if (name == "g") return spec.decay != decay::Kind::none ? Use::required : Use::unused;
  if (name == "beta") return spec.gain == gain::Kind::scalar ? Use::required : Use::unused;
  if (name == "g_p" || name == "beta_p") return has_precond ? Use::required : Use::unused;
  if (name == "center")
    return spec.precond == precond::Kind::diagonal_atk || spec.precond == precond::Kind::diagonal_atq ? Use::required
                                                                                                      : Use::unused;
  if (name == "a0") return has_precond ? Use::optional : Use::unused;
  if (name == "do") return backward ? Use::required : Use::optional;
  if (name == "daT") return has_precond ? Use::optional : Use::unused;
  return Use::optional;  // h0, dhT, cu_seqlens
}

}  // namespace

const std::vector<std::string>& float_input_names() {
  static const std::vector<std::string> names = {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0"};
  return names;
}

std::string InputDir::path(const std::string& name) const { return (fs::path(dir) / (name + ".npy")).string(); }

std::vector<int64_t> expected_shape(const std::string& name, const dgps::ModelSpec& spec, const dgps::Shape& s,
                                    int64_t N) {
  using namespace dgps;
  const int64_t B = s.batch, T = s.time, H = s.heads, HV = s.v_heads, K = s.key_dim, V = s.value_dim;
  if (name == "q" || name == "k") return {B, T, H, K};
  if (name == "v" || name == "do") return {B, T, HV, V};
  if (name == "g") {
    if (spec.decay == decay::Kind::none) return {};
    return spec.decay == decay::Kind::diagonal ? std::vector<int64_t>{B, T, HV, K} : std::vector<int64_t>{B, T, HV};
  }
  if (name == "beta") return {B, T, HV};
  if (name == "g_p" || name == "beta_p") return {B, T, H};
  if (name == "center") return {H};
  if (name == "h0" || name == "dhT") return {N, HV, K, V};
  if (name == "a0" || name == "daT") {
    if (spec.precond == precond::Kind::identity) return {};
    if (spec.precond == precond::Kind::exact_atk || spec.precond == precond::Kind::exact_atq) return {N, H, K, K};
    return {N, H, K};
  }
  return {};
}

InputDir read_input_dir(const std::string& dir, const dgps::ModelSpec& spec, bool backward) {
  InputDir in;
  in.dir = dir;
  if (!fs::is_directory(dir)) throw InputError(dir + ": not a directory");
  std::vector<std::string> names = float_input_names();
  if (backward) names.insert(names.end(), {"do", "dhT", "daT"});

  // 1. Read every file that is present (npy::read names the file in its dgps::Error).
  dgps::npy::Array cu;
  bool has_cu = false;
  const std::string cu_path = in.path("cu_seqlens");
  if (fs::exists(cu_path)) {
    cu = dgps::npy::read(cu_path);
    has_cu = true;
  }
  std::string first;  // the file that fixes the float dtype
  for (const auto& n : names) {
    const std::string p = in.path(n);
    if (!fs::exists(p)) continue;
    dgps::npy::Array a = dgps::npy::read(p);
    if (!is_float(a.dtype)) throw InputError(p + ": dtype " + dtype_text(a.dtype) + ", expected float32 or float64");
    if (first.empty()) {
      first = n;
      in.dtype = a.dtype;
    } else if (a.dtype != in.dtype) {
      throw InputError(p + ": dtype " + dtype_text(a.dtype) + ", but " + first + ".npy is " + dtype_text(in.dtype) +
                       " (all float inputs must share one dtype)");
    }
    in.arrays.emplace(n, std::move(a));
  }
  if (has_cu && cu.dtype != DType::i32 && cu.dtype != DType::i64)
    throw InputError(cu_path + ": dtype " + dtype_text(cu.dtype) + ", expected int32 or int64");

  // 2. Presence: what the model needs, and nothing it would ignore.
  for (const auto& n : names) {
    const Use u = use_of(n, spec, backward);
    if (u == Use::required && !in.has(n))
      throw InputError(in.path(n) + ": missing; it is required by " + dgps::to_string(spec));
    if (u == Use::unused && in.has(n))
      throw InputError(in.path(n) + ": given, but " + dgps::to_string(spec) + " has no input '" + n + "'");
  }

  // 3. Sizes from q and v.
  const auto& qs = in.arrays.at("q").shape;
  const auto& vs = in.arrays.at("v").shape;
  if (qs.size() != 4) throw InputError(in.path("q") + ": shape " + shape_text(qs) + ", expected rank 4 [B, T, H, K]");
  if (qs[0] < 1 || qs[2] < 1 || qs[3] < 1)
    throw InputError(in.path("q") + ": shape " + shape_text(qs) + ", expected B, H, K >= 1");
  if (vs.size() != 4 || vs[0] != qs[0] || vs[1] != qs[1] || vs[2] < 1 || vs[3] < 1)
    throw InputError(in.path("v") + ": shape " + shape_text(vs) + " contradicts q.npy " + shape_text(qs) +
                     ", expected [" + std::to_string(qs[0]) + ", " + std::to_string(qs[1]) + ", HV, V]");
  if (vs[2] % qs[2] != 0)
    throw InputError(in.path("v") + ": " + std::to_string(vs[2]) + " value heads is not a multiple of the " +
                     std::to_string(qs[2]) + " key heads of q.npy");
  in.shape = dgps::Shape{qs[0], qs[1], qs[2], vs[2], qs[3], vs[3]};
  in.num_seqs = qs[0];

  // 4. cu_seqlens: [N+1], from 0 to T, non-decreasing, batch 1.
  if (has_cu) {
    in.cu_seqlens = cu.as<int64_t>();
    const auto& c = in.cu_seqlens;
    if (cu.shape.size() != 1 || c.size() < 2)
      throw InputError(cu_path + ": shape " + shape_text(cu.shape) + ", expected [N+1] with N >= 1");
    if (in.shape.batch != 1)
      throw InputError(cu_path + ": packed sequences need batch 1, but q.npy has batch " +
                       std::to_string(in.shape.batch));
    if (c.front() != 0) throw InputError(cu_path + ": must start at 0, starts at " + std::to_string(c.front()));
    for (size_t i = 1; i < c.size(); ++i)
      if (c[i] < c[i - 1])
        throw InputError(cu_path + ": decreases at index " + std::to_string(i) + " (" + std::to_string(c[i - 1]) +
                         " then " + std::to_string(c[i]) + ")");
    if (c.back() != in.shape.time)
      throw InputError(cu_path + ": ends at " + std::to_string(c.back()) +
                       ", but q.npy has T = " + std::to_string(in.shape.time) + " tokens");
    in.num_seqs = static_cast<int64_t>(c.size()) - 1;
  }

  // 5. Every other tensor against the shape q, v (and cu_seqlens) imply.
  for (const auto& [n, a] : in.arrays) {
    const auto want = expected_shape(n, spec, in.shape, in.num_seqs);
    if (a.shape != want)
      throw InputError(in.path(n) + ": shape " + shape_text(a.shape) + " contradicts q.npy " + shape_text(qs) +
                       " and v.npy " + shape_text(vs) + (has_cu ? " and cu_seqlens.npy" : "") + ", expected " +
                       shape_text(want));
  }
  return in;
}

}  // namespace dgps_tool
