/// @brief The CUDA implementation of torch.ops.dgps.forward / backward: dgps::cuda on PyTorch's current stream.
///
/// Any diagonal or identity-preconditioned model runs here (the model is a run-time ModelSpec, no templates).
/// A training forward (`save`) keeps its activations in the workspace of its (device, stream); the backward
/// that follows on the same stream with the same inputs reuses them, any other call recomputes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include <dgps/cuda.hpp>

#include "common.hpp"
#include "ops.hpp"

namespace dgps_torch {
namespace {

dgps::cuda::DType dtype_of(at::ScalarType st, const char* what) {
  switch (st) {
    case at::kFloat:
      return dgps::cuda::DType::f32;
    case at::kBFloat16:
      return dgps::cuda::DType::bf16;
    case at::kHalf:
      return dgps::cuda::DType::f16;
    default:
      TORCH_CHECK(false, "dgps (CUDA): ", what, " must be float32, bfloat16 or float16, got ", st);
  }
}

dgps::cuda::Tensor tensor_of(const Tensor& t, const char* what) {
  if (!t.defined() || t.numel() == 0) return {};
  TORCH_CHECK(t.is_cuda(), "dgps (CUDA): ", what, " must be a CUDA tensor like q");
  TORCH_CHECK(t.dim() <= 4, "dgps (CUDA): ", what, " has more than 4 dimensions");
  TORCH_CHECK(t.dim() == 1 || t.stride(t.dim() - 1) == 1, "dgps (CUDA): the last dimension of ", what,
              " must be contiguous (stride 1), got strides ", t.strides());
  dgps::cuda::Tensor r;
  r.data = t.data_ptr();
  for (int d = 0; d < 3; ++d) r.stride[d] = d < t.dim() ? t.stride(d) : 0;
  return r;
}
dgps::cuda::Tensor tensor_of(const OptTensor& t, const char* what) {
  return given(t) ? tensor_of(*t, what) : dgps::cuda::Tensor{};
}

dgps::cuda::Params params_of(const Args& a) {
  TORCH_CHECK(a.opt.backend == dgps::Backend::automatic || a.opt.backend == dgps::Backend::cuda, "dgps: backend '",
              dgps::to_string(a.opt.backend), "' cannot run CUDA tensors");
  dgps::cuda::Params p;
  p.spec = a.spec;
  p.dtype = dtype_of(a.q.scalar_type(), "q");
  TORCH_CHECK(a.k.scalar_type() == a.q.scalar_type() && a.v.scalar_type() == a.q.scalar_type(),
              "dgps (CUDA): q, k and v must have one dtype");
  bool gate_set = false;
  for (const OptTensor* t : {&a.g, &a.beta, &a.g_p, &a.beta_p, &a.center})
    if (given(*t)) {
      const dgps::cuda::DType d = dtype_of((*t)->scalar_type(), "a gate");
      TORCH_CHECK(!gate_set || d == p.gate_dtype, "dgps (CUDA): g, beta, g_p, beta_p and center must have one dtype");
      p.gate_dtype = d, gate_set = true;
    }
  for (const OptTensor* t : {&a.h0, &a.a0})
    TORCH_CHECK(!given(*t) || (*t)->scalar_type() == at::kFloat, "dgps (CUDA): initial states must be float32");
  p.B = a.q.size(0), p.T = a.q.size(1), p.H = a.q.size(2), p.HV = a.v.size(2), p.K = a.q.size(3), p.V = a.v.size(3);
  p.N = num_seqs(a);
  p.q = tensor_of(a.q, "q"), p.k = tensor_of(a.k, "k"), p.v = tensor_of(a.v, "v");
  p.g = tensor_of(a.g, "g"), p.beta = tensor_of(a.beta, "beta"), p.g_p = tensor_of(a.g_p, "g_p");
  p.beta_p = tensor_of(a.beta_p, "beta_p"), p.center = tensor_of(a.center, "center");
  p.h0 = tensor_of(a.h0, "h0"), p.a0 = tensor_of(a.a0, "a0");
  if (given(a.cu_seqlens)) {
    TORCH_CHECK(a.cu_seqlens->is_cuda() && a.cu_seqlens->scalar_type() == at::kLong && a.cu_seqlens->is_contiguous(),
                "dgps (CUDA): cu_seqlens must be a contiguous int64 CUDA tensor");
    p.cu_seqlens = a.cu_seqlens->data_ptr<int64_t>();
  }
  p.scale = a.opt.scale ? float(*a.opt.scale) : 0.f;
  p.x = float(a.opt.x), p.eps = float(a.opt.eps), p.l2norm = a.opt.l2norm_qk;
  p.algorithm = a.opt.algorithm;
  return p;
}

// One workspace per (device, stream): dgps::cuda::Workspace is not thread-safe and is reused across calls.
std::mutex g_ws_mutex;
std::map<std::pair<int, void*>, std::unique_ptr<dgps::cuda::Workspace>> g_ws;

dgps::cuda::Workspace& workspace(int device, void* stream) {
  std::lock_guard<std::mutex> lock(g_ws_mutex);
  auto& w = g_ws[{device, stream}];
  if (!w) w = std::make_unique<dgps::cuda::Workspace>();
  return *w;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> forward_cuda(
    const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
    const OptTensor& beta, const OptTensor& g_p, const OptTensor& beta_p, const OptTensor& center, const OptTensor& h0,
    const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale, bool l2norm, double x, double eps,
    double lamb, bool output_final_state, bool save, const std::string& backend, int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Args a = make_args(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps,
                           lamb, backend, chunk_size);
  dgps::cuda::Params p = params_of(a);
  const auto opts = q.options();
  Tensor o = at::empty({q.size(0), q.size(1), v.size(2), v.size(3)}, opts);
  const StateShapes ss = state_shapes(a);
  const auto f32 = opts.dtype(at::kFloat);
  Tensor hT = at::empty(output_final_state ? at::IntArrayRef(ss.h) : at::IntArrayRef{0}, f32);
  Tensor aT = at::empty(output_final_state && !ss.a.empty() ? at::IntArrayRef(ss.a) : at::IntArrayRef{0}, f32);
  p.o = tensor_of(o, "o"), p.hT = tensor_of(hT, "hT"), p.aT = tensor_of(aT, "aT");
  void* stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dgps::cuda::Workspace& ws = workspace(q.device().index(), stream);
  if (save)
    dgps::cuda::forward_training(p, ws, stream);
  else
    dgps::cuda::forward(p, ws, stream);
  return {o, hT, aT, at::zeros({}, at::TensorOptions().dtype(at::kLong))};
}

std::vector<Tensor> backward_cuda(const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const OptTensor& g, const OptTensor& beta, const OptTensor& g_p,
                                  const OptTensor& beta_p, const OptTensor& center, const OptTensor& h0,
                                  const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale,
                                  bool l2norm, double x, double eps, double lamb, const std::string& backend,
                                  int64_t chunk_size, const Tensor& d_o, const OptTensor& dhT, const OptTensor& daT,
                                  const Tensor& /*handle*/) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Args a = make_args(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps,
                           lamb, backend, chunk_size);
  const dgps::cuda::Params p = params_of(a);
  const GradTensors r = allocate_grads(a);
  dgps::cuda::GradParams gp;
  TORCH_CHECK(d_o.scalar_type() == q.scalar_type(), "dgps (CUDA): the gradient of o must have q's dtype");
  gp.d_o = tensor_of(d_o, "do"), gp.dhT = tensor_of(dhT, "dhT"), gp.daT = tensor_of(daT, "daT");
  gp.dq = tensor_of(r.dq, "dq"), gp.dk = tensor_of(r.dk, "dk"), gp.dv = tensor_of(r.dv, "dv");
  gp.dg = tensor_of(r.dg, "dg"), gp.dbeta = tensor_of(r.dbeta, "dbeta"), gp.dg_p = tensor_of(r.dg_p, "dg_p");
  gp.dbeta_p = tensor_of(r.dbeta_p, "dbeta_p"), gp.dcenter = tensor_of(r.dcenter, "dcenter");
  gp.dh0 = tensor_of(r.dh0, "dh0"), gp.da0 = tensor_of(r.da0, "da0");
  void* stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dgps::cuda::backward(p, gp, workspace(q.device().index(), stream), stream);
  return grads_list(r);
}

}  // namespace
}  // namespace dgps_torch

TORCH_LIBRARY_IMPL(dgps, CUDA, m) {
  m.impl("forward", &dgps_torch::forward_cuda);
  m.impl("backward", &dgps_torch::backward_cuda);
}
