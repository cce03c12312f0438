/// @brief The dgps tool's GPU path: host .npy / synthetic arrays copied to the device, dgps::cuda called, results
/// copied back (see gpu.hpp).
#include "gpu.hpp"

#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <dgps/cuda.hpp>
#include <dgps/detail/check.hpp>
#include <dgps/error.hpp>

#include "common.hpp"

namespace dgps_tool::gpu {

namespace {

/// Throws dgps::Error("CUDA: <what>: <runtime message>") unless `e` is cudaSuccess.
void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw dgps::Error("CUDA: " + what + ": " + cudaGetErrorString(e));
}

/// Device memory owned by the tool (at least 16 bytes, so that an empty tensor still has a pointer).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    check(cudaMalloc(&p_, bytes < 16 ? 16 : bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes");
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// A device copy of `host`.
template <class U>
DeviceBuffer upload(const std::vector<U>& host) {
  DeviceBuffer b(host.size() * sizeof(U));
  if (!host.empty())
    check(cudaMemcpy(b.get(), host.data(), b.bytes(), cudaMemcpyHostToDevice), "copy to the device");
  return b;
}

/// The first `n` floats of `b`.
std::vector<float> download(const DeviceBuffer& b, size_t n) {
  std::vector<float> h(n);
  if (n) check(cudaMemcpy(h.data(), b.get(), n * sizeof(float), cudaMemcpyDeviceToHost), "copy to the host");
  return h;
}

/// Elements of a shape.
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

/// The dgps::cuda tensor of a contiguous device array of `shape`.
dgps::cuda::Tensor tensor(const DeviceBuffer& b, const std::vector<int64_t>& shape) {
  return dgps::cuda::detail::tensor_of(view_of<const float>(static_cast<const float*>(b.get()), shape));
}

/// True for the exact (inverse Gram) preconditioners.
bool exact(const dgps::ModelSpec& spec) {
  return spec.precond == dgps::precond::Kind::exact_atk || spec.precond == dgps::precond::Kind::exact_atq;
}

/// Params of float32 device tensors of `s` with the options `opt` (checked by SPEC's rules first).
dgps::cuda::Params params_of(const dgps::ModelSpec& spec, const dgps::Shape& s, int64_t num_seqs,
                             const dgps::Options& opt) {
  double scale = 0;
  dgps::detail::check_options(opt, s.key_dim, scale);
  dgps::cuda::Params c;
  c.spec = spec;
  c.dtype = dgps::cuda::DType::f32;
  c.gate_dtype = dgps::cuda::DType::f32;
  c.B = s.batch, c.T = s.time, c.H = s.heads, c.HV = s.v_heads, c.K = s.key_dim, c.V = s.value_dim;
  c.N = num_seqs;
  c.scale = static_cast<float>(scale);
  c.x = static_cast<float>(opt.x);
  c.eps = static_cast<float>(opt.eps);
  c.l2norm = opt.l2norm_qk;
  c.lambda = static_cast<float>(opt.lambda);
  c.algorithm = opt.algorithm;
  return c;
}

/// The RunInfo of a dgps::cuda call that returned the kernel name `impl`.
dgps::RunInfo info_of(const char* impl) {
  const std::string name = impl ? impl : "";
  const bool chunkwise = name.find("/chunkwise") != std::string::npos;
  return dgps::RunInfo{dgps::Backend::cuda, chunkwise ? dgps::Algorithm::chunkwise : dgps::Algorithm::recurrent, name};
}

/// Waits for the default stream and reports an asynchronous kernel failure.
void synchronise(const char* what) { check(cudaDeviceSynchronize(), what); }

}  // namespace

std::vector<std::string> devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" status
    return {};
  }
  std::vector<std::string> out;
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    char line[320];
    std::snprintf(line, sizeof line, "%d: %s (sm_%d%d, %d SMs, %.1f GiB)", d, p.name, p.major, p.minor,
                  p.multiProcessorCount, double(p.totalGlobalMem) / double(1ull << 30));
    out.emplace_back(line);
  }
  return out;
}

dgps::RunInfo compute(const InputDir& in, const dgps::ModelSpec& spec, const dgps::Options& opt, bool backward,
                      std::vector<HostTensor>& results) {
  if (backward ? !dgps::cuda::supports_backward(spec) : !dgps::cuda::supports(spec, opt.algorithm))
    throw dgps::Error(std::string("backend 'cuda' has no ") + (backward ? "backward" : to_string(opt.algorithm)) +
                      (backward ? "" : " forward") + " for " + dgps::to_string(spec));
  dgps::cuda::Params c = params_of(spec, in.shape, in.num_seqs, opt);
  std::map<std::string, DeviceBuffer> dev;
  auto input = [&](const std::string& name) {
    if (!in.has(name)) return dgps::cuda::Tensor();
    const auto& a = in.arrays.at(name);
    dev[name] = upload(a.as<float>());
    return tensor(dev.at(name), a.shape);
  };
  c.q = input("q"), c.k = input("k"), c.v = input("v"), c.g = input("g"), c.beta = input("beta");
  c.g_p = input("g_p"), c.beta_p = input("beta_p"), c.center = input("center");
  c.h0 = input("h0"), c.a0 = input("a0");
  DeviceBuffer cu;
  if (!in.cu_seqlens.empty()) {
    cu = upload(in.cu_seqlens);
    c.cu_seqlens = static_cast<const int64_t*>(cu.get());
  }

  std::vector<std::pair<std::string, std::vector<int64_t>>> out_shapes;
  std::vector<DeviceBuffer> out_bufs;
  auto output = [&](const std::string& name, std::vector<int64_t> shape) {
    out_bufs.emplace_back(static_cast<size_t>(numel(shape)) * sizeof(float));
    out_shapes.emplace_back(name, std::move(shape));
    return tensor(out_bufs.back(), out_shapes.back().second);
  };
  out_bufs.reserve(12);
  dgps::cuda::Workspace ws;
  const auto& s = in.shape;
  const char* impl = nullptr;
  if (!backward) {
    c.o = output("o", {s.batch, s.time, s.v_heads, s.value_dim});
    c.hT = output("hT", expected_shape("h0", spec, s, in.num_seqs));
    if (spec.precond != dgps::precond::Kind::identity) c.aT = output("aT", expected_shape("a0", spec, s, in.num_seqs));
    impl = dgps::cuda::forward(c, ws, nullptr);
  } else {
    dgps::cuda::GradParams g;
    g.d_o = input("do"), g.dhT = input("dhT"), g.daT = input("daT");
    std::map<std::string, dgps::cuda::Tensor*> slot = {
        {"q", &g.dq},     {"k", &g.dk},           {"v", &g.dv},           {"g", &g.dg},   {"beta", &g.dbeta},
        {"g_p", &g.dg_p}, {"beta_p", &g.dbeta_p}, {"center", &g.dcenter}, {"h0", &g.dh0}, {"a0", &g.da0}};
    for (const auto& n : float_input_names())
      if (in.has(n)) *slot.at(n) = output("d" + n, in.arrays.at(n).shape);
    impl = dgps::cuda::backward(c, g, ws, nullptr);
  }
  synchronise(backward ? "backward" : "forward");
  results.clear();
  for (size_t i = 0; i < out_bufs.size(); ++i)
    results.push_back({out_shapes[i].first, out_shapes[i].second,
                       download(out_bufs[i], static_cast<size_t>(numel(out_shapes[i].second)))});
  return info_of(impl);
}

/// The device side of a bench problem.
struct BenchProblem::Impl {
  dgps::ModelSpec spec;
  dgps::Shape s;
  int mode = 0;
  double lambda = 1;
  dgps::cuda::Params c;
  dgps::cuda::GradParams g;
  std::map<std::string, DeviceBuffer> dev;
  dgps::cuda::Workspace ws;

  /// A device array of `n` floats named `name` (uploaded from `host` when given, else zeros).
  DeviceBuffer& make(const std::string& name, size_t n, const std::vector<float>* host = nullptr) {
    if (host) return dev[name] = upload(*host);
    dev[name] = DeviceBuffer(n * sizeof(float));
    check(cudaMemset(dev[name].get(), 0, n * sizeof(float)), "cudaMemset");
    return dev[name];
  }
  const float* ptr(const std::string& name) const { return static_cast<const float*>(dev.at(name).get()); }
  float* mut(const std::string& name) { return static_cast<float*>(dev.at(name).get()); }
};

BenchProblem::BenchProblem(const dgps::ModelSpec& spec, const dgps::Shape& s, const dgps::Options& opt, int mode,
                           const BenchInputs& x)
    : impl_(new Impl) {
  std::unique_ptr<Impl> guard(impl_);
  Impl& m = *impl_;
  m.spec = spec, m.s = s, m.mode = mode, m.lambda = opt.lambda;
  const bool supported = mode == 1 ? dgps::cuda::supports_backward(spec)
                                   : dgps::cuda::supports(spec, mode == 2 ? dgps::Algorithm::recurrent : opt.algorithm);
  if (!supported)
    throw dgps::Error(std::string("backend 'cuda' has no ") + (mode == 1 ? "backward" : mode == 2 ? "decode" : "forward") +
                      " for " + dgps::to_string(spec));
  const int64_t B = s.batch, T = s.time, H = s.heads, HV = s.v_heads, K = s.key_dim, V = s.value_dim;
  const bool precond = spec.precond != dgps::precond::Kind::identity;
  const int64_t a_numel = !precond ? 0 : exact(spec) ? B * H * K * K : B * H * K;
  const std::pair<const char*, const std::vector<float>*> arrays[] = {
      {"q", x.q},     {"k", x.k},           {"v", x.v},           {"g", x.g},    {"beta", x.beta},
      {"g_p", x.g_p}, {"beta_p", x.beta_p}, {"center", x.center}, {"do", x.d_o}};
  for (const auto& [name, host] : arrays)
    if (host && !host->empty()) m.make(name, host->size(), host);
  m.make("o", static_cast<size_t>(B * T * HV * V));
  m.make("h", static_cast<size_t>(B * HV * K * V));
  if (precond) m.make("a", static_cast<size_t>(a_numel));
  // (The Params are formed after the uploads: GCC 12.2 at -O3 lost this assignment when it came before the
  // `arrays` table above, a stack-slot reuse miscompile that -fstack-reuse=none or Clang do not show.)
  m.c = params_of(spec, s, s.batch, opt);
  const int64_t g_dim = spec.decay == dgps::decay::Kind::diagonal ? K : 0;
  auto full = [&](const char* name, int64_t heads, int64_t dim) {
    if (!m.dev.count(name)) return dgps::cuda::Tensor();
    return dim ? tensor(m.dev.at(name), {B, T, heads, dim}) : tensor(m.dev.at(name), {B, T, heads});
  };
  m.c.q = full("q", H, K), m.c.k = full("k", H, K), m.c.v = full("v", HV, V), m.c.g = full("g", HV, g_dim);
  m.c.beta = full("beta", HV, 0), m.c.g_p = full("g_p", H, 0), m.c.beta_p = full("beta_p", H, 0);
  if (m.dev.count("center")) m.c.center = tensor(m.dev.at("center"), {H});
  m.c.o = full("o", HV, V);
  const std::vector<int64_t> h_shape = {B, HV, K, V};
  const std::vector<int64_t> a_shape = exact(spec) ? std::vector<int64_t>{B, H, K, K} : std::vector<int64_t>{B, H, K};
  m.c.hT = tensor(m.dev.at("h"), h_shape);
  if (precond) m.c.aT = tensor(m.dev.at("a"), a_shape);
  if (mode == 1) {
    m.c.o = m.c.hT = m.c.aT = dgps::cuda::Tensor();
    m.g.d_o = full("do", HV, V);
    auto grad = [&](const char* name, dgps::cuda::Tensor& dst, const dgps::cuda::Tensor& like) {
      if (!m.dev.count(name)) return;
      const std::string dn = std::string("d") + name;
      m.make(dn, m.dev.at(name).bytes() / sizeof(float));
      dst = like;
      dst.data = m.dev.at(dn).get();
    };
    grad("q", m.g.dq, m.c.q), grad("k", m.g.dk, m.c.k), grad("v", m.g.dv, m.c.v), grad("g", m.g.dg, m.c.g);
    grad("beta", m.g.dbeta, m.c.beta), grad("g_p", m.g.dg_p, m.c.g_p), grad("beta_p", m.g.dbeta_p, m.c.beta_p);
    grad("center", m.g.dcenter, m.c.center);
  }
  if (mode == 2) {  // decode: the states are read and written in place; each step reads token t's rows
    m.c.T = 1;
    m.c.h0 = m.c.hT;
    m.c.a0 = m.c.aT;
  }
  guard.release();
}

BenchProblem::~BenchProblem() { delete impl_; }

dgps::RunInfo BenchProblem::run() {
  Impl& m = *impl_;
  const char* impl = nullptr;
  if (m.mode == 0) {
    impl = dgps::cuda::forward(m.c, m.ws, nullptr);
  } else if (m.mode == 1) {
    impl = dgps::cuda::backward(m.c, m.g, m.ws, nullptr);
  } else {
    const int64_t B = m.s.batch, T = m.s.time, H = m.s.heads, HV = m.s.v_heads, K = m.s.key_dim, V = m.s.value_dim;
    check(cudaMemset(m.mut("h"), 0, m.dev.at("h").bytes()), "cudaMemset");
    if (m.dev.count("a")) {
      std::vector<float> a0(m.dev.at("a").bytes() / sizeof(float), 0.0f);
      if (exact(m.spec))  // P_0 = I / lambda
        for (int64_t i = 0; i < B * H; ++i)
          for (int64_t d = 0; d < K; ++d) a0[static_cast<size_t>((i * K + d) * K + d)] = float(1.0 / m.lambda);
      check(cudaMemcpy(m.mut("a"), a0.data(), m.dev.at("a").bytes(), cudaMemcpyHostToDevice), "copy to the device");
    }
    dgps::cuda::Params p = m.c;
    const int64_t g_dim = m.spec.decay == dgps::decay::Kind::diagonal ? K : 1;
    // Token t of every sequence: the rows at t of the [B, T, heads, dim] arrays, strides of the full tensors.
    auto at = [&](dgps::cuda::Tensor full, const char* name, int64_t t, int64_t row) {
      if (full.data) full.data = m.ptr(name) + t * row;
      return full;
    };
    for (int64_t t = 0; t < T; ++t) {
      p.q = at(m.c.q, "q", t, H * K), p.k = at(m.c.k, "k", t, H * K), p.v = at(m.c.v, "v", t, HV * V);
      p.g = at(m.c.g, "g", t, HV * g_dim), p.beta = at(m.c.beta, "beta", t, HV);
      p.g_p = at(m.c.g_p, "g_p", t, H), p.beta_p = at(m.c.beta_p, "beta_p", t, H);
      p.o = at(m.c.o, "o", t, HV * V);
      impl = dgps::cuda::decode(p, m.ws, nullptr);
    }
  }
  synchronise(m.mode == 0 ? "forward" : m.mode == 1 ? "backward" : "decode");
  return info_of(impl);
}

}  // namespace dgps_tool::gpu
