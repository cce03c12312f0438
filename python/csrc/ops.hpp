/// @brief Pieces of the host operators that the CUDA operators share (argument parsing, output shapes).
#pragma once

#include <string>
#include <vector>

#include "common.hpp"

namespace dgps_torch {

/// Final-state shapes: `h` [N, HV, K, V]; `a` [N, H, K] (diagonal), [N, H, K, K] (exact) or empty (none).
struct StateShapes {
  std::vector<int64_t> h, a;
};

/// Parses the op's arguments into Args (model, backend, options).
Args make_args(const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
               const OptTensor& beta, const OptTensor& g_p, const OptTensor& beta_p, const OptTensor& center,
               const OptTensor& h0, const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale,
               bool l2norm, double x, double eps, double lamb, const std::string& backend, int64_t chunk_size);

/// The final-state shapes of a call.
StateShapes state_shapes(const Args& a);

/// float64 for float64 inputs, else float32 (SPEC §5).
at::ScalarType state_dtype(const Tensor& q);

/// One contiguous gradient per given input.
GradTensors allocate_grads(const Args& a);

/// The ten gradients in the op's order (dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter, dh0, da0); empty where absent.
std::vector<Tensor> grads_list(const GradTensors& r);

}  // namespace dgps_torch
