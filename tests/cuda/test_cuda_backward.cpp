/// @brief GPU tests of dgps::cuda::backward against the float64 reference gradients: conformance cases, random
/// cases of every covered model, determinism, host-side refusals, and dgps::backward on device pointers.
///
/// Float32 inputs: max|x - ref| / max|ref| within 1e-4 (SPEC §5), also against the cases' stored gold
/// gradients. bf16 inputs, or any run of the chunkwise (16-bit tensor-core) backward: FLA's metric
/// rms(x - ref) / rms(ref), 8e-3 for dq, dk, dv, dh0 and 2e-2 for the gate and preconditioner
/// gradients, the reference running on the rounded inputs. bf16 cases run both the chunkwise backward
/// (automatic) and the float32 one (Algorithm::recurrent).
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gpu_support.hpp"

namespace dgps_gpu_test {
namespace {

/// A gradient destination on the device: its buffer, element count and element type.
struct GradBuf {
  DevBuf buf;
  size_t n = 0;
  DType type = DType::f32;
};

/// The float64 reference gradients of case `c` (SPEC §3.8) with the case's options: every input
/// present, dh0 and (with a preconditioner) da0.
Arrays reference_backward(const Case& c) {
  dgps::Options opt = c.opt;
  opt.backend = dgps::Backend::reference;
  opt.threads = 0;
  return dgps::dispatch(c.spec, [&]<class R>() { return dgps_test::run_backward<double, R>(c, opt); });
}

/// Runs dgps::cuda::backward on case `c` with q, k, v, do of type d and gates of type gd and algorithm
/// `alg`, asking for the gradients reference_backward computes (destinations poisoned with NaN first).
/// With `fwd`: dgps::cuda::forward_training first, its o, hT (and aT) downloaded into *fwd; with
/// `between` also, that call runs between the two (another call on the workspace). `offset`: o and the
/// gradients start that many elements into their buffers (1: rows not aligned to element pairs).
Arrays gpu_backward(const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws, std::string* impl,
                    dgps::Algorithm alg = dgps::Algorithm::automatic, Arrays* fwd = nullptr,
                    const std::function<void()>& between = {}, size_t offset = 0) {
  const int64_t T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim,
                N = c.N;
  DeviceCase dc(c, d, gd, alg);
  dgps::cuda::GradParams g;
  const DevBuf d_o = upload(c.arr.at("do"), d);
  g.d_o = contiguous4(d_o, T, HV, V);
  DevBuf dhT, daT;
  if (c.has("dhT")) dhT = upload(c.arr.at("dhT"), DType::f32);
  if (c.has("daT")) daT = upload(c.arr.at("daT"), DType::f32);
  g.dhT = contiguous4(dhT, HV, K, V);
  g.daT = contiguous4(daT, H, K, 1);
  std::map<std::string, GradBuf> out;
  const dgps::cuda::Params& p = dc.p;
  const std::pair<const char*, std::pair<const dgps::cuda::Tensor*, dgps::cuda::Tensor*>> inputs[] = {
      {"q", {&p.q, &g.dq}},
      {"k", {&p.k, &g.dk}},
      {"v", {&p.v, &g.dv}},
      {"g", {&p.g, &g.dg}},
      {"beta", {&p.beta, &g.dbeta}},
      {"g_p", {&p.g_p, &g.dg_p}},
      {"beta_p", {&p.beta_p, &g.dbeta_p}},
      {"center", {&p.center, &g.dcenter}}};
  for (const auto& [name, t] : inputs) {
    if (!c.has(name)) continue;
    const std::string n(name);
    const DType type = n == "q" || n == "k" || n == "v" ? d : gd;
    const size_t count = c.arr.at(n).size();
    GradBuf& b = out["d" + n] = GradBuf{poisoned((count + offset) * elem_size(type)), count, type};
    *t.second = *t.first;  // the input's strides
    t.second->data = static_cast<char*>(b.buf.p) + offset * elem_size(type);
  }
  const size_t nh = size_t(N * HV * K * V), na = size_t(N * H * K);
  out["dh0"] = GradBuf{poisoned(nh * 4), nh, DType::f32};
  g.dh0 = contiguous4(out["dh0"].buf, HV, K, V);
  if (dgps_test::has_precond_state(c.spec)) {
    out["da0"] = GradBuf{poisoned(na * 4), na, DType::f32};
    g.da0 = contiguous4(out["da0"].buf, H, K, 1);
  }
  if (fwd) {
    const int64_t B = c.shape.batch;
    const bool diag_p = dgps_test::has_precond_state(c.spec);
    DevBuf o = poisoned(size_t(B * T * HV * V + offset) * elem_size(d)), hT = poisoned(nh * 4), aT = poisoned(na * 4);
    dgps::cuda::Params pt = p;
    pt.o = contiguous4(o, T, HV, V);
    pt.o.data = static_cast<const char*>(pt.o.data) + offset * elem_size(d);
    pt.hT = contiguous4(hT, HV, K, V);
    if (diag_p) pt.aT = contiguous4(aT, H, K, 1);
    dgps::cuda::forward_training(pt, ws, nullptr);
    check_cuda(cudaDeviceSynchronize(), "training forward");
    (*fwd)["o"] = download(o, size_t(B * T * HV * V), d, offset);
    (*fwd)["hT"] = download(hT, nh, DType::f32);
    if (diag_p) (*fwd)["aT"] = download(aT, na, DType::f32);
    if (between) between();
    // The backward's p has no outputs: a fingerprint ignores them, the saved activations still match.
  }
  *impl = dgps::cuda::backward(p, g, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "backward");
  Arrays r;
  for (const auto& [n, b] : out) r[n] = download(b.buf, b.n, b.type, b.n && n != "dh0" && n != "da0" ? offset : 0);
  return r;
}

/// The tolerance of gradient `n`: 1e-4 (max relative error) for float32 arithmetic (`exact`); with 16-bit
/// inputs or operands (rms_rel) 8e-3 for dq, dk, dv, dh0 and 2e-2 for the gate and preconditioner gradients.
double grad_tolerance(const std::string& n, bool exact) {
  if (exact) return 1e-4;
  return n == "dq" || n == "dk" || n == "dv" || n == "dh0" ? 8e-3 : 2e-2;
}

/// Compares the GPU gradients (inputs of type d, gates gd, algorithm alg) with the float64 reference on
/// the rounded inputs and, for float32 arithmetic when `gold` is given, with the case's stored gradients
/// (case.json denominators). Returns the GPU gradients.
Arrays compare_backward(const std::string& name, const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws,
                        const Arrays* gold, dgps::Algorithm alg = dgps::Algorithm::automatic) {
  std::string impl;
  const Arrays got = gpu_backward(c, d, gd, ws, &impl, alg);
  const Arrays ref = reference_backward(rounded(c, d, gd));
  const bool exact = d == DType::f32 && impl.find("chunkwise") == std::string::npos;
  const std::string tag = std::string(dgps::cuda::to_string(d)) + (alg == dgps::Algorithm::recurrent ? "/recurrent" : "");
  for (const auto& [n, x] : got) {
    double err = exact ? dgps_test::rel_err(x, ref.at(n)) : rms_rel(x, ref.at(n));
    if (gold && exact && gold->count(n)) {
      const auto dn = c.denom.find(n);
      err = std::max(err, dgps_test::rel_err(x, gold->at(n), dn == c.denom.end() ? -1 : dn->second));
    }
    report("bwd/" + name + "/" + tag, n.c_str(), err, grad_tolerance(n, exact), impl);
  }
  return got;
}

/// Every conformance case the CUDA backward covers: float32 against the reference and the gold
/// gradients; bf16 inputs (float32 gates) against the reference unless `quick`.
void conformance(dgps::cuda::Workspace& ws, bool quick) {
  for (const auto& name : dgps_test::case_names()) {
    const Case c = dgps_test::load_case(name);
    if (dgps_test::is_exact(c.spec)) {
      std::printf("skip  bwd/conf/%-40s (exact preconditioner: test_cuda_exact.cpp)\n", name.c_str());
      continue;
    }
    compare_backward("conf/" + name, c, DType::f32, DType::f32, ws, &c.arr);
    if (!quick) compare_backward("conf/" + name, c, DType::bf16, DType::f32, ws, nullptr);
  }
}

/// True when two runs gave bitwise equal gradients (same_bits for every array).
bool bitwise_equal(const Arrays& a, const Arrays& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [n, x] : a) {
    const auto it = b.find(n);
    if (it == b.end() || !same_bits(x, it->second)) return false;
  }
  return true;
}

/// Random cases of every covered model (GVA, varlen with empty and one-token sequences, odd sizes,
/// strong decay, long sequences) and the bitwise determinism of two bf16 runs; `quick`: one small case.
void random_cases(dgps::cuda::Workspace& ws, bool quick) {
  uint64_t seed = 7000;
  if (quick) {
    Case c = make_random("pgdn", {.batch = 1, .time = 130, .heads = 1, .v_heads = 2, .key_dim = 128, .value_dim = 128},
                         {}, seed);
    compare_backward("rand/pgdn/T130", c, DType::f32, DType::f32, ws, nullptr);
    compare_backward("rand/pgdn/T130", c, DType::bf16, DType::f32, ws, nullptr);
    Case v = make_random("gdn", {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 64},
                         {0, 1, 1, 130, 200}, seed + 1);
    compare_backward("rand/gdn/varlen", v, DType::bf16, DType::f32, ws, nullptr);
    // Diagonal decay: 16-row blocks on tensor cores and blocks summed elementwise; GVA (two value heads
    // per key head) and two key heads. (dcenter is one sum per head over every token and channel; on
    // 16-bit operands its relative error grows where that sum cancels, beyond 2e-2 for some one-head
    // problems of ~100 tokens, so the cases here and below have at least two heads.)
    dgps_test::Gen mixed;
    mixed.g_lo = -12, mixed.g_hi = 0;
    Case k = make_random("pkda", {.batch = 1, .time = 130, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                         {}, seed + 2, mixed);
    compare_backward("rand/pkda/T130", k, DType::bf16, DType::f32, ws, nullptr);
    Case d = make_random("kda", {.batch = 1, .time = 100, .heads = 1, .v_heads = 1, .key_dim = 128, .value_dim = 64},
                         {}, seed + 3, mixed);
    compare_backward("rand/kda/T100", d, DType::bf16, DType::f32, ws, nullptr);
    return;
  }
  for (const char* m : {"la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn", "pkda", "pmamba2"}) {
    const std::string name = std::string("rand/") + m;
    // K = V = 128 with GVA (HV = 2H), f32 and bf16.
    Case c = make_random(m, {.batch = 2, .time = 300, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
                         seed++);
    compare_backward(name + "/B2T300H2HV4K128", c, DType::f32, DType::f32, ws, nullptr);
    compare_backward(name + "/B2T300H2HV4K128", c, DType::bf16, DType::f32, ws, nullptr);
    compare_backward(name + "/B2T300H2HV4K128", c, DType::bf16, DType::f32, ws, nullptr, dgps::Algorithm::recurrent);
    // K = V = 64, varlen with a one-token and an empty sequence, no initial states.
    dgps_test::Gen g0;
    g0.h0 = false;
    g0.a0 = false;
    Case v = make_random(m, {.batch = 1, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 64},
                         {0, 100, 101, 101, 400, 700}, seed++, g0);
    compare_backward(name + "/varlen_K64", v, DType::f32, DType::f32, ws, nullptr);
    compare_backward(name + "/varlen_K64", v, DType::bf16, DType::bf16, ws, nullptr);
    // Sizes that are not powers of two; GVA x4.
    Case o =
        make_random(m, {.batch = 3, .time = 77, .heads = 1, .v_heads = 4, .key_dim = 100, .value_dim = 48}, {}, seed++);
    compare_backward(name + "/B3T77K100V48", o, DType::f32, DType::f32, ws, nullptr);
    compare_backward(name + "/B3T77K100V48", o, DType::f16, DType::f32, ws, nullptr);
  }
  // Enough heads (B * HV >= 0.9 x the SMs of an H200) for the widest state-pass variants (128 value
  // columns per block), GVA and not.
  for (const char* m : {"gdn", "pgdn", "kda", "pkda"}) {
    Case c = make_random(m, {.batch = 8, .time = 130, .heads = 16, .v_heads = 16, .key_dim = 128, .value_dim = 128},
                         {}, seed++);
    compare_backward(std::string("rand/") + m + "/B8T130H16", c, DType::bf16, DType::f32, ws, nullptr);
  }
  // Float32 inputs on the chunkwise (16-bit operand) backward when asked for.
  for (const char* m : {"gdn", "pgdn", "kda"}) {
    Case c = make_random(m, {.batch = 2, .time = 200, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
                         seed++);
    compare_backward(std::string("rand/") + m + "/f32_chunkwise", c, DType::f32, DType::f32, ws, nullptr,
                     dgps::Algorithm::chunkwise);
  }
  // Very strong decay (SPEC §5): every gradient finite and within tolerance.
  dgps_test::Gen strong;
  strong.g_lo = -50, strong.g_hi = -10;
  for (const char* m : {"gdn", "kda", "pkda"}) {
    Case c = make_random(m, {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, strong);
    compare_backward(std::string("rand/") + m + "/strong_decay", c, DType::f32, DType::f32, ws, nullptr);
    compare_backward(std::string("rand/") + m + "/strong_decay", c, DType::bf16, DType::f32, ws, nullptr);
  }
  // Diagonal decay on the chunkwise backward: gates in [-50, 0] in one head (16-row blocks on either
  // side of the tensor-core limit), and gates in [-4, -3] (blocks spread by 45 to 60: the tensor cores
  // carry factors up to e^60).
  dgps_test::Gen mixed, steep;
  mixed.g_lo = -50, mixed.g_hi = 0;
  steep.g_lo = -4, steep.g_hi = -3;
  for (const char* m : {"kda", "pkda", "gla"}) {
    Case c = make_random(m, {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, mixed);
    compare_backward(std::string("rand/") + m + "/mixed_decay", c, DType::bf16, DType::f32, ws, nullptr);
    Case d = make_random(m, {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, steep);
    compare_backward(std::string("rand/") + m + "/steep_decay", d, DType::bf16, DType::f32, ws, nullptr);
  }
  // A large case, bf16; a second run must give bitwise equal gradients (fixed-order reductions).
  for (const char* m : {"pgdn", "pkda"}) {
    const std::string name = std::string("rand/") + m + "/B2T2048H4K128";
    Case big = make_random(m, {.batch = 2, .time = 2048, .heads = 4, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                           {}, seed++);
    const Arrays first = compare_backward(name, big, DType::bf16, DType::f32, ws, nullptr);
    std::string impl;
    const Arrays second = gpu_backward(big, DType::bf16, DType::f32, ws, &impl);
    report_check(bitwise_equal(first, second), "bwd/" + name + "/bf16 deterministic: two runs bitwise equal");
  }
}

/// forward_training then backward: the training forward's outputs within the forward's tolerance of the
/// float64 reference, the backward on the saved activations (its name says so) bitwise equal to one
/// that recomputes them; a forward of another call on the workspace in between makes it recompute.
/// `quick`: PGDN and PKDA only, shorter.
void training_forward(dgps::cuda::Workspace& ws, bool quick) {
  uint64_t seed = 9100;
  for (const char* m : {"pgdn", "pkda", "gdn", "kda", "dn", "pmamba2"}) {
    if (quick && seed >= 9104) break;
    const std::string name = std::string("bwd/training_forward/") + m;
    Case c = make_random(
        m, {.batch = 2, .time = quick ? 130 : 300, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
        seed++);
    std::string plain_impl, saved_impl, other_impl;
    const Arrays plain = gpu_backward(c, DType::bf16, DType::f32, ws, &plain_impl);
    Arrays fwd;
    const Arrays saved = gpu_backward(c, DType::bf16, DType::f32, ws, &saved_impl, dgps::Algorithm::automatic, &fwd);
    const Arrays ref = reference_forward(rounded(c, DType::bf16, DType::f32));
    for (const auto& [t, x] : fwd) report(name + "/bf16", t.c_str(), dgps_test::rel_err(x, ref.at(t)), 2e-2, "forward_training");
    report_check(saved_impl == "cuda/backward/chunkwise/saved" && bitwise_equal(plain, saved),
                 name + ": backward on the saved activations (" + saved_impl + ") bitwise equal to " + plain_impl);
    // Another forward on the same workspace in between: the backward recomputes.
    Case other = make_random(m, {.batch = 1, .time = 100, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                             {}, seed++);
    std::string ignored;
    Arrays fwd2;
    const Arrays again = gpu_backward(c, DType::bf16, DType::f32, ws, &other_impl, dgps::Algorithm::automatic, &fwd2,
                                      [&] { gpu_backward(other, DType::bf16, DType::f32, ws, &ignored); });
    report_check(other_impl == "cuda/backward/chunkwise" && bitwise_equal(plain, again),
                 name + ": after another call on the workspace the backward recomputes (" + other_impl + ")");
  }
}

/// o, dq, dk, dv one element off the alignment of element pairs (and V odd): the kernels' element-wise
/// write path, forward_training and backward within the bf16 tolerances of the float64 reference.
void unaligned_outputs(dgps::cuda::Workspace& ws) {
  uint64_t seed = 9300;
  for (const char* m : {"gdn", "pgdn"}) {
    for (const int64_t V : {128, 63}) {
      const std::string name = std::string("bwd/unaligned_outputs/") + m + "/V" + std::to_string(V);
      const Case c = make_random(
          m, {.batch = 1, .time = 130, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = V}, {}, seed++);
      std::string impl;
      Arrays fwd;
      const Arrays got =
          gpu_backward(c, DType::bf16, DType::f32, ws, &impl, dgps::Algorithm::chunkwise, &fwd, {}, /*offset=*/1);
      const Case r = rounded(c, DType::bf16, DType::f32);
      const Arrays ref_f = reference_forward(r), ref_b = reference_backward(r);
      report(name + "/bf16", "o", dgps_test::rel_err(fwd.at("o"), ref_f.at("o")), 2e-2, "forward_training");
      for (const auto& [n, x] : got) report(name + "/bf16", n.c_str(), rms_rel(x, ref_b.at(n)), grad_tolerance(n, false), impl);
    }
  }
}

/// True when every byte of `b` is still 0xff (the poison of `poisoned`).
bool still_poisoned(const DevBuf& b) {
  std::vector<unsigned char> host(b.bytes);
  check_cuda(cudaMemcpy(host.data(), b.p, b.bytes, cudaMemcpyDeviceToHost), "read back");
  for (unsigned char x : host)
    if (x != 0xff) return false;
  return true;
}

/// Expects dgps::cuda::backward(p, g) to throw dgps::Error with a message, writing nothing to `dst`.
void expect_refusal(const std::string& what, const dgps::cuda::Params& p, const dgps::cuda::GradParams& g,
                    const DevBuf& dst, dgps::cuda::Workspace& ws) {
  std::string msg;
  try {
    dgps::cuda::backward(p, g, ws, nullptr);
  } catch (const dgps::Error& e) {
    msg = e.what();
  }
  check_cuda(cudaDeviceSynchronize(), "refused backward");
  report_check(!msg.empty() && still_poisoned(dst),
               "bwd/refuses/" + what + ": " + (msg.empty() ? std::string("(no error)") : msg));
}

/// Calls backward must refuse on the host: no d_o, dg without g, an exact preconditioner given a center.
void validation(dgps::cuda::Workspace& ws) {
  const dgps::Shape s{.batch = 1, .time = 20, .heads = 1, .v_heads = 1, .key_dim = 32, .value_dim = 32};
  const int64_t T = s.time, H = s.heads, HV = s.v_heads, K = s.key_dim, V = s.value_dim;
  Case pg = make_random("pgdn", s, {}, 31);
  DeviceCase dpg(pg, DType::f32, DType::f32, dgps::Algorithm::automatic);
  const DevBuf d_o = upload(pg.arr.at("do"), DType::f32);
  DevBuf dq = poisoned(pg.arr.at("q").size() * 4), dg = poisoned(size_t(T * HV) * 4);
  dgps::cuda::GradParams g;
  g.dq = contiguous4(dq, T, H, K);
  expect_refusal("no d_o", dpg.p, g, dq, ws);
  g.d_o = contiguous4(d_o, T, HV, V);
  dgps::cuda::Params exact = dpg.p;
  exact.spec.precond = dgps::precond::Kind::exact_atk;
  expect_refusal("exact preconditioner with a center", exact, g, dq, ws);
  Case dn = make_random("dn", s, {}, 32);
  DeviceCase ddn(dn, DType::f32, DType::f32, dgps::Algorithm::automatic);
  dgps::cuda::GradParams gn;
  gn.d_o = contiguous4(d_o, T, HV, V);
  gn.dg = contiguous4(dg, T, HV, 1);
  expect_refusal("dg without g (dn)", ddn.p, gn, dg, ws);
}

/// dgps::backward with float32 device pointers runs on the CUDA backend (pgdn, varlen, GVA).
void public_api() {
  Case c = make_random("pgdn", {.batch = 1, .time = 150, .heads = 2, .v_heads = 4, .key_dim = 64, .value_dim = 32},
                       {0, 50, 150}, 998);
  const Arrays ref = reference_backward(rounded(c, DType::f32, DType::f32));
  std::map<std::string, DevBuf> b;
  for (const auto& [n, v] : c.arr) b[n] = upload(v, DType::f32);
  for (const auto& [n, v] : ref) b[n] = poisoned(v.size() * 4);
  DevBuf cu(c.cu.size() * 8);
  check_cuda(cudaMemcpy(cu.p, c.cu.data(), cu.bytes, cudaMemcpyHostToDevice), "cu");
  auto f = [&](const char* n) { return static_cast<float*>(b.at(n).p); };
  auto in = dgps::inputs<float>(c.shape, f("q"), f("k"), f("v"));
  in.decay(f("g")).gain(f("beta")).precond(f("g_p"), f("beta_p"), f("center")).initial_state(f("h0"), f("a0"));
  in.varlen(static_cast<const int64_t*>(cu.p), 2);
  const auto gi = dgps::grads_in<float>(f("do"), f("dhT"), f("daT"));
  dgps::Grads<float> gr;
  gr.dq = dgps::Out<float>(f("dq")).view, gr.dk = dgps::Out<float>(f("dk")).view;
  gr.dv = dgps::Out<float>(f("dv")).view, gr.dg = dgps::Out<float>(f("dg")).view;
  gr.dbeta = dgps::Out<float>(f("dbeta")).view, gr.dg_p = dgps::Out<float>(f("dg_p")).view;
  gr.dbeta_p = dgps::Out<float>(f("dbeta_p")).view, gr.dcenter = dgps::Out<float>(f("dcenter")).view;
  gr.dh0 = dgps::Out<float>(f("dh0")).view, gr.da0 = dgps::Out<float>(f("da0")).view;
  const dgps::RunInfo info = dgps::backward<dgps::PGDN>(in, gi, gr);
  check_cuda(cudaDeviceSynchronize(), "dgps::backward");
  report_check(info.backend == dgps::Backend::cuda, std::string("dgps::backward on device pointers chose backend ") +
                                                        dgps::to_string(info.backend) + " (" + info.impl + ")");
  for (const auto& [n, v] : ref)
    report("bwd/api/pgdn/varlen", n.c_str(), dgps_test::rel_err(download(b.at(n), v.size(), DType::f32), v), 1e-4,
           info.impl);
}

/// The gate parameters' gradients: sums over every token of dg times a per-token weight (A_log's gradient is
/// sum_t dg_t g_t per head, or per head and channel with Diagonal decay), on the chunkwise bf16 backward
/// against the reference, at decays from none to strong (g in [-12, 0]) and at mild decay. Each in-chunk pair
/// enters dgamma twice with opposite signs; rounded differently, its residual accumulates through the chunk's
/// reverse sum (0.4 - 0.85 off for GDN, 6e-2 - 1.2e-1 for KDA before both halves took the same operands).
void gate_sums(dgps::cuda::Workspace& ws) {
  uint64_t seed = 9100;
  for (const char* m : {"gdn", "pgdn", "kda", "pkda"})
    for (const double lo : {-12.0, -0.6}) {
      dgps_test::Gen gen;
      gen.g_lo = lo, gen.g_hi = lo < -1 ? 0.0 : -0.02;
      gen.h0 = false;
      const Case c =
          make_random(m, {.batch = 2, .time = 256, .heads = 4, .v_heads = 8, .key_dim = 128, .value_dim = 128}, {},
                      seed++, gen);
      std::string impl;
      const Arrays got = gpu_backward(c, DType::bf16, DType::f32, ws, &impl);
      const Case r = rounded(c, DType::bf16, DType::f32);
      const Arrays ref = reference_backward(r);
      const std::vector<double>& g = r.arr.at("g");
      const size_t per = c.spec.decay == dgps::decay::Kind::diagonal ? size_t(8 * 128) : size_t(8);
      std::vector<double> s_got(per, 0.0), s_ref(per, 0.0);
      for (size_t i = 0; i < g.size(); ++i) {
        s_got[i % per] += got.at("dg")[i] * g[i];
        s_ref[i % per] += ref.at("dg")[i] * g[i];
      }
      const std::string name = std::string("bwd/gate_sums/") + m + (lo < -1 ? "/strong" : "/mild");
      report(name, "sum dg g", rms_rel(s_got, s_ref), 2e-2, impl);
    }
}

}  // namespace

/// The backward-pass tests (declared in gpu_support.hpp).
void backward_tests(dgps::cuda::Workspace& ws, bool quick) {
  conformance(ws, quick);
  random_cases(ws, quick);
  training_forward(ws, quick);
  gate_sums(ws);
  if (quick) return;
  unaligned_outputs(ws);
  validation(ws);
  public_api();
}

}  // namespace dgps_gpu_test
