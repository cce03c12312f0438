/// @brief detail::Problem, the plain params struct at the kernel boundary (validated, shapes resolved).
#pragma once

#include <cstdint>
#include <vector>

#include "dgps/recurrence.hpp"
#include "dgps/tensor.hpp"
#include "dgps/types.hpp"

namespace dgps::detail {

/// Everything a kernel needs, checked once by detail/check.hpp: raw views with resolved ranks,
/// sizes and element strides, the scalar options, and what to compute. Kernels never re-validate.
template <class T>
struct Problem {
  using S = state_t<T>;
  ModelSpec spec;
  int64_t B = 0, T_ = 0, H = 0, HV = 0, K = 0, V = 0, N = 0;

  // Inputs. Absent views have data == nullptr.
  TensorView<const T> q, k, v, g, beta, g_p, beta_p, center;
  TensorView<const S> h0, a0;
  const int64_t* cu_seqlens = nullptr;  ///< [N+1] or null (fixed length T, N = B)
  const int64_t* slots = nullptr;       ///< decode: state index of each sequence, or null (identity)
  // Decode through a state pool (DecodeState's index tensors, resolved by check_decode); empty otherwise.
  std::vector<int64_t> in_slots;        ///< [N] state read by sequence n; -1: zero / default start
  std::vector<int64_t> out_slots;       ///< [N] state its final state is written to; -1: none
  std::vector<unsigned char> padded;    ///< [N] 1: padding sequence (o zero, the pool untouched)
  const int64_t* token_slots = nullptr; ///< [N, token_ld]: the state after token t goes to slot [n, t]
  int64_t token_ld = 0;

  // Forward outputs.
  TensorView<T> o;
  TensorView<S> hT, aT;

  // Backward cotangents and gradients (backward calls only).
  TensorView<const T> d_o;
  TensorView<const S> dhT, daT;
  TensorView<T> dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter;
  TensorView<S> dh0, da0;

  double scale = 1, x = 1.5, eps = 1e-6, lambda = 1;
  bool l2norm = true;
  int threads = 0;
  int64_t chunk = 64;

  // Training cache (dgps/training_cache.hpp): a forward's cache to fill, or a backward's filled cache
  // (already checked against this call), or null.
  TrainingCache* save_to = nullptr;
  const TrainingCache* saved = nullptr;

  /// First token and length of sequence n; the batch row it lives in.
  int64_t seq_begin(int64_t n) const { return cu_seqlens ? cu_seqlens[n] : 0; }
  int64_t seq_len(int64_t n) const { return cu_seqlens ? cu_seqlens[n + 1] - cu_seqlens[n] : T_; }
  int64_t seq_batch(int64_t n) const { return cu_seqlens ? 0 : n; }
  /// Index of sequence n's state in h0/a0/hT/aT (a slot of the pool in decode).
  int64_t state_index(int64_t n) const { return slots ? slots[n] : n; }
  /// State read (-1: zero start) and written (-1: none) by sequence n; whether it is padding.
  int64_t read_index(int64_t n) const { return in_slots.empty() ? state_index(n) : in_slots[n]; }
  int64_t write_index(int64_t n) const { return out_slots.empty() ? state_index(n) : out_slots[n]; }
  bool is_padded(int64_t n) const { return !padded.empty() && padded[n]; }
};

}  // namespace dgps::detail
