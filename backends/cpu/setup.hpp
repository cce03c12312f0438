/// @brief Per-call constants and row accessors shared by the CPU leaf kernels (sequence geometry, typed rows).
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.hpp"
#include "simd.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// Sequence geometry, computed here rather than through KernelParams' inline members so that no
// header inline function is instantiated with this ISA's flags.
inline int64_t seq_begin(const KernelParams& p, int64_t n) { return p.cu_seqlens ? p.cu_seqlens[n] : 0; }
inline int64_t seq_len(const KernelParams& p, int64_t n) {
  return p.cu_seqlens ? p.cu_seqlens[n + 1] - p.cu_seqlens[n] : p.T;
}
inline int64_t seq_batch(const KernelParams& p, int64_t n) { return p.cu_seqlens ? 0 : n; }
inline int64_t state_index(const KernelParams& p, int64_t n) { return p.slots ? p.slots[n] : n; }
/// The state read (-1: zero start) and written (-1: none) by sequence n; whether it is padding.
inline int64_t read_index(const KernelParams& p, int64_t n) { return p.in_slots ? p.in_slots[n] : state_index(p, n); }
inline int64_t write_index(const KernelParams& p, int64_t n) {
  return p.out_slots ? p.out_slots[n] : state_index(p, n);
}
inline bool is_padded(const KernelParams& p, int64_t n) { return p.padded && p.padded[n]; }

/// The per-call constants shared by the kernels. `In` is the storage type of the inputs and of `o`
/// (T, or Bf16Bits / F16Bits with T = float); states are T. The row accessors return `In` pointers
/// (convert with load_cvt / to_c), the scalar accessors convert to T.
template <class T, class In = T>
struct Setup {
  const KernelParams& p;
  int64_t K, V, r, Kp, Vp;
  bool online, diag_pre, atk, atq, gain;
  decay::Kind decay;
  T scale, log_x, eps;
  explicit Setup(const KernelParams& pp)
      : p(pp),
        K(pp.K),
        V(pp.V),
        r(pp.HV / pp.H),
        Kp(round_up(pp.K, Vec<T>::L)),
        Vp(round_up(pp.V, Vec<T>::L)),
        online(pp.spec.solve == solve::Kind::online),
        diag_pre(pp.spec.precond == precond::Kind::diagonal_atk || pp.spec.precond == precond::Kind::diagonal_atq),
        atk(pp.spec.precond == precond::Kind::diagonal_atk),
        atq(pp.spec.precond == precond::Kind::diagonal_atq),
        gain(pp.spec.gain == gain::Kind::scalar),
        decay(pp.spec.decay),
        scale(T(pp.scale)),
        log_x(T(std::log(pp.x))),
        eps(T(pp.eps)) {}

  const In* qrow(int64_t b, int64_t t, int64_t h) const {
    return cptr<In>(p.q) + b * p.q.stride[0] + t * p.q.stride[1] + h * p.q.stride[2];
  }
  const In* krow(int64_t b, int64_t t, int64_t h) const {
    return cptr<In>(p.k) + b * p.k.stride[0] + t * p.k.stride[1] + h * p.k.stride[2];
  }
  const In* vrow(int64_t b, int64_t t, int64_t hv) const {
    return cptr<In>(p.v) + b * p.v.stride[0] + t * p.v.stride[1] + hv * p.v.stride[2];
  }
  In* orow(int64_t b, int64_t t, int64_t hv) const {
    return mptr<In>(p.o) + b * p.o.stride[0] + t * p.o.stride[1] + hv * p.o.stride[2];
  }
  /// The gate of token t: one value (scalar decay) or K values (diagonal decay).
  const In* grow(int64_t b, int64_t t, int64_t hv) const {
    return cptr<In>(p.g) + b * p.g.stride[0] + t * p.g.stride[1] + hv * p.g.stride[2];
  }
  T beta(int64_t b, int64_t t, int64_t hv) const {
    return gain ? to_c<T>(cptr<In>(p.beta)[b * p.beta.stride[0] + t * p.beta.stride[1] + hv * p.beta.stride[2]]) : T(1);
  }
  T gp(int64_t b, int64_t t, int64_t h) const {
    return to_c<T>(cptr<In>(p.g_p)[b * p.g_p.stride[0] + t * p.g_p.stride[1] + h * p.g_p.stride[2]]);
  }
  T bp(int64_t b, int64_t t, int64_t h) const {
    return to_c<T>(cptr<In>(p.beta_p)[b * p.beta_p.stride[0] + t * p.beta_p.stride[1] + h * p.beta_p.stride[2]]);
  }
  T center(int64_t h) const { return to_c<T>(cptr<In>(p.center)[h * p.center.stride[0]]); }
  T* state(const KView& s, int64_t si, int64_t hv) const { return mptr<T>(s) + si * s.stride[0] + hv * s.stride[1]; }
};

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
