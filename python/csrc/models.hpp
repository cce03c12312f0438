/// @brief The models compiled through the templated API (one translation unit each), and their table.
#pragma once

#include <dgps/recurrence.hpp>

#include "common.hpp"

namespace dgps_torch {

namespace models {
using gdn = dgps::GDN;
using kda = dgps::KDA;
using pgdn = dgps::PGDN;
using pkda = dgps::PKDA;
using dn = dgps::DeltaNet;
using gla = dgps::GLA;
using mamba2 = dgps::Mamba2;
using la = dgps::LinearAttention;
/// FLA's simple GLA: a scalar decay per head and no gain (SPEC §2 axes scalar, unit, identity, offline).
using simple_gla =
    dgps::Recurrence<dgps::decay::Scalar, dgps::gain::Unit, dgps::precond::Identity, dgps::solve::Offline>;
}  // namespace models

/// Host forward of one compiled model.
using ForwardFn = void (*)(const Args&, const Tensor&, const Tensor&, const Tensor&, dgps::TrainingCache*);
/// Host backward of one compiled model.
using BackwardFn = void (*)(const Args&, const Tensor&, const OptTensor&, const OptTensor&, const GradTensors&,
                            const dgps::TrainingCache*);

/// Host decode of one compiled model through a state pool (dgps::decode with dgps::DecodeState): writes `o`,
/// updates `h` (and `a`) in place at the slots the index tensors name (each undefined when absent).
using DecodeFn = void (*)(const Args&, const Tensor& o, const Tensor& h, const Tensor& a, const PoolIndices&);

// One X(name) per compiled model; python/CMakeLists.txt compiles model.cpp once for each.
#define DGPS_TORCH_MODELS(X) X(gdn) X(kda) X(pgdn) X(pkda) X(dn) X(gla) X(mamba2) X(la) X(simple_gla)

#define DGPS_TORCH_DECLARE(name)                                                                           \
  void forward_##name(const Args&, const Tensor&, const Tensor&, const Tensor&, dgps::TrainingCache*);     \
  void backward_##name(const Args&, const Tensor&, const OptTensor&, const OptTensor&, const GradTensors&, \
                       const dgps::TrainingCache*);                                             \
  void decode_##name(const Args&, const Tensor&, const Tensor&, const Tensor&, const PoolIndices&);
DGPS_TORCH_MODELS(DGPS_TORCH_DECLARE)
#undef DGPS_TORCH_DECLARE

}  // namespace dgps_torch
