/// @brief dgps::cuda public entry points: availability, workspace, validation and kernel dispatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch/backward.cuh"
#include "launch/chunk.cuh"
#include "launch/exact.cuh"
#include "dgps/cuda.hpp"
#include "dgps/detail/check.hpp"
#include "plan.hpp"
#include "launch/recurrent.cuh"

namespace dgps::cuda {

namespace {

void throw_on(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a sticky launch error so later calls report their own
    throw Error(std::string("cuda: ") + what + ": " + cudaGetErrorString(e));
  }
}

void require(bool ok, const char* msg) {
  if (!ok) throw Error(std::string("cuda: ") + msg);
}

void copy_strides(int64_t* dst, const Tensor& t) {
  for (int d = 0; d < 3; ++d) dst[d] = t.stride[d];
}

enum class Call { forward, decode, backward };

bool exact_spec(const ModelSpec& s) {
  return s.precond == precond::Kind::exact_atk || s.precond == precond::Kind::exact_atq;
}

/// An exact preconditioner's state tensor `t` ([N, H, K, K]: rows of K elements at stride[2], K rows at stride[1])
/// when given; a diagonal layout [N, H, K] (stride[2] = 1) is refused naming the tensor.
void check_exact_state(const char* name, const Tensor& t, int64_t K) {
  if (!t.data) return;
  if (t.stride[2] < K || t.stride[1] < K * t.stride[2])
    throw Error(std::string("cuda: '") + name + "' of an exact preconditioner must be [N, H, K, K] (K = " +
                std::to_string(K) + "): got strides [" + std::to_string(t.stride[0]) + ", " +
                std::to_string(t.stride[1]) + ", " + std::to_string(t.stride[2]) + ", 1], rows of fewer than K " +
                "elements (a diagonal preconditioner's [N, H, K]?)");
}

/// check.hpp's view of a cuda::Tensor for its presence rules (detail::resolve, detail::reject_unused): the
/// pointer alone (the implicit rank: no host-side shape is implied).
TensorView<const char> presence(const Tensor& t) {
  TensorView<const char> v;
  v.data = static_cast<const char*>(t.data);
  v.rank = t.data ? dgps::detail::kImplicitRank : 0;
  return v;
}

/// The rules the CUDA entry points share with every backend (check.hpp): the options, and which tensors
/// the model needs or must not be given. Their errors carry the "cuda: " prefix of this backend's.
void check_shared(const Params& p, Call call) {
  try {
    Options o;
    if (p.scale != 0.f) o.scale = p.scale;  // (0: the default 1/sqrt(K))
    o.x = p.x, o.eps = p.eps, o.lambda = p.lambda;
    double scale = 0;
    dgps::detail::check_options(o, p.K, scale);
    const std::string model = "by " + dgps::to_string(p.spec);
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"q", &p.q}, {"k", &p.k}, {"v", &p.v}})
      dgps::detail::resolve(name, presence(*t), {}, true, model);
    if (call != Call::backward) dgps::detail::resolve("o", presence(p.o), {}, true, "by the forward");
    if (p.spec.decay == decay::Kind::none)
      dgps::detail::reject_unused("g", presence(p.g), "decay=none uses no g");
    else
      dgps::detail::resolve("g", presence(p.g), {}, true, model);
    if (p.spec.gain == gain::Kind::unit)
      dgps::detail::reject_unused("beta", presence(p.beta), "gain=unit uses no beta");
    else
      dgps::detail::resolve("beta", presence(p.beta), {}, true, model);
    const bool diag = p.spec.precond != precond::Kind::identity;
    const bool exact = p.spec.precond == precond::Kind::exact_atk || p.spec.precond == precond::Kind::exact_atq;
    for (const auto& [name, t] :
         {std::pair<const char*, const Tensor*>{"g_p", &p.g_p}, {"beta_p", &p.beta_p}, {"center", &p.center}}) {
      if (exact && std::string(name) == "center")
        dgps::detail::reject_unused(name, presence(*t), "only the diagonal preconditioners use center");
      else if (diag)
        dgps::detail::resolve(name, presence(*t), {}, true, model);
      else
        dgps::detail::reject_unused(name, presence(*t), std::string("precond=identity uses no ") + name);
    }
    if (!diag) {
      dgps::detail::reject_unused("a0", presence(p.a0), "precond=identity has no preconditioner state");
      dgps::detail::reject_unused("aT", presence(p.aT), "precond=identity has no preconditioner state");
    }
  } catch (const Error& e) {
    throw Error(std::string("cuda: ") + e.what());
  }
}

/// Host-side checks of a call (shapes, pointers, options); device tensor values are not read. The rules
/// every backend shares go through check.hpp (check_shared); the rest are this backend's: its models and
/// sizes, the kernels' index ranges, and what decode needs.
void check(const Params& p, Call call) {
  const bool decode = call == Call::decode;
  if (!supports(p.spec, p.algorithm))
    throw Error("cuda: no " + std::string(dgps::to_string(p.algorithm)) + " algorithm for " + dgps::to_string(p.spec) +
                (exact_spec(p.spec) ? " (the exact preconditioners have no chunkwise form: use the recurrent or automatic "
                                      "algorithm)"
                                    : ""));
  require(p.B >= 1 && p.H >= 1 && p.HV >= 1 && p.T >= 0 && p.N >= 1, "sizes B, H, HV, N must be >= 1 and T >= 0");
  if (p.HV % p.H != 0)
    throw Error("cuda: v_heads (" + std::to_string(p.HV) + ") must be a multiple of heads (" + std::to_string(p.H) +
                ")");
  if (p.K < 1 || p.K > 128) throw Error("cuda: key_dim must be in [1, 128], got " + std::to_string(p.K));
  require(p.V >= 1 && p.V <= (int64_t(1) << 30), "value_dim must be in [1, 2^30]");
  require(p.N <= 65535 && p.HV <= 65535, "at most 65535 sequences and 65535 value heads per call");
  check_shared(p, call);
  if (exact_spec(p.spec)) {
    check_exact_state("a0", p.a0, p.K);
    check_exact_state("aT", p.aT, p.K);
  }
  const bool diag = p.spec.precond != precond::Kind::identity;
  if (p.cu_seqlens) require(p.B == 1, "cu_seqlens requires batch == 1");
  if (!p.cu_seqlens) require(p.N == p.B, "without cu_seqlens N must equal B");
  if (decode) {
    require(!p.cu_seqlens, "decode takes one row per sequence; cu_seqlens is not supported there");
    require(p.h0.data, "decode needs the state 'h' (as h0)");
    require(!p.hT.data || p.hT.data == p.h0.data, "decode updates h in place: hT must be null or equal h0");
    require(!diag || p.a0.data, "decode needs the preconditioner state 'a' (as a0)");
    require(!p.aT.data || p.aT.data == p.a0.data, "decode updates a in place: aT must be null or equal a0");
  } else {
    require(!p.slots, "slots are for decode only");
  }
}

kernels::RecArgs make_args(const Params& p) {
  kernels::RecArgs a;
  a.q = p.q.data, a.k = p.k.data, a.v = p.v.data, a.g = p.g.data, a.beta = p.beta.data;
  a.g_p = p.g_p.data, a.beta_p = p.beta_p.data, a.center = p.center.data;
  a.h0 = static_cast<const float*>(p.h0.data);
  a.a0 = static_cast<const float*>(p.a0.data);
  a.o = const_cast<void*>(p.o.data);
  a.hT = static_cast<float*>(const_cast<void*>(p.hT.data));
  a.aT = static_cast<float*>(const_cast<void*>(p.aT.data));
  copy_strides(a.sq, p.q), copy_strides(a.sk, p.k), copy_strides(a.sv, p.v), copy_strides(a.sg, p.g);
  copy_strides(a.sbeta, p.beta), copy_strides(a.sgp, p.g_p), copy_strides(a.sbp, p.beta_p), copy_strides(a.so, p.o);
  copy_strides(a.sh0, p.h0), copy_strides(a.sa0, p.a0), copy_strides(a.shT, p.hT), copy_strides(a.saT, p.aT);
  a.cu_seqlens = p.cu_seqlens;
  a.slots = p.slots;
  a.T = p.T;
  a.N = static_cast<int>(p.N), a.H = static_cast<int>(p.H), a.HV = static_cast<int>(p.HV);
  a.K = static_cast<int>(p.K), a.V = static_cast<int>(p.V), a.group = static_cast<int>(p.HV / p.H);
  a.decay = static_cast<int>(p.spec.decay);  // none, scalar, diagonal: same order as kernels::DecayKind
  a.precond = p.spec.precond == precond::Kind::identity       ? kernels::kPrecondIdentity
              : p.spec.precond == precond::Kind::diagonal_atk ? kernels::kPrecondATK
              : p.spec.precond == precond::Kind::diagonal_atq ? kernels::kPrecondATQ
              : p.spec.precond == precond::Kind::exact_atk    ? kernels::kPrecondExactATK
                                                              : kernels::kPrecondExactATQ;
  a.gate_dtype = static_cast<int>(p.gate_dtype);
  a.online = p.spec.solve == solve::Kind::online;
  a.l2norm = p.l2norm;
  a.scale = p.scale != 0.f ? p.scale : 1.f / std::sqrt(static_cast<float>(p.K));
  a.log_x = std::log(p.x);
  a.eps = p.eps;
  a.lambda = p.lambda;
  return a;
}

template <class Tin>
cudaError_t launch_typed(const kernels::RecArgs& a, const Plan& plan, cudaStream_t stream, bool decode) {
  return decode ? kernels::launch_decode<Tin>(a, plan, stream) : kernels::launch_forward<Tin>(a, plan, stream);
}

/// Launches the recurrent forward or the decode of `plan` for input type `dtype`; throws on a launch error.
/// Returns the variant's name.
const char* launch(const kernels::RecArgs& a, const Plan& plan, DType dtype, cudaStream_t stream, bool decode) {
  cudaError_t e = cudaSuccess;
  switch (dtype) {
    case DType::f32:
      e = launch_typed<float>(a, plan, stream, decode);
      break;
    case DType::bf16:
      e = launch_typed<__nv_bfloat16>(a, plan, stream, decode);
      break;
    case DType::f16:
      e = launch_typed<__half>(a, plan, stream, decode);
      break;
  }
  throw_on(e, decode ? "decode kernel launch" : "recurrent kernel launch");
  record_plan(plan);
  return impl_name(plan);
}

}  // namespace

Workspace::~Workspace() {
  if (ptr_) cudaFree(ptr_);
  for (void* p : retired_) cudaFree(p);
}

void* Workspace::get(size_t bytes) {
  if (bytes <= bytes_) return ptr_;
  const size_t want = std::max(bytes, bytes_ + bytes_ / 2);
  const size_t rounded = (want + 255) / 256 * 256;
  // Relaxed capture mode for this thread: cudaMalloc is then allowed while a stream captures a graph (it is not
  // part of the graph; the memory is ours either way).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  throw_on(cudaThreadExchangeStreamCaptureMode(&mode), "workspace allocation (capture mode)");
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, rounded);
  cudaThreadExchangeStreamCaptureMode(&mode);
  throw_on(e, "workspace allocation");
  if (ptr_) retired_.push_back(ptr_);  // a captured graph may still read it: freed with the workspace
  ptr_ = p;
  bytes_ = rounded;
  saved_ = 0;
  return ptr_;
}

bool available() {
  static const bool ok = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess && n > 0;
  }();
  return ok;
}

bool is_device_pointer(const void* p) {
  if (!p || !available()) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

namespace {

template <class Tin>
cudaError_t launch_chunk_typed(const kernels::ChunkArgs& c, Plan& plan, cudaStream_t s) {
  return kernels::launch_chunkwise<Tin>(c, plan, s);
}

/// Whether t's base is aligned to `bytes` and every stride is a multiple of `elems` elements.
bool aligned_rows(const Tensor& t, size_t bytes, int64_t elems) {
  return reinterpret_cast<uintptr_t>(t.data) % bytes == 0 && t.stride[0] % elems == 0 && t.stride[1] % elems == 0 &&
         t.stride[2] % elems == 0;
}

/// 16-byte row loads: aligned base, every stride and the row length a multiple of 8 elements.
bool vec_rows(const Tensor& t, int64_t d) { return aligned_rows(t, 16, 8) && d % 8 == 0; }

/// Two-element writes: base aligned to two elements of `d` and every stride even.
bool pair_rows(const Tensor& t, DType d) { return aligned_rows(t, d == DType::f32 ? 8 : 4, 2); }

/// The chunkwise kernels' arguments of call `p` (workspace pointers unset); `bwd`: in backward mode
/// (ChunkArgs::bwd).
kernels::ChunkArgs make_chunk_args(const Params& p, const kernels::RecArgs& a, bool bwd = false) {
  kernels::ChunkArgs c;
  c.a = a;
  c.bwd = bwd;
  const int64_t per = (p.T + kernels::kChunk - 1) / kernels::kChunk;
  c.chunks_per_seq = p.cu_seqlens ? 0 : per;
  c.chunk_bound = p.cu_seqlens ? per + p.N : p.B * per;
  c.Vpad = static_cast<int>((p.V + 63) / 64 * 64);
  c.state_vt = kernels::state_value_tile(a, c.Vpad, !bwd);
  c.vec_qk = vec_rows(p.q, p.K) && vec_rows(p.k, p.K);
  c.vec_v = vec_rows(p.v, p.V);
  c.pair_o = pair_rows(p.o, p.dtype);
  c.vec_o = vec_rows(p.o, p.V);
  return c;
}

/// Launches the chunkwise kernels of `c` (workspace laid out) with `plan` for input type `d`; throws on a
/// launch error. Returns the variant's name.
const char* run_chunkwise(const kernels::ChunkArgs& c, Plan& plan, DType d, cudaStream_t s) {
  cudaError_t e = cudaSuccess;
  switch (d) {
    case DType::f32:
      e = launch_chunk_typed<float>(c, plan, s);
      break;
    case DType::bf16:
      e = launch_chunk_typed<__nv_bfloat16>(c, plan, s);
      break;
    case DType::f16:
      e = launch_chunk_typed<__half>(c, plan, s);
      break;
  }
  throw_on(e, "chunkwise kernel launch");
  record_plan(plan);
  return impl_name(plan);
}

const char* launch_chunkwise(const Params& p, const kernels::RecArgs& a, Plan& plan, Workspace& ws, cudaStream_t s) {
  kernels::ChunkArgs c = make_chunk_args(p, a);
  plan_chunkwise(plan, p, c);
  void* base = ws.get(kernels::chunk_workspace(c, nullptr));
  kernels::chunk_workspace(c, base);
  return run_chunkwise(c, plan, p.dtype, s);
}

/// The exact kernels' arguments of call `p` (`b`: the forward's inputs and, for the backward, the gradients).
kernels::ExactArgs make_exact_args(const Params& p, const kernels::BwdArgs& b) {
  kernels::ExactArgs e;
  e.b = b;
  e.KP = kernels::exact_keys(static_cast<int>(p.K));
  e.ncb = static_cast<int>((p.V + kernels::kExactCols - 1) / kernels::kExactCols);
  e.rows = p.B * p.T;
  e.slots = e.rows / kernels::kExactChunk + p.N + 1;
  return e;
}

/// Launches the exact kernels of `plan` on `e` (workspace laid out) for input type d; throws on a launch error.
const char* run_exact(const kernels::ExactArgs& e, const Plan& plan, DType d, cudaStream_t s) {
  cudaError_t err = cudaSuccess;
  switch (d) {
    case DType::f32:
      err = kernels::launch_exact<float>(e, plan, s);
      break;
    case DType::bf16:
      err = kernels::launch_exact<__nv_bfloat16>(e, plan, s);
      break;
    case DType::f16:
      err = kernels::launch_exact<__half>(e, plan, s);
      break;
  }
  throw_on(err, "exact kernel launch");
  record_plan(plan);
  return impl_name(plan);
}

/// The forward or decode of an exact preconditioner (`a` as the caller set it up).
const char* exact_forward(const Params& p, const kernels::RecArgs& a, Plan::Kernel kernel, Workspace& ws,
                          cudaStream_t s) {
  kernels::BwdArgs b;
  b.a = a;
  kernels::ExactArgs e = make_exact_args(p, b);
  void* base = ws.get(kernels::exact_workspace(e, false, nullptr));
  kernels::exact_workspace(e, false, base);
  return run_exact(e, plan_exact(kernel, a), p.dtype, s);
}

}  // namespace

const char* forward(const Params& p, Workspace& ws, void* stream) {
  require(available(), "no usable GPU");
  check(p, Call::forward);
  ws.set_saved_forward(0);
  const kernels::RecArgs a = make_args(p);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (exact_spec(p.spec)) return exact_forward(p, a, Plan::Kernel::exact_forward, ws, s);
  Plan plan = plan_forward(p, a);
  if (plan.kernel == Plan::Kernel::chunkwise) return launch_chunkwise(p, a, plan, ws, s);
  return launch(a, plan, p.dtype, s, false);
}

const char* decode(const Params& p, Workspace& ws, void* stream) {
  require(available(), "no usable GPU");
  check(p, Call::decode);
  ws.set_saved_forward(0);
  kernels::RecArgs a = make_args(p);
  a.hT = const_cast<float*>(a.h0);
  for (int d = 0; d < 3; ++d) a.shT[d] = a.sh0[d];
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (exact_spec(p.spec)) {  // P in place (each block reads its P before it writes it back)
    a.aT = const_cast<float*>(a.a0);
    for (int d = 0; d < 3; ++d) a.saT[d] = a.sa0[d];
    return exact_forward(p, a, Plan::Kernel::exact_decode, ws, s);
  }
  if (a.precond != kernels::kPrecondIdentity) {  // statistics in place; scratch for a private copy
    a.aT = const_cast<float*>(a.a0);
    for (int d = 0; d < 3; ++d) a.saT[d] = a.sa0[d];
    a.a_copy = static_cast<float*>(ws.get(sizeof(float) * size_t(p.N) * size_t(p.H) * size_t(p.K)));
  }
  return launch(a, plan_decode(a), p.dtype, s, true);
}

namespace {

/// Host-side checks of a backward's cotangents and gradient destinations against the forward call `p`.
void check_grads(const Params& p, const GradParams& g) {
  require(p.spec.precond != precond::Kind::identity || (!g.daT.data && !g.da0.data && !g.dg_p.data &&
                                                        !g.dbeta_p.data && !g.dcenter.data),
          "precond=identity has no daT, da0, dg_p, dbeta_p or dcenter");
  require(g.d_o.data, "the cotangent 'd_o' is required");
  auto given_only_with = [](const Tensor& grad, const Tensor& input, const char* name) {
    if (grad.data && !input.data)
      throw Error(std::string("cuda: gradient '") + name + "' was requested but its input is absent");
  };
  given_only_with(g.dg, p.g, "dg");
  given_only_with(g.dbeta, p.beta, "dbeta");
  given_only_with(g.dg_p, p.g_p, "dg_p");
  given_only_with(g.dbeta_p, p.beta_p, "dbeta_p");
  given_only_with(g.dcenter, p.center, "dcenter");
  if (exact_spec(p.spec)) {
    check_exact_state("daT", g.daT, p.K);
    check_exact_state("da0", g.da0, p.K);
  }
}

/// The backward's exact-kernel arguments of `p` (the forward's outputs are not written).
kernels::ExactArgs exact_backward_args(const Params& p, const kernels::BwdArgs& b) {
  kernels::ExactArgs e = make_exact_args(p, b);
  e.b.a.o = nullptr, e.b.a.hT = nullptr, e.b.a.aT = nullptr;
  e.save = true;
  return e;
}

kernels::BwdArgs make_bwd_args(const Params& p, const GradParams& g) {
  kernels::BwdArgs b;
  b.a = make_args(p);
  b.d_o = g.d_o.data;
  b.dhT = static_cast<const float*>(g.dhT.data);
  b.daT = static_cast<const float*>(g.daT.data);
  auto out = [](const Tensor& t) { return const_cast<void*>(t.data); };
  b.dq = out(g.dq), b.dk = out(g.dk), b.dv = out(g.dv), b.dg = out(g.dg), b.dbeta = out(g.dbeta);
  b.dgp = out(g.dg_p), b.dbp = out(g.dbeta_p), b.dcenter = out(g.dcenter);
  b.dh0 = static_cast<float*>(out(g.dh0));
  b.da0 = static_cast<float*>(out(g.da0));
  copy_strides(b.sdo, g.d_o), copy_strides(b.sdhT, g.dhT), copy_strides(b.sdaT, g.daT);
  copy_strides(b.sdq, g.dq), copy_strides(b.sdk, g.dk), copy_strides(b.sdv, g.dv), copy_strides(b.sdg, g.dg);
  b.pair_dq = pair_rows(g.dq, p.dtype), b.pair_dk = pair_rows(g.dk, p.dtype), b.pair_dv = pair_rows(g.dv, p.dtype);
  copy_strides(b.sdbeta, g.dbeta), copy_strides(b.sdgp, g.dg_p), copy_strides(b.sdbp, g.dbeta_p);
  copy_strides(b.sdh0, g.dh0), copy_strides(b.sda0, g.da0);
  b.Kp = p.K <= 64 ? 64 : 128;
  b.rows = p.B * p.T;
  b.slots = b.rows / kernels::kBwdChunk + 2 * p.N + 1;
  return b;
}

template <class Tin>
cudaError_t launch_bwd_typed(const kernels::BwdArgs& b, cudaStream_t s) {
  return kernels::launch_backward<Tin>(b, s);
}

/// A fingerprint of everything in `p` that a training forward's saved activations depend on (FNV-1a over
/// the sizes, options and every input's pointer and strides); never 0.
uint64_t fingerprint(const Params& p) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((x >> (8 * i)) & 0xffu)) * 1099511628211ull;
  };
  auto mixf = [&](float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    mix(u);
  };
  mix(uint64_t(p.spec.decay)), mix(uint64_t(p.spec.gain)), mix(uint64_t(p.spec.precond)), mix(uint64_t(p.spec.solve));
  mix(uint64_t(p.dtype)), mix(uint64_t(p.gate_dtype)), mix(uint64_t(p.algorithm)), mix(uint64_t(p.l2norm));
  for (int64_t x : {p.B, p.T, p.H, p.HV, p.K, p.V, p.N}) mix(uint64_t(x));
  for (const Tensor* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.g_p, &p.beta_p, &p.center, &p.h0, &p.a0}) {
    mix(reinterpret_cast<uintptr_t>(t->data));
    for (int64_t s : t->stride) mix(uint64_t(s));
  }
  mix(reinterpret_cast<uintptr_t>(p.cu_seqlens));
  mixf(p.scale), mixf(p.x), mixf(p.eps);
  return h ? h : 1;
}

/// The backward's arguments and workspace layout: with the chunkwise kernels (`c` non-null), their
/// 16-bit tiles follow the float32 arrays. Returns the total bytes; points everything into `base`.
size_t layout_backward(kernels::BwdArgs& b, kernels::ChunkArgs* c, void* base) {
  const size_t head = (kernels::bwd_workspace(b, base) + 255) / 256 * 256;
  if (!c) return head;
  c->rq = b.rq, c->rk = b.rk;  // no norm pass: the intra kernel writes the norms
  return head + kernels::chunk_workspace(*c, base ? static_cast<char*>(base) + head : nullptr);
}

/// Sets up the chunkwise backward's arguments of `p` in `c` (null when `plan` is not chunkwise) and returns them.
kernels::ChunkArgs* chunk_backward_args(const Params& p, const Plan& plan, const GradParams& g, kernels::BwdArgs& b,
                                        kernels::ChunkArgs& c, bool training_forward = false) {
  if (plan.kernel != Plan::Kernel::backward_chunkwise) return nullptr;
  kernels::RecArgs a = b.a;
  if (!training_forward) a.o = nullptr, a.hT = nullptr, a.aT = nullptr;  // the forward's outputs are not written
  c = make_chunk_args(p, a, true);
  c.vec_do = vec_rows(g.d_o, p.V);
  b.chunk = &c;
  return &c;
}

}  // namespace

size_t backward_workspace_bytes(const Params& p) {
  kernels::BwdArgs b = make_bwd_args(p, GradParams{});
  if (exact_spec(p.spec)) {
    kernels::ExactArgs e = exact_backward_args(p, b);
    return kernels::exact_workspace(e, true, nullptr);
  }
  kernels::ChunkArgs c;
  return layout_backward(b, chunk_backward_args(p, plan_backward(p, b.a), GradParams{}, b, c), nullptr);
}

const char* forward_training(const Params& p, Workspace& ws, void* stream) {
  require(available(), "no usable GPU");
  check(p, Call::forward);
  if (exact_spec(p.spec)) return forward(p, ws, stream);  // the exact backward keeps nothing from the forward
  kernels::BwdArgs b = make_bwd_args(p, GradParams{});
  kernels::ChunkArgs c;
  kernels::ChunkArgs* cp = chunk_backward_args(p, plan_backward(p, b.a), GradParams{}, b, c, true);
  if (!cp) return forward(p, ws, stream);  // the backward is not chunkwise: nothing to keep
  void* base = ws.get(layout_backward(b, cp, nullptr));
  layout_backward(b, cp, base);
  ws.set_saved_forward(0);  // until the launch succeeded
  Plan plan = plan_backward_mode(c);
  const char* impl = run_chunkwise(c, plan, p.dtype, static_cast<cudaStream_t>(stream));
  ws.set_saved_forward(fingerprint(p));
  return impl;
}

const char* backward(const Params& p, const GradParams& g, Workspace& ws, void* stream) {
  require(available(), "no usable GPU");
  check(p, Call::backward);
  check_grads(p, g);
  kernels::BwdArgs b = make_bwd_args(p, g);
  if (exact_spec(p.spec)) {
    ws.set_saved_forward(0);
    kernels::ExactArgs e = exact_backward_args(p, b);
    void* base = ws.get(kernels::exact_workspace(e, true, nullptr));
    kernels::exact_workspace(e, true, base);
    return run_exact(e, plan_exact(Plan::Kernel::exact_backward, e.b.a), p.dtype, static_cast<cudaStream_t>(stream));
  }
  kernels::ChunkArgs c;
  Plan plan = plan_backward(p, b.a);
  kernels::ChunkArgs* cp = chunk_backward_args(p, plan, g, b, c);
  void* base = ws.get(layout_backward(b, cp, nullptr));
  layout_backward(b, cp, base);
  if (cp) c.saved = ws.saved_forward() != 0 && ws.saved_forward() == fingerprint(p);
  ws.set_saved_forward(0);  // the backward overwrites the saved tiles
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaSuccess;
  switch (p.dtype) {
    case DType::f32: e = launch_bwd_typed<float>(b, s); break;
    case DType::bf16: e = launch_bwd_typed<__nv_bfloat16>(b, s); break;
    case DType::f16: e = launch_bwd_typed<__half>(b, s); break;
  }
  throw_on(e, "backward kernel launch");
  plan.saved = cp && c.saved;
  record_plan(plan);
  return impl_name(plan);
}

}  // namespace dgps::cuda
