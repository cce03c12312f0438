/// @brief GPU tests of the exact preconditioners (ExactATK: Mesa layer, ExactATQ: ridge readout) on dgps::cuda
/// against the float64 reference: forward, backward and decode with slots, every decay, gain and solve, GVA, varlen
/// with an empty sequence, h0/a0 present and absent, K = 16, 20, 64, 128; Theorem 3.1 on the GPU; host-side
/// refusals; the unified API on Backend::cuda.
///
/// Tolerances (SPEC §5, max|x - ref| / max|ref|, the reference on the inputs the GPU saw): float32 inputs 1e-4
/// (outputs, states and every gradient), bf16 / f16 inputs 2e-2 (outputs and gradients rounded to 16 bits).
/// The statistics forget slowly (g_p in [-0.05, 0], as the CPU's exact tests): with fast forgetting over more
/// tokens than keys P grows as exp(-sum g_p) in rarely excited directions and any two roundings part.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gpu_support.hpp"
#include "plan.hpp"

namespace dgps_gpu_test {
namespace {

using dgps_test::for_each_exact;

/// Worst error seen per input type and kind (printed at the end).
std::map<std::string, double> g_worst;

void track(const std::string& key, double err) { g_worst[key] = std::max(g_worst[key], err); }

double tol_of(DType d) { return d == DType::f32 ? 1e-4 : 2e-2; }

/// K padded to the exact kernels' key tile (the variant's name).
int kp_of(int K) { return K <= 16 ? 16 : K <= 32 ? 32 : K <= 64 ? 64 : 128; }

dgps::Options ref_options(const Case& c) {
  dgps::Options o = c.opt;
  o.backend = dgps::Backend::reference;
  o.threads = 1;
  return o;
}

/// The Params of case `c` on the device (q, k, v of type d, gates gd): DeviceCase with the exact state's layout.
void exact_layout(DeviceCase& dc, const Case& c) {
  const int64_t H = c.shape.heads, K = c.shape.key_dim;
  dc.p.a0 = contiguous4(dc.buf["a0"], H, K, K);
  dc.p.lambda = float(c.opt.lambda);
}

/// dgps::cuda::forward of case `c`: o, hT, aT (outputs poisoned first).
Arrays gpu_forward_exact(const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws, std::string* impl) {
  const int64_t B = c.shape.batch, T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim,
                V = c.shape.value_dim, N = c.N;
  DeviceCase dc(c, d, gd, dgps::Algorithm::automatic);
  exact_layout(dc, c);
  DevBuf o = poisoned(size_t(B * T * HV * V) * elem_size(d)), hT = poisoned(size_t(N * HV * K * V) * 4),
         aT = poisoned(size_t(N * H * K * K) * 4);
  dgps::cuda::Params& p = dc.p;
  p.o = contiguous4(o, T, HV, V);
  p.hT = contiguous4(hT, HV, K, V);
  p.aT = contiguous4(aT, H, K, K);
  *impl = dgps::cuda::forward(p, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "exact forward");
  return {{"o", download(o, size_t(B * T * HV * V), d)},
          {"hT", download(hT, size_t(N * HV * K * V), DType::f32)},
          {"aT", download(aT, size_t(N * H * K * K), DType::f32)}};
}

/// dgps::cuda::backward of case `c`: every gradient the reference gives (destinations poisoned first).
Arrays gpu_backward_exact(const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws, std::string* impl) {
  const int64_t T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim,
                N = c.N;
  DeviceCase dc(c, d, gd, dgps::Algorithm::automatic);
  exact_layout(dc, c);
  const dgps::cuda::Params& p = dc.p;
  dgps::cuda::GradParams g;
  const DevBuf d_o = upload(c.arr.at("do"), d);
  g.d_o = contiguous4(d_o, T, HV, V);
  DevBuf dhT, daT;
  if (c.has("dhT")) dhT = upload(c.arr.at("dhT"), DType::f32);
  if (c.has("daT")) daT = upload(c.arr.at("daT"), DType::f32);
  g.dhT = contiguous4(dhT, HV, K, V);
  g.daT = contiguous4(daT, H, K, K);
  struct Out {
    DevBuf buf;
    size_t n;
    DType type;
  };
  std::map<std::string, Out> out;
  const std::pair<const char*, std::pair<const dgps::cuda::Tensor*, dgps::cuda::Tensor*>> inputs[] = {
      {"q", {&p.q, &g.dq}},       {"k", {&p.k, &g.dk}},           {"v", {&p.v, &g.dv}},
      {"g", {&p.g, &g.dg}},       {"beta", {&p.beta, &g.dbeta}},  {"g_p", {&p.g_p, &g.dg_p}},
      {"beta_p", {&p.beta_p, &g.dbeta_p}}};
  for (const auto& [name, t] : inputs) {
    if (!c.has(name)) continue;
    const std::string n(name);
    const DType type = n == "q" || n == "k" || n == "v" ? d : gd;
    const size_t count = c.arr.at(n).size();
    Out& o = out["d" + n] = Out{poisoned(count * elem_size(type)), count, type};
    *t.second = *t.first;
    t.second->data = o.buf.p;
  }
  const size_t nh = size_t(N * HV * K * V), na = size_t(N * H * K * K);
  out["dh0"] = Out{poisoned(nh * 4), nh, DType::f32};
  out["da0"] = Out{poisoned(na * 4), na, DType::f32};
  g.dh0 = contiguous4(out["dh0"].buf, HV, K, V);
  g.da0 = contiguous4(out["da0"].buf, H, K, K);
  *impl = dgps::cuda::backward(p, g, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "exact backward");
  Arrays r;
  for (const auto& [n, o] : out) r[n] = download(o.buf, o.n, o.type);
  return r;
}

/// Compares `got` with `ref` array by array (reporting each), tracking the worst under `key`.
void compare_arrays(const std::string& name, const Arrays& got, const Arrays& ref, double tol, const std::string& key,
                    const std::string& impl) {
  for (const auto& [n, r] : ref) {
    const auto it = got.find(n);
    const double err = it == got.end() ? INFINITY : dgps_test::rel_err(it->second, r);
    report(name, n.c_str(), err, tol, impl);
    track(key, err);
  }
}

struct Shape {
  const char* label;
  dgps::Shape s;
  std::vector<int64_t> cu;
  bool init;  ///< h0, a0 (and dhT, daT) given
};

/// Forward and backward of every exact model on `sh` with input type d (gates gd), against the reference.
void model_cases(const Shape& sh, DType d, DType gd, uint64_t& seed, dgps::cuda::Workspace& ws, bool backward) {
  dgps_test::Gen gen;
  gen.gp_lo = -0.05, gen.gp_hi = 0.0;
  gen.h0 = gen.a0 = gen.final_grads = sh.init;
  for_each_exact([&]<class R>() {
    Case c = dgps_test::random_case(dgps::spec_of<R>(), sh.s, sh.cu, ++seed, gen);
    c.opt = dgps::Options{};
    Case r = rounded(c, d, gd);
    for (auto& x : r.arr.at("do")) x = round_to(x, d);
    const std::string name =
        std::string("exact/") + dgps::to_string(c.spec) + "/" + sh.label + "/" + dgps::cuda::to_string(d);
    const int kp = kp_of(int(sh.s.key_dim));
    std::string impl;
    const Arrays got = gpu_forward_exact(c, d, gd, ws, &impl);
    report_check(impl == "cuda/exact/k" + std::to_string(kp), name + ": ran " + impl);
    compare_arrays(name, got, dgps_test::run_forward<double, R>(r, ref_options(r)), tol_of(d),
                   std::string("forward/") + dgps::cuda::to_string(d), impl);
    if (!backward) return;
    const Arrays gg = gpu_backward_exact(c, d, gd, ws, &impl);
    report_check(impl == "cuda/exact/backward/k" + std::to_string(kp), name + ": backward ran " + impl);
    compare_arrays(name + "/bwd", gg, dgps_test::run_backward<double, R>(r, ref_options(r)), tol_of(d),
                   std::string("backward/") + dgps::cuda::to_string(d), impl);
  });
}

/// Decode of Tn tokens for N = 3 sequences addressed through slots into a pool of 6 states (h and P): o, and the
/// whole pools (the untouched slots unchanged).
template <class R>
void decode_case(int64_t Tn, int64_t K, int64_t V, DType d, uint64_t seed, dgps::cuda::Workspace& ws) {
  const int64_t N = 3, Pn = 6, H = 2, HV = 4;
  std::vector<int64_t> slots(N);
  for (int64_t n = 0; n < N; ++n) slots[n] = (n * 7 + 4) % Pn;
  dgps_test::Gen gen;
  gen.gp_lo = -0.05, gen.gp_hi = 0.0;
  Case c = dgps_test::random_case(dgps::spec_of<R>(), {.batch = N, .time = Tn, .heads = H, .v_heads = HV,
                                                       .key_dim = K, .value_dim = V},
                                  {}, seed, gen);
  c.opt = dgps::Options{};
  // The pools: states of a batch of Pn (a0 symmetric positive definite).
  const Case pool = dgps_test::random_case(dgps::spec_of<R>(), {.batch = Pn, .time = 1, .heads = H, .v_heads = HV,
                                                                .key_dim = K, .value_dim = V},
                                           {}, seed + 1, gen);
  const std::vector<double>&hpool = pool.arr.at("h0"), &apool = pool.arr.at("a0");
  const int64_t hs = HV * K * V, as = H * K * K;
  for (int64_t n = 0; n < N; ++n) {
    std::copy_n(hpool.begin() + slots[n] * hs, hs, c.arr["h0"].begin() + n * hs);
    std::copy_n(apool.begin() + slots[n] * as, as, c.arr["a0"].begin() + n * as);
  }
  const Case r = rounded(c, d, DType::f32);
  Case r32 = r;  // the pools are float32 on the device
  for (const char* n : {"h0", "a0"})
    for (auto& x : r32.arr[n]) x = double(float(x));
  const Arrays ref = dgps_test::run_forward<double, R>(r32, ref_options(r32));
  std::vector<double> hexp(hpool.size()), aexp(apool.size());
  for (size_t i = 0; i < hexp.size(); ++i) hexp[i] = double(float(hpool[i]));
  for (size_t i = 0; i < aexp.size(); ++i) aexp[i] = double(float(apool[i]));
  for (int64_t n = 0; n < N; ++n) {
    std::copy_n(ref.at("hT").begin() + n * hs, hs, hexp.begin() + slots[n] * hs);
    std::copy_n(ref.at("aT").begin() + n * as, as, aexp.begin() + slots[n] * as);
  }
  DeviceCase dc(c, d, DType::f32, dgps::Algorithm::automatic);
  DevBuf hp = upload(hpool, DType::f32), ap = upload(apool, DType::f32), sl(slots.size() * 8);
  DevBuf o = poisoned(size_t(N * Tn * HV * V) * elem_size(d));
  check_cuda(cudaMemcpy(sl.p, slots.data(), sl.bytes, cudaMemcpyHostToDevice), "slots");
  dgps::cuda::Params& p = dc.p;
  p.lambda = float(c.opt.lambda);
  p.h0 = contiguous4(hp, HV, K, V);
  p.a0 = contiguous4(ap, H, K, K);
  p.o = contiguous4(o, Tn, HV, V);
  p.slots = static_cast<const int64_t*>(sl.p);
  const std::string impl = dgps::cuda::decode(p, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "exact decode");
  const std::string name = "exact/decode/" + dgps::to_string(c.spec) + "/T" + std::to_string(Tn) + "/K" +
                           std::to_string(K) + "/" + dgps::cuda::to_string(d);
  const std::string key = std::string("decode/") + dgps::cuda::to_string(d);
  report_check(impl == "cuda/exact/decode/k" + std::to_string(kp_of(int(K))),
               name + ": ran " + impl);
  const double eo = dgps_test::rel_err(download(o, size_t(N * Tn * HV * V), d), ref.at("o"));
  const double eh = dgps_test::rel_err(download(hp, hpool.size(), DType::f32), hexp);
  const double ea = dgps_test::rel_err(download(ap, apool.size(), DType::f32), aexp);
  report(name, "o", eo, tol_of(d), impl);
  report(name, "h", eh, tol_of(d), impl);
  report(name, "a", ea, tol_of(d), impl);
  track(key, std::max(eo, std::max(eh, ea)));
}

/// Theorem 3.1 on the GPU: Online + ExactATK (Mesa) and Offline + ExactATQ (ridge readout) with unit gates, no L2
/// norm, scale 1, lambda = 0.7 both equal the direct ridge solve (float32: 1e-4), and give the same P_T.
void theorem_3_1(dgps::cuda::Workspace& ws) {
  dgps_test::Gen gen;
  gen.h0 = gen.a0 = gen.final_grads = false;
  Case c = dgps_test::random_case(dgps::spec_of<dgps::MesaLayer>(),
                                  {.batch = 2, .time = 40, .heads = 2, .v_heads = 2, .key_dim = 16, .value_dim = 8},
                                  {}, 77, gen);
  for (auto& x : c.arr["g_p"]) x = 0.0;
  for (auto& x : c.arr["beta_p"]) x = 1.0;
  c.opt = dgps::Options{};
  c.opt.l2norm_qk = false;
  c.opt.scale = 1.0;
  c.opt.lambda = 0.7;
  Case cr = c;
  cr.spec = dgps::spec_of<dgps::RidgeReadout>();
  const auto direct = dgps_test::ridge_direct(rounded(c, DType::f32, DType::f32), 0.7);  // on the float inputs
  std::string i1, i2;
  const Arrays mesa = gpu_forward_exact(c, DType::f32, DType::f32, ws, &i1);
  const Arrays ridge = gpu_forward_exact(cr, DType::f32, DType::f32, ws, &i2);
  report_check(dgps_test::max_abs(direct) > 0.1, "exact/theorem3.1: the ridge solution is not trivial");
  report("exact/theorem3.1/mesa", "o", dgps_test::rel_err(mesa.at("o"), direct), 1e-4, i1);
  report("exact/theorem3.1/ridge", "o", dgps_test::rel_err(ridge.at("o"), direct), 1e-4, i2);
  report("exact/theorem3.1/mesa=ridge", "aT", dgps_test::rel_err(mesa.at("aT"), ridge.at("aT")), 1e-6, i1);
}

/// Expects `f` to throw dgps::Error whose message contains every one of `needles`.
template <class F>
void expect_error(const std::string& what, F&& f, std::initializer_list<const char*> needles) {
  std::string msg;
  try {
    f();
  } catch (const dgps::Error& e) {
    msg = e.what();
  }
  bool ok = !msg.empty();
  for (const char* n : needles) ok = ok && msg.find(n) != std::string::npos;
  report_check(ok, "exact/refuses/" + what + ": " + (msg.empty() ? std::string("(no error)") : msg));
}

/// Host-side refusals: a diagonal-layout a0 / da0 for an exact model, center, the chunkwise algorithm; the unified
/// API's shape check of a0 [N, H, K, K]; supports().
void refusals(dgps::cuda::Workspace& ws) {
  const dgps::Shape shape{.batch = 2, .time = 8, .heads = 2, .v_heads = 2, .key_dim = 16, .value_dim = 8};
  Case c = dgps_test::random_case(dgps::spec_of<dgps::MesaLayer>(), shape, {}, 5);
  c.opt = dgps::Options{};
  DeviceCase dc(c, DType::f32, DType::f32, dgps::Algorithm::automatic);
  exact_layout(dc, c);
  DevBuf o(size_t(2 * 8 * 2 * 8) * 4), center(8);
  dc.p.o = contiguous4(o, 8, 2, 8);
  {
    dgps::cuda::Params p = dc.p;
    p.a0 = contiguous4(dc.buf["a0"], 2, 16, 1);  // [N, H, K]: a diagonal preconditioner's layout
    expect_error("a0_layout", [&] { dgps::cuda::forward(p, ws, nullptr); }, {"'a0'", "[N, H, K, K]"});
  }
  {
    dgps::cuda::Params p = dc.p;
    p.algorithm = dgps::Algorithm::chunkwise;
    expect_error("chunkwise", [&] { dgps::cuda::forward(p, ws, nullptr); }, {"chunkwise", "exact"});
  }
  {
    dgps::cuda::Params p = dc.p;
    p.center = contiguous4(center, 1, 1, 1);
    expect_error("center", [&] { dgps::cuda::forward(p, ws, nullptr); }, {"center"});
  }
  {
    dgps::cuda::GradParams g;
    const DevBuf d_o = upload(c.arr.at("do"), DType::f32), da0(size_t(2 * 2 * 16 * 16) * 4);
    g.d_o = contiguous4(d_o, 8, 2, 8);
    g.da0 = contiguous4(da0, 2, 16, 1);
    expect_error("da0_layout", [&] { dgps::cuda::backward(dc.p, g, ws, nullptr); }, {"'da0'", "[N, H, K, K]"});
  }
  {  // The unified API: a0 given as [N, H, K] for an exact model.
    const dgps_test::CaseTensors<float> t(c);
    std::map<std::string, DevBuf> dev;
    for (const auto& [n, v] : t.t) {
      dev[n] = DevBuf(v.size() * 4);
      check_cuda(cudaMemcpy(dev[n].p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
    }
    for (const auto& [n, v] : t.s) {
      dev[n] = DevBuf(v.size() * 4);
      check_cuda(cudaMemcpy(dev[n].p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
    }
    auto ptr = [&](const char* n) { return static_cast<const float*>(dev.at(n).p); };
    auto in = dgps::inputs<float>(shape, ptr("q"), ptr("k"), ptr("v"));
    in.precond(ptr("g_p"), ptr("beta_p"), nullptr)
        .initial_state(ptr("h0"), dgps::view<const float>(ptr("a0"), {2, 2, 16}));
    dgps::Options opt;
    opt.backend = dgps::Backend::cuda;
    expect_error("unified_a0_shape",
                 [&] { dgps::forward<dgps::MesaLayer>(in, dgps::outputs<float>(static_cast<float*>(o.p)), opt); },
                 {"a0"});
  }
  const dgps::ModelSpec mesa = dgps::spec_of<dgps::MesaLayer>(), ridge = dgps::spec_of<dgps::RidgeReadout>();
  report_check(dgps::cuda::supports(mesa) && dgps::cuda::supports(ridge, dgps::Algorithm::recurrent) &&
                   !dgps::cuda::supports(mesa, dgps::Algorithm::chunkwise) && dgps::cuda::supports_backward(ridge) &&
                   dgps::supports<dgps::MesaLayer>(dgps::Backend::cuda),
               "exact/supports: recurrent and automatic yes, chunkwise no");
}

/// dgps::forward / backward / decode<R, float> on device tensors with Backend::cuda against the float64 reference.
template <class R>
void unified_case(const char* label, uint64_t seed) {
  const int64_t B = 2, T = 50, H = 2, HV = 4, K = 32, V = 16;
  const dgps::Shape shape{.batch = B, .time = T, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  dgps_test::Gen gen;
  gen.gp_lo = -0.05, gen.gp_hi = 0.0;
  Case c = dgps_test::random_case(dgps::spec_of<R>(), shape, {}, seed, gen);
  c.opt = dgps::Options{};
  const Case r = rounded(c, DType::f32, DType::f32);
  const dgps_test::CaseTensors<float> t(c);
  std::map<std::string, DevBuf> dev;
  for (const auto* m : {&t.t, &t.s})
    for (const auto& [n, v] : *m) {
      dev[n] = DevBuf(v.size() * 4);
      check_cuda(cudaMemcpy(dev[n].p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
    }
  auto ptr = [&](const std::string& n) { return dev.count(n) ? static_cast<const float*>(dev.at(n).p) : nullptr; };
  auto in = dgps::inputs<float>(shape, ptr("q"), ptr("k"), ptr("v"));
  in.decay(ptr("g")).gain(ptr("beta")).precond(ptr("g_p"), ptr("beta_p"), nullptr).initial_state(ptr("h0"), ptr("a0"));
  dgps::Options opt;
  opt.backend = dgps::Backend::cuda;
  const std::string name = std::string("exact/unified/") + label;
  // Forward.
  const size_t no = size_t(B * T * HV * V), nh = size_t(B * HV * K * V), na = size_t(B * H * K * K);
  DevBuf o = poisoned(no * 4), hT = poisoned(nh * 4), aT = poisoned(na * 4);
  const dgps::RunInfo fi = dgps::forward<R>(
      in, dgps::outputs<float>(static_cast<float*>(o.p)).final_state(static_cast<float*>(hT.p), static_cast<float*>(aT.p)),
      opt);
  check_cuda(cudaDeviceSynchronize(), "unified forward");
  report_check(fi.backend == dgps::Backend::cuda && fi.algorithm == dgps::Algorithm::recurrent &&
                   fi.impl == "cuda/exact/k32",
               name + "/forward: ran " + fi.impl);
  const Arrays ref = dgps_test::run_forward<double, R>(r, ref_options(r));
  report(name + "/forward", "o", dgps_test::rel_err(download(o, no, DType::f32), ref.at("o")), 1e-4, fi.impl);
  report(name + "/forward", "hT", dgps_test::rel_err(download(hT, nh, DType::f32), ref.at("hT")), 1e-4, fi.impl);
  report(name + "/forward", "aT", dgps_test::rel_err(download(aT, na, DType::f32), ref.at("aT")), 1e-4, fi.impl);
  // Backward: dq, dk, dv, dg_p, dh0, da0.
  std::map<std::string, DevBuf> gbuf;
  dgps::Grads<float> g;
  auto want = [&](const std::string& n, dgps::TensorView<float>& dst, std::vector<int64_t> dims) {
    gbuf[n] = poisoned(size_t(dgps_test::product(dims)) * 4);
    dst = dgps::view(static_cast<float*>(gbuf[n].p), dims);
  };
  want("dq", g.dq, c.shapes.at("q")), want("dk", g.dk, c.shapes.at("k")), want("dv", g.dv, c.shapes.at("v"));
  want("dg_p", g.dg_p, c.shapes.at("g_p")), want("dh0", g.dh0, {B, HV, K, V}), want("da0", g.da0, {B, H, K, K});
  const dgps::RunInfo bi = dgps::backward<R>(in, dgps::grads_in<float>(ptr("do"), ptr("dhT"), ptr("daT")), g, opt);
  check_cuda(cudaDeviceSynchronize(), "unified backward");
  report_check(bi.backend == dgps::Backend::cuda && bi.impl == "cuda/exact/backward/k32",
               name + "/backward: ran " + bi.impl);
  const Arrays gref = dgps_test::run_backward<double, R>(r, ref_options(r));
  for (const auto& [n, b] : gbuf)
    report(name + "/backward", n.c_str(), dgps_test::rel_err(download(b, gref.at(n).size(), DType::f32), gref.at(n)),
           1e-4, bi.impl);
  // Decode: the states after the forward's tokens, advanced by the same tokens again (as a second call would).
  dgps::DecodeState<float> st;
  DevBuf h = upload(ref.at("hT"), DType::f32), a = upload(ref.at("aT"), DType::f32);
  st.h = dgps::view(static_cast<float*>(h.p), {B, HV, K, V});
  st.a = dgps::view(static_cast<float*>(a.p), {B, H, K, K});
  auto tok = dgps::inputs<float>(shape, ptr("q"), ptr("k"), ptr("v"));
  tok.decay(ptr("g")).gain(ptr("beta")).precond(ptr("g_p"), ptr("beta_p"), nullptr);
  DevBuf od = poisoned(no * 4);
  const dgps::RunInfo di = dgps::decode<R>(st, tok, static_cast<float*>(od.p), opt);
  check_cuda(cudaDeviceSynchronize(), "unified decode");
  report_check(di.backend == dgps::Backend::cuda && di.impl == "cuda/exact/decode/k32", name + "/decode: ran " + di.impl);
  Case r2 = r;
  r2.arr["h0"] = ref.at("hT");
  r2.arr["a0"] = ref.at("aT");
  for (const char* n : {"h0", "a0"})
    for (auto& x : r2.arr[n]) x = double(float(x));
  const Arrays ref2 = dgps_test::run_forward<double, R>(r2, ref_options(r2));
  report(name + "/decode", "o", dgps_test::rel_err(download(od, no, DType::f32), ref2.at("o")), 1e-4, di.impl);
  report(name + "/decode", "h", dgps_test::rel_err(download(h, nh, DType::f32), ref2.at("hT")), 1e-4, di.impl);
  report(name + "/decode", "a", dgps_test::rel_err(download(a, na, DType::f32), ref2.at("aT")), 1e-4, di.impl);
}

/// The exact conformance cases (tests/data): forward outputs and every gradient against their stored float64
/// gold values (float32, 1e-4; da0 by its symmetric part).
void conformance(dgps::cuda::Workspace& ws) {
  for (const auto& name : dgps_test::case_names()) {
    const Case c = dgps_test::load_case(name);
    if (!dgps_test::is_exact(c.spec)) continue;
    std::string impl;
    Arrays gold;
    for (const char* n : {"o", "hT", "aT"})
      if (c.has(n)) gold[n] = c.arr.at(n);
    compare_arrays("exact/conf/" + name, gpu_forward_exact(c, DType::f32, DType::f32, ws, &impl), gold, 1e-4,
                   "forward/f32", impl);
    Arrays g = gpu_backward_exact(c, DType::f32, DType::f32, ws, &impl);
    // The gold da0 is the symmetric part of the raw gradient (tests/data/README.md), as the reference's and the
    // tool's conformance checks compare it; the random cases above compare the raw da0 with the reference.
    if (g.count("da0")) g["da0"] = dgps_test::symmetrise(g.at("da0"), c.shape.key_dim);
    Arrays ggold;
    for (const auto& [n, v] : g)
      if (c.has(n)) ggold[n] = c.arr.at(n);
    report_check(ggold.size() >= 7, "exact/conf/" + name + ": " + std::to_string(ggold.size()) + " gold gradients");
    compare_arrays("exact/conf/" + name + "/bwd", g, ggold, 1e-4, "backward/f32", impl);
  }
}

/// Two backward calls on the same inputs give the same bits (fixed-order reductions).
void determinism(dgps::cuda::Workspace& ws) {
  dgps_test::Gen gen;
  gen.gp_lo = -0.05, gen.gp_hi = 0.0;
  Case c = dgps_test::random_case(dgps::spec_of<dgps_test::ExactWithGain<dgps::decay::Diagonal, dgps::precond::ExactATQ,
                                                         dgps::solve::Online>>(),
                                  {.batch = 1, .time = 90, .heads = 2, .v_heads = 4, .key_dim = 64, .value_dim = 80},
                                  {}, 4040, gen);
  c.opt = dgps::Options{};
  std::string impl;
  const Arrays a = gpu_backward_exact(c, DType::f32, DType::f32, ws, &impl);
  const Arrays b = gpu_backward_exact(c, DType::f32, DType::f32, ws, &impl);
  bool same = true;
  for (const auto& [n, v] : a) same = same && same_bits(v, b.at(n));
  report_check(same, "exact/backward/deterministic: two calls, the same bits (" + impl + ")");
}

/// Timings (for the record, not checked): the Mesa layer's forward and backward at B = 2, T = 2048, H = HV = 4,
/// K = V = 128, bf16 inputs, median of 5 calls after a warm-up.
void timings(dgps::cuda::Workspace& ws) {
  dgps_test::Gen gen;
  gen.gp_lo = -0.05, gen.gp_hi = 0.0;
  Case c = dgps_test::random_case(dgps::spec_of<dgps::MesaLayer>(),
                                  {.batch = 2, .time = 2048, .heads = 4, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                                  {}, 31337, gen);
  c.opt = dgps::Options{};
  const int64_t T = 2048, H = 4, HV = 4, K = 128, V = 128, N = 2;
  DeviceCase dc(c, DType::bf16, DType::f32, dgps::Algorithm::automatic);
  exact_layout(dc, c);
  DevBuf o(size_t(N * T * HV * V) * 2), hT(size_t(N * HV * K * V) * 4), aT(size_t(N * H * K * K) * 4);
  dgps::cuda::Params p = dc.p;
  p.o = contiguous4(o, T, HV, V), p.hT = contiguous4(hT, HV, K, V), p.aT = contiguous4(aT, H, K, K);
  const DevBuf d_o = upload(c.arr.at("do"), DType::bf16);
  DevBuf dq(c.arr.at("q").size() * 2), dk(c.arr.at("k").size() * 2), dv(c.arr.at("v").size() * 2);
  dgps::cuda::GradParams g;
  g.d_o = contiguous4(d_o, T, HV, V);
  g.dq = contiguous4(dq, T, H, K), g.dk = contiguous4(dk, T, H, K), g.dv = contiguous4(dv, T, HV, V);
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "event"), check_cuda(cudaEventCreate(&e1), "event");
  auto time_of = [&](auto&& call) {
    call();
    std::vector<float> ms;
    for (int i = 0; i < 5; ++i) {
      check_cuda(cudaEventRecord(e0), "record");
      call();
      check_cuda(cudaEventRecord(e1), "record");
      check_cuda(cudaEventSynchronize(e1), "sync");
      float x = 0;
      check_cuda(cudaEventElapsedTime(&x, e0, e1), "elapsed");
      ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    return ms[2];
  };
  const float f = time_of([&] { dgps::cuda::forward(p, ws, nullptr); });
  const float b = time_of([&] { dgps::cuda::backward(p, g, ws, nullptr); });
  std::printf("exact timing mesa B2 T2048 H4 K128 V128 bf16: forward %.3f ms, backward %.3f ms (workspace %.1f MiB)\n",
              f, b, double(dgps::cuda::backward_workspace_bytes(p)) / (1 << 20));
  cudaEventDestroy(e0), cudaEventDestroy(e1);
}

}  // namespace

/// The exact preconditioners' GPU tests; `quick`: the small shapes only (for compute-sanitizer).
void exact_tests(dgps::cuda::Workspace& ws, bool quick) {
  const Shape shapes[] = {
      {"B2T37H2HV4K16V24", {.batch = 2, .time = 37, .heads = 2, .v_heads = 4, .key_dim = 16, .value_dim = 24}, {}, true},
      {"B2T9H2HV2K20V12", {.batch = 2, .time = 9, .heads = 2, .v_heads = 2, .key_dim = 20, .value_dim = 12}, {}, false},
      {"varlen_K64V40", {.batch = 1, .time = 130, .heads = 1, .v_heads = 2, .key_dim = 64, .value_dim = 40},
       {0, 50, 50, 130}, false},
      {"B1T70H2HV2K128V64", {.batch = 1, .time = 70, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 64}, {}, true},
  };
  uint64_t seed = 9100;
  conformance(ws);
  const int n = quick ? 2 : 4;
  for (int i = 0; i < n; ++i) model_cases(shapes[i], DType::f32, DType::f32, seed, ws, true);
  // 16-bit inputs: bf16 (gates f32 and bf16), f16.
  model_cases(shapes[quick ? 0 : 2], DType::bf16, DType::f32, seed, ws, true);
  if (!quick) {
    model_cases(shapes[3], DType::bf16, DType::bf16, seed, ws, true);
    model_cases(shapes[0], DType::f16, DType::f32, seed, ws, false);
  }
  decode_case<dgps::MesaLayer>(1, 16, 24, DType::f32, seed++, ws);
  decode_case<dgps::RidgeReadout>(3, 16, 24, DType::f32, seed++, ws);
  decode_case<dgps_test::ExactWithGain<dgps::decay::Diagonal, dgps::precond::ExactATK, dgps::solve::Online>>(2, 128, 64, DType::f32,
                                                                                             seed++, ws);
  decode_case<dgps_test::ExactWithGain<dgps::decay::Scalar, dgps::precond::ExactATQ, dgps::solve::Offline>>(1, 64, 32, DType::bf16,
                                                                                            seed++, ws);
  theorem_3_1(ws);
  refusals(ws);
  unified_case<dgps::MesaLayer>("mesa", seed++);
  unified_case<dgps_test::ExactWithGain<dgps::decay::Scalar, dgps::precond::ExactATQ, dgps::solve::Online>>("scalar_atq_online",
                                                                                            seed++);
  determinism(ws);
  if (!quick) timings(ws);
  for (const auto& [k, e] : g_worst) std::printf("exact worst %-18s %.3e\n", k.c_str(), e);
}

}  // namespace dgps_gpu_test
