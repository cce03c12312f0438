/// @brief The CPU backend: chunkwise (SPEC §4) and decode kernels from dgps_cpu_kernels, recurrent fallback.
///
/// The heavy kernels live in the compiled per-ISA library (dgps/cpu/kernels.hpp); this header only
/// converts the validated detail::Problem<T> into kernels::KernelParams and picks the algorithm.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "dgps/cpu/kernels.hpp"
#include "dgps/detail/check.hpp"
#include "dgps/detail/half.hpp"
#include "dgps/detail/problem.hpp"
#include "dgps/reference/backend.hpp"
#include "dgps/types.hpp"

namespace dgps::cpu {

/// True when the chunkwise kernels cover model R: Identity, DiagonalATK or DiagonalATQ (SPEC §4).
template <class R>
constexpr bool has_chunkwise() {
  return kernels::chunkwise_covers(spec_of<R>());
}

/// True for the exact preconditioners (ExactATK, ExactATQ: the Mesa layer, the ridge readout).
template <class R>
constexpr bool exact_precond() {
  constexpr auto k = spec_of<R>().precond;
  return k == precond::Kind::exact_atk || k == precond::Kind::exact_atq;
}

/// True when the CPU backend has `alg` for model R (the recurrent algorithm covers every combination).
template <class R>
constexpr bool supports(Algorithm alg) {
  return alg == Algorithm::automatic || alg == Algorithm::recurrent || (alg == Algorithm::chunkwise && has_chunkwise<R>());
}

/// What a CPU call ran.
struct Ran {
  Algorithm algorithm;
  std::string impl;
};

namespace detail_cpu {

template <class V>
kernels::KView kview(const TensorView<V>& t) {
  kernels::KView k;
  k.data = const_cast<std::remove_const_t<V>*>(t.data);
  for (int d = 0; d < 4 && d < t.rank; ++d) k.stride[d] = t.stride[d];
  return k;
}

/// Points the kernel params at the buffer and layout of a training cache, to write (`write`, a
/// forward) or read (a backward).
inline void set_saved(kernels::KernelParams& k, const TrainingCache& c, bool write) {
  using A = dgps::detail::TrainingCacheAccess;
  const dgps::detail::TrainingLayout& l = A::layout(c);
  k.saved = A::data(c);
  k.save = write;
  k.saved_chunk0 = l.chunk0.data();
  k.saved_ld = l.ld;
  k.saved_pld = l.pld;
  k.saved_aoff = l.aoff;
  k.saved_block = l.block;
  k.saved_seg = l.seg;
}

/// The kernel params of a validated problem: float or double (states share the input type), or
/// bf16 / f16 inputs and outputs with float states.
template <class T>
kernels::KernelParams params(const dgps::detail::Problem<T>& p) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || is_half_v<T>,
                "the CPU kernels take float, double, bf16 or f16");
  kernels::KernelParams k;
  k.dtype = std::is_same_v<T, double>  ? kernels::DType::f64
            : std::is_same_v<T, bf16> ? kernels::DType::bf16
            : std::is_same_v<T, f16>  ? kernels::DType::f16
                                      : kernels::DType::f32;
  k.spec = p.spec;
  k.B = p.B, k.T = p.T_, k.H = p.H, k.HV = p.HV, k.K = p.K, k.V = p.V, k.N = p.N;
  k.cu_seqlens = p.cu_seqlens;
  k.slots = p.slots;
  if (!p.in_slots.empty()) k.in_slots = p.in_slots.data();
  if (!p.out_slots.empty()) k.out_slots = p.out_slots.data();
  if (!p.padded.empty()) k.padded = p.padded.data();
  k.token_slots = p.token_slots;
  k.token_ld = p.token_ld;
  k.q = kview(p.q), k.k = kview(p.k), k.v = kview(p.v), k.g = kview(p.g), k.beta = kview(p.beta);
  k.g_p = kview(p.g_p), k.beta_p = kview(p.beta_p), k.center = kview(p.center);
  k.h0 = kview(p.h0), k.a0 = kview(p.a0), k.o = kview(p.o), k.hT = kview(p.hT), k.aT = kview(p.aT);
  k.d_o = kview(p.d_o), k.dhT = kview(p.dhT), k.daT = kview(p.daT);
  k.dq = kview(p.dq), k.dk = kview(p.dk), k.dv = kview(p.dv), k.dg = kview(p.dg), k.dbeta = kview(p.dbeta);
  k.dg_p = kview(p.dg_p), k.dbeta_p = kview(p.dbeta_p), k.dcenter = kview(p.dcenter);
  k.dh0 = kview(p.dh0), k.da0 = kview(p.da0);
  k.scale = p.scale, k.x = p.x, k.eps = p.eps, k.lambda = p.lambda;
  k.l2norm = p.l2norm;
  k.threads = p.threads;
  k.chunk = p.chunk;
  if (p.saved) set_saved(k, *p.saved, false);
  return k;
}

}  // namespace detail_cpu

/// Forward on the CPU. `chunkwise` forces the chunkwise kernels (R must be covered). `automatic`
/// picks them for every covered model: measured faster than the recurrent path at every sequence
/// length, from 1 token (about 2x, B = 8, H = 16, K = V = 128) to 32 tokens (about 17x) and beyond
/// (bench/README.md). The exact preconditioners (Mesa layer, ridge readout), which have no chunkwise
/// form here, run on the decode kernel when `automatic`: the recurrence token by token, vectorised,
/// with the inverse Gram in double (docs/performance-cpu.md). `recurrent` runs the reference code
/// (float accumulation).
/// With a training cache (p.save_to, emptied by dgps::forward) the chunkwise kernels fill it; the
/// recurrence leaves it empty.
template <class R, class T>
Ran forward(const dgps::detail::Problem<T>& p, Algorithm alg) {
  using A = dgps::detail::TrainingCacheAccess;
  const bool chunk = alg == Algorithm::chunkwise || (alg == Algorithm::automatic && has_chunkwise<R>());
  if (chunk) {
    kernels::KernelParams k = detail_cpu::params(p);
    if (p.save_to) {
      dgps::detail::TrainingLayout layout = dgps::detail::training_layout(p, p.save_to->max_full_bytes());
      const size_t bytes = dgps::detail::training_bytes(p, layout);
      A::prepare(*p.save_to, dgps::detail::training_key(p), std::move(layout), bytes);
      detail_cpu::set_saved(k, *p.save_to, true);
    }
    const char* impl = kernels::chunkwise_forward(k);
    if (p.save_to) A::set_filled(*p.save_to, true);
    return {Algorithm::chunkwise, impl};
  }
  if (alg == Algorithm::automatic && exact_precond<R>()) return {Algorithm::recurrent, kernels::decode(detail_cpu::params(p))};
  reference::forward<R, T, state_t<T>>(p, p.threads);
  return {Algorithm::recurrent, "cpu/recurrent"};
}

/// Backward on the CPU. `chunkwise` forces the chunkwise backward kernels (SPEC §4, R must be
/// covered); `automatic` picks them for every covered model (bench/README.md: far faster than the
/// recurrence at every length). The chunkwise kernels read a training cache (p.saved) instead of
/// recomputing the chunks' states and pseudo-values; the recurrence ignores it. The exact preconditioners run
/// their own vectorised reverse recurrence when `automatic` (kernels::exact_backward: the inverse Gram in double,
/// states checkpointed every p.chunk tokens). `recurrent` runs the reference recurrence token by token with
/// checkpoints every p.chunk tokens (float accumulation).
template <class R, class T>
Ran backward(const dgps::detail::Problem<T>& p, Algorithm alg) {
  const bool chunk = alg == Algorithm::chunkwise || (alg == Algorithm::automatic && has_chunkwise<R>());
  // bf16 / f16: the chunkwise kernels run on float copies (detail/half.hpp); the recurrence reads
  // the half-precision tensors directly, accumulating in float.
  if constexpr (is_half_v<T>)
    if (chunk)
      return dgps::detail::with_float_copy(p, [&](const dgps::detail::Problem<float>& f) {
        return backward<R>(f, alg);
      });
  if (chunk) return {Algorithm::chunkwise, kernels::chunkwise_backward(detail_cpu::params(p))};
  if (alg == Algorithm::automatic && exact_precond<R>()) {
    if constexpr (is_half_v<T>)
      return dgps::detail::with_float_copy(p, [&](const dgps::detail::Problem<float>& f) {
        return backward<R>(f, alg);
      });
    else
      return {Algorithm::recurrent, kernels::exact_backward(detail_cpu::params(p))};
  }
  reference::backward<R, T, state_t<T>>(p, p.threads);
  return {Algorithm::recurrent, "cpu/recurrent"};
}

/// Sequences longer than this run a decode call (a prefill through the state pool) on the chunkwise
/// kernels when `automatic` (and the model has them); shorter ones on the decode kernel.
inline constexpr int64_t kDecodeMaxTokens = 16;

/// Decode on the CPU: the fused one-sweep-per-token kernel (every model), or for a prefill (`chunkwise`,
/// or `automatic` with a sequence longer than kDecodeMaxTokens and a model with chunkwise kernels) the
/// chunkwise forward with the same state-pool addressing. Speculative verification (token slots) always
/// runs the decode kernel. Returns what ran.
template <class R, class T>
Ran decode(const dgps::detail::Problem<T>& p, Algorithm alg) {
  int64_t longest = 0;
  for (int64_t n = 0; n < p.N; ++n) longest = std::max(longest, p.seq_len(n));
  const bool chunk = has_chunkwise<R>() && !p.token_slots &&
                     (alg == Algorithm::chunkwise || (alg == Algorithm::automatic && longest > kDecodeMaxTokens));
  if (chunk) return {Algorithm::chunkwise, kernels::chunkwise_forward(detail_cpu::params(p))};
  return {Algorithm::recurrent, kernels::decode(detail_cpu::params(p))};
}

}  // namespace dgps::cpu
