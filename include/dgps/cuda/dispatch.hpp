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

template <class T>
void require_float_for_cuda() {
  if constexpr (!std::is_same_v<T, float>)
    throw Error("backend 'cuda' takes float32 tensors through dgps::forward/backward/decode; call "
                "dgps::cuda::forward or dgps::cuda::backward directly for bfloat16 or float16");
}

/// dgps::forward on the CUDA backend (device pointers, default stream, asynchronous).
template <class R, class T>
RunInfo cuda_forward(const Inputs<T>& in, const Outputs<T>& out, const Options& opt) {
  require_float_for_cuda<T>();
  if (!cuda_available()) select_backend(Backend::cuda);  // throws the 'not available' error
  if (!cuda::supports(spec_of<R>(), opt.algorithm))
    throw Error(std::string("backend 'cuda' has no ") + to_string(opt.algorithm) + " algorithm for " +
                to_string(spec_of<R>()));
  if constexpr (std::is_same_v<T, float>) {
    std::vector<int64_t> cu;
    const Inputs<T> host = host_inputs(in, cu);
    const Problem<T> p = check_forward<R>(host, out, opt);
    cuda::Workspace ws;
    const cuda::Params cp = cuda::params_from(p, in.cu_seqlens.data, nullptr, opt.algorithm);
    RunInfo info{Backend::cuda, Algorithm::recurrent, cuda::forward(cp, ws, nullptr)};
    report("forward", info);
    return info;
  } else {
    return {};
  }
}

/// The cotangents and gradient destinations of a validated float32 backward Problem (device pointers).
inline cuda::GradParams grad_params_from(const Problem<float>& p) {
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
/// dgps::cuda::Workspace on hot paths. The CUDA backward has one algorithm (recurrent): `chunkwise`
/// is refused.
template <class R, class T>
RunInfo cuda_backward(const Inputs<T>& in, const GradsIn<T>& gin, const Grads<T>& grads, const Options& opt) {
  require_float_for_cuda<T>();
  if (!cuda_available()) select_backend(Backend::cuda);  // throws the 'not available' error
  if (!cuda::supports_backward(spec_of<R>()) || opt.algorithm == Algorithm::chunkwise)
    throw Error(std::string("backend 'cuda' has no ") + to_string(opt.algorithm) + " backward for " +
                to_string(spec_of<R>()));
  if constexpr (std::is_same_v<T, float>) {
    std::vector<int64_t> cu;
    const Inputs<T> host = host_inputs(in, cu);
    const Problem<T> p = check_backward<R>(host, gin, grads, opt);
    cuda::Workspace ws;
    const cuda::Params cp = cuda::params_from(p, in.cu_seqlens.data, nullptr, Algorithm::recurrent);
    RunInfo info{Backend::cuda, Algorithm::recurrent, cuda::backward(cp, grad_params_from(p), ws, nullptr)};
    report("backward", info);
    return info;
  } else {
    return {};
  }
}

/// dgps::decode on the CUDA backend (device pointers, default stream, asynchronous). Allocates a
/// small workspace per call for the preconditioner state; use dgps::cuda::decode with a reused
/// dgps::cuda::Workspace on hot paths.
template <class R, class T>
RunInfo cuda_decode(const DecodeState<T>& state, const Inputs<T>& tokens, Out<T> o, const Options& opt) {
  require_float_for_cuda<T>();
  if (!cuda_available()) select_backend(Backend::cuda);
  if (!cuda::supports(spec_of<R>(), Algorithm::recurrent))
    throw Error(std::string("backend 'cuda' has no decode for ") + to_string(spec_of<R>()));
  if constexpr (std::is_same_v<T, float>) {
    DecodeState<T> host = state;
    std::vector<int64_t> ids;
    if (state.slots.data) {
      ids.resize(static_cast<size_t>(state.slots.rank == 1 ? state.slots.size[0] : 0));
      std::iota(ids.begin(), ids.end(), int64_t(0));
      host.slots = TensorView<const int64_t>(ids.data(), {static_cast<int64_t>(ids.size())});
    }
    const Problem<T> p = check_decode<R>(host, tokens, o, opt);
    cuda::Workspace ws;
    const cuda::Params cp = cuda::params_from(p, nullptr, state.slots.data, Algorithm::recurrent);
    RunInfo info{Backend::cuda, Algorithm::recurrent, cuda::decode(cp, ws, nullptr)};
    report("decode", info);
    return info;
  } else {
    return {};
  }
}

}  // namespace dgps::detail
