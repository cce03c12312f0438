/// @brief The dgps public API: forward, backward and decode of any DGPS recurrence (SPEC.md).
///
/// Include this header, pick a model (`dgps::PGDN`, or any `dgps::Recurrence<...>`), describe the
/// tensors with `dgps::inputs(...)` / `dgps::outputs(...)` and call `dgps::forward<Model>`.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>

#include "dgps/backend.hpp"
#include "dgps/cpu/backend.hpp"
#include "dgps/detail/check.hpp"
#include "dgps/detail/finite.hpp"
#include "dgps/detail/problem.hpp"
#include "dgps/error.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/reference/backend.hpp"
#include "dgps/tensor.hpp"
#include "dgps/training_cache.hpp"
#include "dgps/types.hpp"
#include "dgps/version.hpp"
#if defined(DGPS_HAS_CUDA)
#include "dgps/cuda/dispatch.hpp"
#endif

namespace dgps {

namespace detail {
inline namespace DGPS_CUDA_ABI {  // see dgps/backend.hpp
template <class R>
void check_supported(Backend b, Algorithm a) {
  if (!supports<R>(b, a))
    throw Error(std::string("backend '") + to_string(b) + "' has no " + to_string(a) + " algorithm for " +
                to_string(spec_of<R>()));
}
}  // inline namespace DGPS_CUDA_ABI
}  // namespace detail

inline namespace DGPS_CUDA_ABI {  // forward, backward and decode branch on DGPS_HAS_CUDA

/// Forward pass of model R (SPEC §2): writes `o` and, when requested, the final states `hT`, `aT`.
///
/// T is float, double, dgps::bf16 or dgps::f16 (the last two with float32 states and compute).
/// The backend is chosen at run time (`opt.backend`; `automatic` honours DGPS_BACKEND, else runs device
/// pointers on the CUDA backend and host pointers on the CPU): in a program linked with dgps::cuda,
/// float32, bfloat16 and float16 device tensors run dgps::cuda::forward asynchronously on the default
/// stream (float64 has no CUDA kernels). Throws dgps::Error (and writes nothing) on any malformed
/// input; see detail/check.hpp for the rules. Returns which implementation ran. With
/// `out.save_for_backward(cache)` the CPU chunkwise forward fills the training cache for the backward;
/// every other path leaves it empty (dgps/training_cache.hpp).
template <class R, class T>
RunInfo forward(const Inputs<T>& in, const Outputs<T>& out, const Options& opt = {}) {
#if defined(DGPS_HAS_CUDA)
  if (detail::wants_cuda(opt.backend, in.q.data)) {
    const RunInfo ran = detail::cuda_forward<R>(in, out, opt);
    if (out.cache) detail::TrainingCacheAccess::set_filled(*out.cache, false);  // the CUDA path saves nothing
    return ran;
  }
#endif
  const detail::Problem<T> p = detail::check_forward<R>(in, out, opt);
  detail::check_finite(p, opt);
  RunInfo info{detail::select_backend(opt.backend), opt.algorithm, {}};
  detail::check_supported<R>(info.backend, opt.algorithm);
  // A cache is empty after any forward but the one path that saves (cpu::forward, chunkwise).
  if (p.save_to) detail::TrainingCacheAccess::set_filled(*p.save_to, false);
  if (info.backend == Backend::reference) {
    reference::forward<R, T, double>(p, p.threads);
    info.impl = "reference/recurrent";
    info.algorithm = Algorithm::recurrent;
  } else {
    const cpu::Ran ran = cpu::forward<R, T>(p, opt.algorithm);
    info.impl = ran.impl;
    info.algorithm = ran.algorithm;
  }
  detail::report("forward", info);
  return info;
}

/// Backward pass of model R: the gradients of `loss = sum(o*do) + sum(hT*dhT) + sum(aT*daT)` with
/// respect to every input whose gradient view is given in `grads` (SPEC §3.8). The forward is
/// recomputed chunk by chunk (`opt.chunk_size` tokens; memory O(T / C * K * V + T * (K + V)) per head),
/// or, on the CPU chunkwise path, read from the training cache `gin.use_saved(cache)` that the forward
/// filled (`Outputs::save_for_backward`; a filled cache of another call throws dgps::Error, an empty
/// one is ignored; dgps/training_cache.hpp).
/// For the exact preconditioners `da0` is the raw gradient of the non-symmetric update as written
/// in SPEC §2; its symmetric part is the gradient with respect to a symmetric P_0. Device tensors
/// (float32, bfloat16 or float16; or `backend = cuda`) run dgps::cuda::backward, asynchronously on the
/// default stream, with `opt.algorithm` passed on (automatic: chunkwise for 16-bit inputs where it applies).
template <class R, class T>
RunInfo backward(const Inputs<T>& in, const GradsIn<T>& gin, const Grads<T>& grads, const Options& opt = {}) {
#if defined(DGPS_HAS_CUDA)
  if (detail::wants_cuda(opt.backend, in.q.data)) {
    // Only a CPU forward (of host tensors) fills a cache: a filled one belongs to another call.
    if (gin.cache && gin.cache->filled())
      throw Error("training cache: it was filled by a CPU forward of host tensors; the CUDA backward's inputs are "
                  "device tensors (pass no cache, or an empty one)");
    return detail::cuda_backward<R>(in, gin, grads, opt);
  }
#endif
  const detail::Problem<T> p = detail::check_backward<R>(in, gin, grads, opt);
  detail::check_finite(p, opt);
  RunInfo info{detail::select_backend(opt.backend), opt.algorithm, {}};
  detail::check_supported<R>(info.backend, opt.algorithm);
  if (info.backend == Backend::reference) {
    reference::backward<R, T, double>(p, p.threads);
    info.impl = "reference/recurrent";
    info.algorithm = Algorithm::recurrent;
  } else {
    const cpu::Ran ran = cpu::backward<R, T>(p, opt.algorithm);
    info.impl = ran.impl;
    info.algorithm = ran.algorithm;
  }
  detail::report("backward", info);
  return info;
}

/// Bytes that a forward of model R on `in` with `opt` saves into a TrainingCache on the CPU chunkwise
/// path (0 for a model without CPU chunkwise kernels: its forward saves nothing), for a cache whose
/// max_full_bytes() is `max_full_bytes` (the full cache up to it, else the checkpoints). Validates `in`
/// like forward does (throws dgps::Error on malformed inputs).
template <class R, class T>
size_t training_cache_bytes(const Inputs<T>& in, const Options& opt = {},
                            size_t max_full_bytes = TrainingCache::kDefaultMaxFullBytes) {
  if constexpr (!cpu::has_chunkwise<R>()) {
    (void)detail::check_inputs<R>(in, opt);
    return 0;
  } else {
    const detail::Problem<T> p = detail::check_inputs<R>(in, opt);
    return detail::training_bytes(p, detail::training_layout(p, max_full_bytes));
  }
}

/// Decodes `tokens.shape.time` new tokens (usually 1 to 4) for each of `tokens.shape.batch`
/// sequences, or a packed batch of sequences of any lengths (`tokens.varlen(cu_seqlens)`: a prefill, or
/// ragged drafts), continuing from `state` and updating it in place. Equal to `forward` over the same
/// tokens with h0/a0 = state and hT/aT written back. `o` is [B, T, HV, V]: a TensorView or a bare
/// pointer (T is deduced from `state` and `tokens` only).
///
/// `state` may be a serving engine's pool of P states addressed by index tensors (DecodeState):
/// per-sequence start and final slots, "has initial state" flags, negative slots for padding sequences
/// (outputs zero, the pool untouched), and speculative verification (`token_slots`, `num_accepted`):
/// the state after every draft token written to its own slot, the start read from the slot of the last
/// accepted token. Validation errors name the tensor and write nothing.
///
/// On the CPU (`opt.algorithm`): `recurrent` runs the fused decode kernel, `chunkwise` the chunkwise
/// forward (prefill; not with token_slots), `automatic` the chunkwise one when a sequence is longer than
/// cpu::kDecodeMaxTokens and the model has chunkwise kernels. Device tensors (float32, bfloat16 or
/// float16; or `backend = cuda`) run dgps::cuda::decode, asynchronously on the default stream; the CUDA
/// backend takes `slots` only (no cu_seqlens, out_slots, has_initial or token_slots: dgps::Error).
template <class R, class T>
RunInfo decode(const DecodeState<T>& state, const Inputs<T>& tokens, std::type_identity_t<Out<T>> o,
               const Options& opt = {}) {
#if defined(DGPS_HAS_CUDA)
  if (detail::wants_cuda(opt.backend, tokens.q.data)) {
    auto given = [](const auto& t) { return t.data != nullptr || t.rank > 0; };
    if (given(tokens.cu_seqlens) || given(state.out_slots) || given(state.has_initial) || given(state.token_slots) ||
        given(state.num_accepted))
      throw Error("decode on the CUDA backend takes slots only: cu_seqlens, out_slots, has_initial, token_slots and "
                  "num_accepted are CPU-only for now");
    return detail::cuda_decode<R>(state, tokens, o, opt);
  }
#endif
  const detail::Problem<T> p = detail::check_decode<R>(state, tokens, o, opt);
  detail::check_finite(p, opt);
  RunInfo info{detail::select_backend(opt.backend), Algorithm::recurrent, {}};
  const Algorithm alg = info.backend == Backend::reference ? Algorithm::recurrent : opt.algorithm;
  if (alg == Algorithm::chunkwise && p.token_slots)
    throw Error("decode: the chunkwise algorithm does not write per-token states (token_slots); use recurrent");
  detail::check_supported<R>(info.backend, alg == Algorithm::automatic ? Algorithm::recurrent : alg);
  if (info.backend == Backend::reference) {
    reference::forward<R, T, double>(p, p.threads);
    info.impl = "reference/decode";
  } else {
    const cpu::Ran ran = cpu::decode<R, T>(p, alg);
    info.impl = ran.impl;
    info.algorithm = ran.algorithm;
  }
  detail::report("decode", info);
  return info;
}

}  // inline namespace DGPS_CUDA_ABI
}  // namespace dgps
