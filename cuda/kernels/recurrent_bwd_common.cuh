/// @brief Shared helpers of the float32 (recurrent) backward: sequences, checkpoint slots, tensor offsets, gates.
#pragma once

#include <cstdint>

#include "launch/backward.cuh"
#include "launch/recurrent.cuh"
#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels {
namespace {

/// One sequence of the call: its batch row, first time index, length and first token row (b * T + t).
struct Seq {
  int64_t b, t0, len, row0;
};

__device__ __forceinline__ Seq seq_of(const RecArgs& a, int n) {
  if (a.cu_seqlens) {
    const int64_t t0 = a.cu_seqlens[n];
    return {0, t0, a.cu_seqlens[n + 1] - t0, t0};
  }
  return {n, 0, a.T, int64_t(n) * a.T};
}

/// First checkpoint slot of sequence n: strictly increasing in n with room for its ceil(len / 64) + 1
/// slots (floor((r + l) / 64) >= floor(r / 64) + floor(l / 64)).
__device__ __forceinline__ int64_t slot_base(int64_t row0, int n) { return row0 / kBwdChunk + 2 * int64_t(n); }

/// Element offset of (batch b, time t, head, channel c) in a tensor with strides s.
__device__ __forceinline__ int64_t at(const int64_t* s, int64_t b, int64_t t, int64_t head, int64_t c = 0) {
  return b * s[0] + t * s[1] + head * s[2] + c;
}

/// e^g of a scalar decay (1 without decay; Diagonal decay is applied per channel by the caller).
__device__ __forceinline__ float scalar_decay(const RecArgs& a, int64_t b, int64_t t, int hv) {
  return a.decay == kDecayScalar ? expf(load_gate(a.g, at(a.sg, b, t, hv), a.gate_dtype)) : 1.f;
}

__device__ __forceinline__ float gain(const RecArgs& a, int64_t b, int64_t t, int hv) {
  return a.beta ? load_gate(a.beta, at(a.sbeta, b, t, hv), a.gate_dtype) : 1.f;
}

/// The (sequence n, chunk k) whose checkpoints live in `slot`; k = -1 for a slot no chunk uses.
__device__ __forceinline__ void slot_chunk(const RecArgs& a, int64_t slot, int* n, int64_t* k) {
  int lo = 0, hi = a.N - 1;  // the largest n whose first slot is <= slot
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (slot_base(seq_of(a, mid).row0, mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const Seq s = seq_of(a, lo);
  const int64_t ck = slot - slot_base(s.row0, lo);
  *n = lo;
  *k = ck < (s.len + kBwdChunk - 1) / kBwdChunk ? ck : -1;
}

/// End (exclusive) of the token range of chunk k of sequence s.
__device__ __forceinline__ int64_t chunk_end(const Seq& s, int64_t k) {
  return s.len < (k + 1) * kBwdChunk ? s.len : (k + 1) * kBwdChunk;
}

}  // namespace
}  // namespace dgps::cuda::kernels
