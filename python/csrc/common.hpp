/// @brief Shared pieces of the dgps_torch operators: tensor views, the op arguments, the compiled model list.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <dgps/dgps.hpp>

namespace dgps_torch {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

/// The tensors and options of one forward or backward call, as the op schema passes them.
struct Args {
  dgps::ModelSpec spec;
  Tensor q, k, v;
  OptTensor g, beta, g_p, beta_p, center, h0, a0, cu_seqlens;
  dgps::Options opt;
};

/// What a backward call computes: one tensor per input (undefined where the input is absent).
struct GradTensors {
  Tensor dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter, dh0, da0;
};

/// The index tensors of a decode through a state pool (dgps::DecodeState), int64 (has_initial uint8); undefined
/// when absent.
struct PoolIndices {
  Tensor slots, out_slots, has_initial, token_slots, num_accepted;
};

/// A view of `t` with element type T (no copy; rank <= 4; validation happens in dgps).
template <class T>
dgps::TensorView<T> view_of(const Tensor& t) {
  TORCH_CHECK(t.dim() <= dgps::kMaxRank, "dgps: tensors have at most ", dgps::kMaxRank, " dimensions, got ", t.dim());
  dgps::TensorView<T> v;
  v.data = static_cast<T*>(t.data_ptr());
  v.rank = static_cast<int>(t.dim());
  for (int d = 0; d < v.rank; ++d) {
    v.size[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  return v;
}

/// A view of an optional tensor; absent when `t` is empty.
template <class T>
dgps::TensorView<T> view_of(const OptTensor& t) {
  return t.has_value() && t->defined() ? view_of<T>(*t) : dgps::TensorView<T>{};
}

/// True when an optional tensor is given.
inline bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

/// Number of sequences: B, or len(cu_seqlens) - 1.
inline int64_t num_seqs(const Args& a) { return given(a.cu_seqlens) ? a.cu_seqlens->numel() - 1 : a.q.size(0); }

/// Parses "gdn", "pkda", ... (dgps::model_by_name) or "decay,gain,precond,solve" (e.g. "scalar,unit,identity,offline").
dgps::ModelSpec parse_model(const std::string& s);

/// "automatic", "reference", "cpu", "cuda".
dgps::Backend parse_backend(const std::string& s);

/// The host (CPU) forward of `a` writing `o` and, when defined, `hT`, `aT`; `cache` (may be null) is filled
/// for the backward. Throws for a model this build did not compile.
void cpu_forward(const Args& a, const Tensor& o, const Tensor& hT, const Tensor& aT, dgps::TrainingCache* cache);

/// The host backward of `a`: writes every defined tensor of `out`.
void cpu_backward(const Args& a, const Tensor& d_o, const OptTensor& dhT, const OptTensor& daT, const GradTensors& out,
                  const dgps::TrainingCache* cache);

/// Models compiled through the templated API, as their names ("gdn, kda, ...").
std::string compiled_models();

}  // namespace dgps_torch
