/// @brief Host forward and backward of one model through the templated dgps API, for every dtype.
///
/// Compiled once per model of DGPS_TORCH_MODELS (python/CMakeLists.txt) with DGPS_TORCH_MODEL set to its
/// name, so that the models build in parallel and only the models the FLA functions need are compiled.
#include <ATen/ATen.h>

#include "common.hpp"
#include "models.hpp"

#ifndef DGPS_TORCH_MODEL
#error "DGPS_TORCH_MODEL names the model this file is compiled for"
#endif
#define DGPS_TORCH_CAT2(a, b) a##b
#define DGPS_TORCH_CAT(a, b) DGPS_TORCH_CAT2(a, b)

namespace dgps_torch {
namespace {

using Model = models::DGPS_TORCH_MODEL;

template <class T>
dgps::TensorView<T> maybe(const Tensor& t) {
  return t.defined() ? view_of<T>(t) : dgps::TensorView<T>{};
}

template <class T>
dgps::Inputs<T> inputs_of(const Args& a) {
  using S = dgps::state_t<T>;
  const dgps::Shape shape{a.q.size(0), a.q.size(1), a.q.size(2), a.v.size(2), a.q.size(3), a.v.size(3)};
  dgps::Inputs<T> in = dgps::inputs<T>(shape, view_of<const T>(a.q), view_of<const T>(a.k), view_of<const T>(a.v));
  in.g = view_of<const T>(a.g);
  in.beta = view_of<const T>(a.beta);
  in.g_p = view_of<const T>(a.g_p);
  in.beta_p = view_of<const T>(a.beta_p);
  in.center = view_of<const T>(a.center);
  in.h0 = view_of<const S>(a.h0);
  in.a0 = view_of<const S>(a.a0);
  in.cu_seqlens = view_of<const int64_t>(a.cu_seqlens);
  return in;
}

// at::BFloat16 / at::Half and dgps::bf16 / dgps::f16 are both plain 16-bit patterns: the views reinterpret.
template <class F>
void by_dtype(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kDouble:
      f(double{});
      break;
    case at::kBFloat16:
      f(dgps::bf16{});
      break;
    case at::kHalf:
      f(dgps::f16{});
      break;
    default:
      TORCH_CHECK(false, "dgps: q must be float32, float64, bfloat16 or float16, got ", st);
  }
}

}  // namespace

void DGPS_TORCH_CAT(forward_, DGPS_TORCH_MODEL)(const Args& a, const Tensor& o, const Tensor& hT, const Tensor& aT,
                                                dgps::TrainingCache* cache) {
  by_dtype(a.q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = dgps::state_t<T>;
    dgps::Outputs<T> out = dgps::outputs<T>(view_of<T>(o));
    out.hT = maybe<S>(hT);
    out.aT = maybe<S>(aT);
    out.cache = cache;
    dgps::forward<Model>(inputs_of<T>(a), out, a.opt);
  });
}

void DGPS_TORCH_CAT(backward_, DGPS_TORCH_MODEL)(const Args& a, const Tensor& d_o, const OptTensor& dhT,
                                                 const OptTensor& daT, const GradTensors& r,
                                                 const dgps::TrainingCache* cache) {
  by_dtype(a.q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = dgps::state_t<T>;
    dgps::GradsIn<T> gin;
    gin.d_o = view_of<const T>(d_o);
    gin.dhT = view_of<const S>(dhT);
    gin.daT = view_of<const S>(daT);
    gin.cache = cache;
    dgps::Grads<T> gr;
    gr.dq = maybe<T>(r.dq), gr.dk = maybe<T>(r.dk), gr.dv = maybe<T>(r.dv);
    gr.dg = maybe<T>(r.dg), gr.dbeta = maybe<T>(r.dbeta), gr.dg_p = maybe<T>(r.dg_p);
    gr.dbeta_p = maybe<T>(r.dbeta_p), gr.dcenter = maybe<T>(r.dcenter);
    gr.dh0 = maybe<S>(r.dh0), gr.da0 = maybe<S>(r.da0);
    dgps::backward<Model>(inputs_of<T>(a), gin, gr, a.opt);
  });
}

void DGPS_TORCH_CAT(decode_, DGPS_TORCH_MODEL)(const Args& a, const Tensor& o, const Tensor& h, const Tensor& st_a,
                                               const PoolIndices& ix) {
  by_dtype(a.q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = dgps::state_t<T>;
    dgps::DecodeState<T> st;
    // A pool [P, HV, K, V] strided in V with K contiguous is the transpose of a K-last pool [P, HV, V, K].
    const bool k_last = h.dim() == 4 && h.size(3) > 1 && h.stride(3) != 1 && h.stride(2) == 1;
    st.h = view_of<S>(k_last ? h.transpose(2, 3) : h);
    if (k_last) st.layout = dgps::StateLayout::k_last;
    st.a = maybe<S>(st_a);
    st.slots = maybe<const int64_t>(ix.slots);
    st.out_slots = maybe<const int64_t>(ix.out_slots);
    st.has_initial = maybe<const uint8_t>(ix.has_initial);
    st.token_slots = maybe<const int64_t>(ix.token_slots);
    st.num_accepted = maybe<const int64_t>(ix.num_accepted);
    dgps::decode<Model>(st, inputs_of<T>(a), view_of<T>(o), a.opt);
  });
}

}  // namespace dgps_torch
