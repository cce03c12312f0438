/// @brief Internal: runs a float32 implementation on a bf16/f16 problem through float copies (backward).
///
/// The CPU forward and decode kernels read bf16/f16 directly (they convert at load and store). The
/// backward has no half-precision kernels: `with_float_copy` converts the half-precision tensors of a
/// validated Problem (inputs, `do`) to contiguous float buffers, runs the float32 implementation on
/// them, and rounds the gradients back into the caller's (possibly strided) views. States and their
/// gradients are float already and are used in place. Costs one extra pass over the inputs and
/// gradients, small next to a backward pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dgps/detail/problem.hpp"
#include "dgps/tensor.hpp"
#include "dgps/types.hpp"

namespace dgps::detail {

/// Calls fn(element pointer) for every element of `t` (rank 0..4), in C order.
template <class V, class F>
void for_each_element(const TensorView<V>& t, F&& fn) {
  const int r = t.rank < 0 ? 0 : t.rank;
  int64_t size[kMaxRank] = {1, 1, 1, 1}, stride[kMaxRank] = {0, 0, 0, 0};
  for (int d = 0; d < r; ++d) size[kMaxRank - r + d] = t.size[d], stride[kMaxRank - r + d] = t.stride[d];
  for (int64_t a = 0; a < size[0]; ++a)
    for (int64_t b = 0; b < size[1]; ++b)
      for (int64_t c = 0; c < size[2]; ++c)
        for (int64_t e = 0; e < size[3]; ++e)
          fn(t.data + a * stride[0] + b * stride[1] + c * stride[2] + e * stride[3]);
}

/// A contiguous float copy of `t` (absent stays absent); `buf` owns the data.
template <class T>
TensorView<const float> float_copy(const TensorView<const T>& t, std::vector<float>& buf) {
  if (!t.data) return {};
  buf.clear();
  buf.reserve(size_t(t.numel()));
  for_each_element(t, [&](const T* x) { buf.push_back(float(*x)); });
  TensorView<const float> out;
  out.data = buf.data();
  out.set_contiguous(t.size.data(), t.rank);
  return out;
}

/// A contiguous float buffer shaped like `t` (absent stays absent), for a gradient to round back later.
template <class T>
TensorView<float> float_buffer(const TensorView<T>& t, std::vector<float>& buf) {
  if (!t.data) return {};
  buf.assign(size_t(t.numel()), 0.0f);
  TensorView<float> out;
  out.data = buf.data();
  out.set_contiguous(t.size.data(), t.rank);
  return out;
}

/// Rounds the contiguous float buffer `src` into the view `dst` (no-op when absent).
template <class T>
void round_into(const std::vector<float>& src, const TensorView<T>& dst) {
  if (!dst.data) return;
  size_t i = 0;
  for_each_element(dst, [&](T* x) { *x = T(src[i++]); });
}

/// Runs `fn(const Problem<float>&)` on float copies of the bf16/f16 tensors of `p` and rounds the
/// gradients it writes back into p's views; returns fn's result.
template <class T, class F>
auto with_float_copy(const Problem<T>& p, F&& fn) {
  static_assert(is_half_v<T>, "with_float_copy is for bf16 and f16 problems");
  Problem<float> f;
  f.spec = p.spec;
  f.B = p.B, f.T_ = p.T_, f.H = p.H, f.HV = p.HV, f.K = p.K, f.V = p.V, f.N = p.N;
  f.cu_seqlens = p.cu_seqlens;
  f.slots = p.slots;
  f.in_slots = p.in_slots, f.out_slots = p.out_slots, f.padded = p.padded;
  f.token_slots = p.token_slots, f.token_ld = p.token_ld;
  f.h0 = p.h0, f.a0 = p.a0, f.hT = p.hT, f.aT = p.aT;
  f.dhT = p.dhT, f.daT = p.daT, f.dh0 = p.dh0, f.da0 = p.da0;
  f.scale = p.scale, f.x = p.x, f.eps = p.eps, f.lambda = p.lambda;
  f.l2norm = p.l2norm;
  f.threads = p.threads;
  f.chunk = p.chunk;
  f.saved = p.saved;  // saved by the forward in float (the kernels compute half inputs in float)
  std::vector<float> in[9], gr[8];
  f.q = float_copy(p.q, in[0]);
  f.k = float_copy(p.k, in[1]);
  f.v = float_copy(p.v, in[2]);
  f.g = float_copy(p.g, in[3]);
  f.beta = float_copy(p.beta, in[4]);
  f.g_p = float_copy(p.g_p, in[5]);
  f.beta_p = float_copy(p.beta_p, in[6]);
  f.center = float_copy(p.center, in[7]);
  f.d_o = float_copy(p.d_o, in[8]);
  f.dq = float_buffer(p.dq, gr[0]);
  f.dk = float_buffer(p.dk, gr[1]);
  f.dv = float_buffer(p.dv, gr[2]);
  f.dg = float_buffer(p.dg, gr[3]);
  f.dbeta = float_buffer(p.dbeta, gr[4]);
  f.dg_p = float_buffer(p.dg_p, gr[5]);
  f.dbeta_p = float_buffer(p.dbeta_p, gr[6]);
  f.dcenter = float_buffer(p.dcenter, gr[7]);
  auto result = fn(static_cast<const Problem<float>&>(f));
  round_into(gr[0], p.dq);
  round_into(gr[1], p.dk);
  round_into(gr[2], p.dv);
  round_into(gr[3], p.dg);
  round_into(gr[4], p.dbeta);
  round_into(gr[5], p.dg_p);
  round_into(gr[6], p.dbeta_p);
  round_into(gr[7], p.dcenter);
  return result;
}

}  // namespace dgps::detail
