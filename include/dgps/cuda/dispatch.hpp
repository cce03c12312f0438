/// @brief The CUDA branch of dgps::forward / backward / decode: device-tensor validation and the call into dgps::cuda.
///
/// Included by dgps/dgps.hpp only when DGPS_HAS_CUDA is defined (targets linking dgps::cuda).
/// Validation reads shapes, strides and options on the host; the values of device `cu_seqlens` and
/// `slots` are the caller's contract on the GPU (monotone, ending at T; distinct slots inside the
/// pool), since reading them would need a host synchronisation.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dgps/backend.hpp"
#include "dgps/cuda.hpp"
#include "dgps/detail/check.hpp"
#include "dgps/detail/problem.hpp"
#include "dgps/error.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/types.hpp"

namespace dgps::detail {

/// True when a call with these options and this query pointer runs on the CUDA backend: asked for
/// explicitly (or through DGPS_BACKEND=cuda), or `automatic` with the data in device memory.
inline bool wants_cuda(Backend requested, const void* q) {
  if (requested == Backend::cuda) return true;
  if (requested != Backend::automatic) return false;
  const char* env = std::getenv("DGPS_BACKEND");
  if (env && *env) return backend_from_string(env) == Backend::cuda;
  return cuda::is_device_pointer(q);
}

/// Host placeholder offsets [0, T, ..., T] with which the shape rules of check.hpp are applied to
/// a device `cu_seqlens` of the same length.
inline std::vector<int64_t> placeholder_offsets(const TensorView<const int64_t>& cu, int64_t T) {
  std::vector<int64_t> h(static_cast<size_t>(cu.rank == 1 && cu.size[0] > 0 ? cu.size[0] : 2), T);
  h[0] = 0;
  return h;
}

/// `in` with a device `cu_seqlens` replaced by host placeholder offsets (kept alive in `cu`), for the
/// host-side shape checks of check.hpp.
template <class T>
Inputs<T> host_inputs(const Inputs<T>& in, std::vector<int64_t>& cu) {
  Inputs<T> host = in;
  if (in.cu_seqlens.data) {
    cu = placeholder_offsets(in.cu_seqlens, in.shape.time);
    host.cu_seqlens = TensorView<const int64_t>(cu.data(), {static_cast<int64_t>(cu.size())});
  }
  return host;
}

/// The dgps::cuda element type of T; float64 has no CUDA kernels (a dgps::Error).
template <class T>
cuda::DType cuda_dtype() {
  if constexpr (std::is_same_v<T, float>)
    return cuda::DType::f32;
  else if constexpr (std::is_same_v<T, bf16>)
    return cuda::DType::bf16;
  else if constexpr (std::is_same_v<T, f16>)
    return cuda::DType::f16;
  else
    throw Error(
        "backend 'cuda' has no float64 kernels: pass float32, bfloat16 or float16 tensors, or run float64 "
        "on the cpu or reference backend");
}

/// The Params of a validated Problem whose tensors are device pointers: q, k, v, o and the gates of type T,
/// states float32 (`cu_seqlens` and `slots` are passed separately: they are device pointers too).
template <class T>
cuda::Params cuda_params(const Problem<T>& p, const int64_t* cu_seqlens, const int64_t* slots, Algorithm algorithm) {
  using cuda::detail::tensor_of;
  cuda::Params c;
  c.spec = p.spec;
  c.dtype = cuda_dtype<T>();
  c.gate_dtype = c.dtype;  // the unified API takes the gates in the inputs' type
  c.B = p.B, c.T = p.T_, c.H = p.H, c.HV = p.HV, c.K = p.K, c.V = p.V, c.N = p.N;
  c.q = tensor_of(p.q), c.k = tensor_of(p.k), c.v = tensor_of(p.v), c.g = tensor_of(p.g), c.beta = tensor_of(p.beta);
  c.g_p = tensor_of(p.g_p), c.beta_p = tensor_of(p.beta_p), c.center = tensor_of(p.center);
  c.h0 = tensor_of(p.h0), c.a0 = tensor_of(p.a0);
  c.o = tensor_of(p.o), c.hT = tensor_of(p.hT), c.aT = tensor_of(p.aT);
  c.cu_seqlens = cu_seqlens;
  c.slots = slots;
  c.scale = static_cast<float>(p.scale);
  c.x = static_cast<float>(p.x);
  c.eps = static_cast<float>(p.eps);
  c.lambda = static_cast<float>(p.lambda);
  c.l2norm = p.l2norm;
  c.algorithm = algorithm;
  return c;
}

/// The algorithm a dgps::cuda kernel name reports ("cuda/chunkwise/...", "cuda/backward/chunkwise": chunkwise).
inline Algorithm cuda_algorithm_of(const char* impl) {
  return std::string_view(impl).find("/chunkwise") != std::string_view::npos ? Algorithm::chunkwise
                                                                             : Algorithm::recurrent;
}

/// Throws unless the CUDA backend is usable and has `algorithm` for model R (the checks every CUDA entry
/// point makes before validating the tensors).
template <class R, class T>
void require_cuda(Algorithm algorithm, const char* what) {
  (void)cuda_dtype<T>();
  if (!cuda_available()) select_backend(Backend::cuda);  // throws the 'not available' error
  if (!cuda::supports(spec_of<R>(), algorithm))
    throw Error(std::string("backend 'cuda' has no ") + to_string(algorithm) + " " + what + " for " +
                to_string(spec_of<R>()));
}

/// dgps::forward on the CUDA backend (device pointers, default stream, asynchronous): float32, bfloat16
/// or float16 inputs (gates in the same type), float32 states.
template <class R, class T>
RunInfo cuda_forward(const Inputs<T>& in, const Outputs<T>& out, const Options& opt) {
  require_cuda<R, T>(opt.algorithm, "algorithm");
  std::vector<int64_t> cu;
  const Inputs<T> host = host_inputs(in, cu);
  const Problem<T> p = check_forward<R>(host, out, opt);
  cuda::Workspace ws;
  const char* impl = cuda::forward(cuda_params(p, in.cu_seqlens.data, nullptr, opt.algorithm), ws, nullptr);
  RunInfo info{Backend::cuda, cuda_algorithm_of(impl), impl};
  report("forward", info);
  return info;
}

/// The cotangents and gradient destinations of a validated backward Problem (device pointers).
template <class T>
cuda::GradParams grad_params_from(const Problem<T>& p) {
  using cuda::detail::tensor_of;
  cuda::GradParams g;
  g.d_o = tensor_of(p.d_o), g.dhT = tensor_of(p.dhT), g.daT = tensor_of(p.daT);
  g.dq = tensor_of(p.dq), g.dk = tensor_of(p.dk), g.dv = tensor_of(p.dv);
  g.dg = tensor_of(p.dg), g.dbeta = tensor_of(p.dbeta);
  g.dg_p = tensor_of(p.dg_p), g.dbeta_p = tensor_of(p.dbeta_p), g.dcenter = tensor_of(p.dcenter);
  g.dh0 = tensor_of(p.dh0), g.da0 = tensor_of(p.da0);
  return g;
}

/// dgps::backward on the CUDA backend (device pointers, default stream, asynchronous). Allocates its
/// workspace per call (freed before returning); use dgps::cuda::backward with a reused
/// dgps::cuda::Workspace on hot paths. `opt.algorithm` picks dgps::cuda::backward's algorithm (automatic:
/// chunkwise for 16-bit inputs where it covers the call, recurrent for float32).
template <class R, class T>
RunInfo cuda_backward(const Inputs<T>& in, const GradsIn<T>& gin, const Grads<T>& grads, const Options& opt) {
  require_cuda<R, T>(opt.algorithm, "backward");  // cuda::supports_backward is the forward's coverage
  std::vector<int64_t> cu;
  const Inputs<T> host = host_inputs(in, cu);
  const Problem<T> p = check_backward<R>(host, gin, grads, opt);
  cuda::Workspace ws;
  const cuda::Params cp = cuda_params(p, in.cu_seqlens.data, nullptr, opt.algorithm);
  const char* impl = cuda::backward(cp, grad_params_from(p), ws, nullptr);
  RunInfo info{Backend::cuda, cuda_algorithm_of(impl), impl};
  report("backward", info);
  return info;
}

/// dgps::decode on the CUDA backend (device pointers, default stream, asynchronous). Allocates a
/// small workspace per call for the preconditioner state; use dgps::cuda::decode with a reused
/// dgps::cuda::Workspace on hot paths.
template <class R, class T>
RunInfo cuda_decode(const DecodeState<T>& state, const Inputs<T>& tokens, Out<T> o, const Options& opt) {
  require_cuda<R, T>(Algorithm::recurrent, "decode");
  if (state.layout != StateLayout::k_major)
    throw Error("decode on the cuda backend takes K-major states h [P, HV, K, V] only (DecodeState::layout); the "
                "cpu backend takes K-last ones");
  DecodeState<T> host = state;
  std::vector<int64_t> ids;
  if (state.slots.data) {  // device slots: the host checks their shape on placeholder values
    ids.resize(static_cast<size_t>(state.slots.rank == 1 ? state.slots.size[0] : 0));
    std::iota(ids.begin(), ids.end(), int64_t(0));
    host.slots = TensorView<const int64_t>(ids.data(), {static_cast<int64_t>(ids.size())});
  }
  const Problem<T> p = check_decode<R>(host, tokens, o, opt);
  cuda::Workspace ws;
  const char* impl = cuda::decode(cuda_params(p, nullptr, state.slots.data, Algorithm::recurrent), ws, nullptr);
  RunInfo info{Backend::cuda, Algorithm::recurrent, impl};
  report("decode", info);
  return info;
}

}  // namespace dgps::detail
