/// @brief GPU test of the unified API: dgps::forward / backward / decode<GDN or PGDN> with bf16 and f16 device
/// tensors on Backend::cuda, against the same calls on host copies with Backend::cpu.
///
/// Both sides read the same 16-bit inputs (the host arrays' bits are copied to the device). Tolerances, GPU
/// against CPU: forward o, hT, aT max|x - cpu| / max|cpu| within 3e-2 (each side is within 2e-2 of the float64
/// reference on these inputs: the GPU chunkwise kernels multiply 16-bit operands, the CPU rounds o to 16 bits);
/// backward rms(x - cpu) / rms(cpu) (FLA's metric) within 1.5e-2 for dq, dk, dv, dh0 and 3e-2 for the gate and
/// preconditioner gradients (the GPU chunkwise backward's bounds against the reference, 8e-3 and 2e-2, plus the
/// CPU's 16-bit rounding of the gradients); decode (float32 recurrent kernels on both) o within 1e-2 and the
/// states within 1e-3.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_support.hpp"

namespace dgps_gpu_test {
namespace {

/// A device copy of a host array (its bytes as they are).
template <class U>
DevBuf to_device(const std::vector<U>& v) {
  DevBuf b(v.size() * sizeof(U));
  check_cuda(cudaMemcpy(b.p, v.data(), v.size() * sizeof(U), cudaMemcpyHostToDevice), "to_device");
  return b;
}

/// The first `n` elements of type U of a device buffer, as float64.
template <class U>
std::vector<double> from_device(const DevBuf& b, size_t n) {
  std::vector<U> h(n);
  check_cuda(cudaMemcpy(h.data(), b.p, n * sizeof(U), cudaMemcpyDeviceToHost), "from_device");
  return std::vector<double>(h.begin(), h.end());
}

/// A host array as float64.
template <class U>
std::vector<double> widen(const std::vector<U>& v) {
  return std::vector<double>(v.begin(), v.end());
}

dgps::Options on(dgps::Backend b) {
  dgps::Options o;
  o.backend = b;
  return o;
}

/// Host tensors of a random case in type T and their device copies, with views of either.
template <class T>
struct Tensors {
  using S = dgps::state_t<T>;
  dgps_test::CaseTensors<T> host;
  std::map<std::string, DevBuf> dev;

  explicit Tensors(const Case& c) : host(c) {
    for (const auto& [n, v] : host.t) dev[n] = to_device(v);
    for (const auto& [n, v] : host.s) dev[n] = to_device(v);
  }
  const T* d(const std::string& n) const { return dev.count(n) ? static_cast<const T*>(dev.at(n).p) : nullptr; }
  const S* ds(const std::string& n) const { return dev.count(n) ? static_cast<const S*>(dev.at(n).p) : nullptr; }

  /// The inputs on the host, or on the device.
  dgps::Inputs<T> inputs(const Case& c, bool device) const {
    if (!device) return host.inputs(c);
    auto in = dgps::inputs<T>(c.shape, d("q"), d("k"), d("v"));
    in.decay(d("g")).gain(d("beta")).precond(d("g_p"), d("beta_p"), d("center")).initial_state(ds("h0"), ds("a0"));
    return in;
  }
};

template <class T>
const char* type_name() {
  return std::is_same_v<T, dgps::bf16> ? "bf16" : "f16";
}

/// dgps::forward<R, T> on the device (Backend::cuda) against the CPU.
template <class R, class T>
void forward_case(const char* model, uint64_t seed) {
  using S = dgps::state_t<T>;
  const dgps::Shape s{.batch = 2, .time = 150, .heads = 2, .v_heads = 4, .key_dim = 64, .value_dim = 64};
  const Case c = make_random(model, s, {}, seed);
  const Tensors<T> t(c);
  const bool pre = dgps::spec_of<R>().precond != dgps::precond::Kind::identity;
  const size_t no = size_t(2 * 150 * 4 * 64), nh = size_t(2 * 4 * 64 * 64), na = pre ? size_t(2 * 2 * 64) : 0;
  std::vector<T> o(no);
  std::vector<S> hT(nh), aT(na);
  const dgps::RunInfo cpu =
      dgps::forward<R>(t.inputs(c, false), dgps::outputs<T>(o.data()).final_state(hT.data(), pre ? aT.data() : nullptr),
                       on(dgps::Backend::cpu));
  DevBuf d_o = poisoned(no * sizeof(T)), d_hT = poisoned(nh * sizeof(S)), d_aT = poisoned((na ? na : 1) * sizeof(S));
  auto out = dgps::outputs<T>(static_cast<T*>(d_o.p))
                 .final_state(static_cast<S*>(d_hT.p), pre ? static_cast<S*>(d_aT.p) : nullptr);
  const dgps::RunInfo gpu = dgps::forward<R>(t.inputs(c, true), out, on(dgps::Backend::cuda));
  check_cuda(cudaDeviceSynchronize(), "dgps::forward");
  const std::string name = std::string("unified/forward/") + model + "/" + type_name<T>();
  report_check(gpu.backend == dgps::Backend::cuda && gpu.impl.rfind("cuda/", 0) == 0,
               name + ": ran " + gpu.impl + " (cpu: " + cpu.impl + ")");
  report(name, "o", dgps_test::rel_err(from_device<T>(d_o, no), widen(o)), 3e-2, gpu.impl);
  report(name, "hT", dgps_test::rel_err(from_device<S>(d_hT, nh), widen(hT)), 3e-2, gpu.impl);
  if (pre) report(name, "aT", dgps_test::rel_err(from_device<S>(d_aT, na), widen(aT)), 3e-2, gpu.impl);
}

/// dgps::backward<R, T> on the device (Backend::cuda, automatic algorithm) against the CPU: every gradient.
template <class R, class T>
void backward_case(const char* model, uint64_t seed) {
  using S = dgps::state_t<T>;
  const dgps::Shape s{.batch = 1, .time = 130, .heads = 2, .v_heads = 4, .key_dim = 64, .value_dim = 64};
  const Case c = make_random(model, s, {}, seed);
  const Tensors<T> t(c);
  // Gradient destinations: host and device buffers of each input's size.
  std::map<std::string, std::vector<T>> ht;
  std::map<std::string, std::vector<S>> hs;
  std::map<std::string, DevBuf> dv;
  dgps::Grads<T> hg, dg;
  auto want = [&](const std::string& in, dgps::TensorView<T> dgps::Grads<T>::*g) {
    if (!c.has(in)) return;
    const std::string n = "d" + in;
    ht[n].assign(c.arr.at(in).size(), T(0.0));
    dv[n] = poisoned(ht[n].size() * sizeof(T));
    hg.*g = dgps::view(ht[n].data(), c.shapes.at(in));
    dg.*g = dgps::view(static_cast<T*>(dv[n].p), c.shapes.at(in));
  };
  want("q", &dgps::Grads<T>::dq), want("k", &dgps::Grads<T>::dk), want("v", &dgps::Grads<T>::dv);
  want("g", &dgps::Grads<T>::dg), want("beta", &dgps::Grads<T>::dbeta), want("g_p", &dgps::Grads<T>::dg_p);
  want("beta_p", &dgps::Grads<T>::dbeta_p), want("center", &dgps::Grads<T>::dcenter);
  auto want_state = [&](const std::string& n, dgps::TensorView<S> dgps::Grads<T>::*g, std::vector<int64_t> dims) {
    hs[n].assign(size_t(dgps_test::product(dims)), S(0));
    dv[n] = poisoned(hs[n].size() * sizeof(S));
    hg.*g = dgps::view(hs[n].data(), dims);
    dg.*g = dgps::view(static_cast<S*>(dv[n].p), dims);
  };
  want_state("dh0", &dgps::Grads<T>::dh0, {c.N, 4, 64, 64});
  if (c.has("a0")) want_state("da0", &dgps::Grads<T>::da0, c.shapes.at("a0"));
  const auto hgi = dgps::grads_in<T>(t.host.p("do"), t.host.ps("dhT"), t.host.ps("daT"));
  const auto dgi = dgps::grads_in<T>(t.d("do"), t.ds("dhT"), t.ds("daT"));
  const dgps::RunInfo cpu = dgps::backward<R>(t.inputs(c, false), hgi, hg, on(dgps::Backend::cpu));
  const dgps::RunInfo gpu = dgps::backward<R>(t.inputs(c, true), dgi, dg, on(dgps::Backend::cuda));
  check_cuda(cudaDeviceSynchronize(), "dgps::backward");
  const std::string name = std::string("unified/backward/") + model + "/" + type_name<T>();
  report_check(gpu.backend == dgps::Backend::cuda && gpu.impl.rfind("cuda/backward/", 0) == 0,
               name + ": ran " + gpu.impl + " (cpu: " + cpu.impl + ")");
  auto tol = [](const std::string& n) { return n == "dq" || n == "dk" || n == "dv" || n == "dh0" ? 1.5e-2 : 3e-2; };
  for (const auto& [n, h] : ht)
    report(name, n.c_str(), rms_rel(from_device<T>(dv.at(n), h.size()), widen(h)), tol(n), gpu.impl);
  for (const auto& [n, h] : hs)
    report(name, n.c_str(), rms_rel(from_device<S>(dv.at(n), h.size()), widen(h)), tol(n), gpu.impl);
}

/// dgps::decode<R, T> of two tokens on the device (Backend::cuda) against the CPU: o and the states.
template <class R, class T>
void decode_case(const char* model, uint64_t seed) {
  using S = dgps::state_t<T>;
  const int64_t N = 3, Tn = 2, H = 2, HV = 4, K = 64, V = 64;
  const dgps::Shape s{.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  dgps_test::Gen gen;
  gen.h0 = false, gen.a0 = false;  // the states live in DecodeState
  const Case c = make_random(model, s, {}, seed, gen);
  const Tensors<T> t(c);
  const bool pre = dgps::spec_of<R>().precond != dgps::precond::Kind::identity;
  dgps_test::Rng rng(seed + 1);
  std::vector<S> h(size_t(N * HV * K * V)), a(pre ? size_t(N * H * K) : 0);
  for (auto& x : h) x = S(0.5 * rng.normal());
  for (auto& x : a) x = S(rng.uniform(0.0, 2.0));
  DevBuf d_h = to_device(h), d_a = to_device(a.empty() ? std::vector<S>(1) : a);
  const size_t no = size_t(N * Tn * HV * V);
  std::vector<T> o(no);
  dgps::DecodeState<T> hst, dst;
  hst.h = dgps::view(h.data(), {N, HV, K, V});
  dst.h = dgps::view(static_cast<S*>(d_h.p), {N, HV, K, V});
  if (pre) {
    hst.a = dgps::view(a.data(), {N, H, K});
    dst.a = dgps::view(static_cast<S*>(d_a.p), {N, H, K});
  }
  DevBuf d_o = poisoned(no * sizeof(T));
  const dgps::RunInfo cpu = dgps::decode<R>(hst, t.inputs(c, false), o.data(), on(dgps::Backend::cpu));
  const dgps::RunInfo gpu = dgps::decode<R>(dst, t.inputs(c, true), static_cast<T*>(d_o.p), on(dgps::Backend::cuda));
  check_cuda(cudaDeviceSynchronize(), "dgps::decode");
  const std::string name = std::string("unified/decode/") + model + "/" + type_name<T>();
  report_check(gpu.backend == dgps::Backend::cuda && gpu.impl.rfind("cuda/decode/", 0) == 0,
               name + ": ran " + gpu.impl + " (cpu: " + cpu.impl + ")");
  report(name, "o", dgps_test::rel_err(from_device<T>(d_o, no), widen(o)), 1e-2, gpu.impl);
  report(name, "h", dgps_test::rel_err(from_device<S>(d_h, h.size()), widen(h)), 1e-3, gpu.impl);
  if (pre) report(name, "a", dgps_test::rel_err(from_device<S>(d_a, a.size()), widen(a)), 1e-3, gpu.impl);
}

}  // namespace

/// The unified-API tests (dgps::forward / backward / decode with 16-bit device tensors).
void unified_tests() {
  uint64_t seed = 3500;
  forward_case<dgps::GDN, dgps::bf16>("gdn", seed++);
  forward_case<dgps::PGDN, dgps::bf16>("pgdn", seed++);
  forward_case<dgps::PGDN, dgps::f16>("pgdn", seed++);
  backward_case<dgps::GDN, dgps::bf16>("gdn", seed++);
  backward_case<dgps::PGDN, dgps::bf16>("pgdn", seed++);
  backward_case<dgps::PGDN, dgps::f16>("pgdn", seed++);
  decode_case<dgps::GDN, dgps::bf16>("gdn", seed++);
  decode_case<dgps::PGDN, dgps::bf16>("pgdn", seed++);
}

}  // namespace dgps_gpu_test
