/// @brief The CUDA backward's launch arguments (SPEC §3.8) and its launcher: float32 state arithmetic,
/// fixed-order reductions (deterministic), every model the forward covers.
///
/// Eight kernels on the caller's stream, sized from host-known bounds (no host synchronisation). With
/// BwdArgs::chunk (16-bit inputs, chunk_backward_covers) every step runs chunkwise instead
/// (launch/chunk_backward_launch.cuh): steps 3 to 5 on tensor cores, and steps 1, 2, 6 to 8 per (chunk, key
/// head) from the forward's chunk statistics, without per-token float32 arrays of q, k, A, M or dA;
/// with the Identity preconditioner and no GVA the gradient kernel finishes dq and dk itself. The
/// float32 (recurrent) backward:
///   1. `norm_kernel`: the normalised, scaled q and k of every token (SPEC §1), zero-padded to Kp.
///   2. `stats_*_kernel` (diagonal preconditioners): the statistics A_t and squash M_t (SPEC §2), a
///      first-order scan chunked in three steps (per chunk, across chunks, per chunk again).
///   3. `state_fwd_kernel`: the recurrence per (sequence, value head, 2 to 8 value columns); stores the
///      residuals r_t (v_t for the Offline solve) and the state entering every 64-token chunk.
///   4. `state_rev_kernel`: the reverse recurrence of the state gradient G (it needs no state):
///      G_t = qr_t do_t^T + D_{t+1} (G_{t+1} - kn_{t+1} dr_{t+1}^T), dr_t = b_t G_t^T kw_t = dv_t; stores
///      dr_t and the gradient entering every chunk from its future, and writes dv and dh0.
///   5. `chunk_grad_kernel`: per (chunk, value head), with S_0, H (the chunk's boundary state and
///      future gradient), r and dr known, every key-side gradient is a sum of products (C = chunk):
///        dqr_i = e^{γ_i} S_0 do_i + Σ_{j<=i} e^{γ_i-γ_j} b_j kw_j (r_j·do_i)
///        dkn_i = -e^{γ_i} S_0 dr_i - Σ_{j<i} e^{γ_i-γ_j} b_j kw_j (r_j·dr_i)
///        P_i   = G_i r_i = Σ_{j>=i} e^{γ_j-γ_i} qr_j (do_j·r_i) - Σ_{j>i} e^{γ_j-γ_i} kn_j (dr_j·r_i)
///                + e^{γ_C-γ_i} H r_i
///        dkw_i = b_i P_i,  db_i = kw_i·P_i,
///        dγ_i = qr_i⊙dqr_i + kn_i⊙dkn_i - kw_i⊙dkw_i (+ Σ_v H ⊙ S_C at the last row), dg = suffix sums of dγ;
///      every exponent is a difference of cumulative gates of a later and an earlier token, so it is <= 0
///      for g <= 0 and stays finite for g = -50.
///   6. `key_grad_kernel`: sums the key-side gradients over the value heads of a group (GVA) and chains
///      them through kw = k ⊙ M or qr = q ⊙ M (dM, the local dA and dcenter's per-token terms).
///   7. `stats_rev_*_kernel` (diagonal preconditioners): the reverse scan of dA, chunked the same way, through
///      A_t = e^{g_p,t} A_{t-1} + beta_p,t k_t^2, and da0.
///   8. `input_grad_kernel`: dg_p, dbeta_p, the statistics' term of dk, and the L2 norm's backward:
///      dq, dk; then `center_grad_kernel` sums dcenter per head in a fixed order.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "launch/chunk.cuh"
#include "launch/recurrent.cuh"

namespace dgps::cuda::kernels {

/// Chunk length of the backward's checkpoints and of its key-gradient kernel.
constexpr int kBwdChunk = 64;

/// Launch arguments of the backward: the forward's inputs, the cotangents, the gradient destinations
/// (null when not requested) and the float32 workspace.
struct BwdArgs {
  RecArgs a;  ///< forward inputs (a.o, a.hT, a.aT unused)
  const void* d_o = nullptr;
  const float *dhT = nullptr, *daT = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg = nullptr, *dbeta = nullptr;
  void *dgp = nullptr, *dbp = nullptr, *dcenter = nullptr;
  float *dh0 = nullptr, *da0 = nullptr;
  int64_t sdo[3]{}, sdhT[3]{}, sdaT[3]{}, sdq[3]{}, sdk[3]{}, sdv[3]{}, sdg[3]{}, sdbeta[3]{};
  int64_t sdgp[3]{}, sdbp[3]{}, sdh0[3]{}, sda0[3]{};
  /// With the chunkwise backward (host pointer, launch_backward only): its arguments; steps 3 to 5 run
  /// on tensor cores (launch/chunk_backward_launch.cuh) and R, dR, S, G are not allocated.
  const ChunkArgs* chunk = nullptr;
  bool pair_dq = false, pair_dk = false, pair_dv = false;  ///< written two elements at a time (pair_rows)
  int Kp = 64;        ///< K padded to 64 or 128 (row length of the key-side workspace arrays)
  int64_t rows = 0;   ///< B * T token rows
  int64_t slots = 0;  ///< checkpoint slots: rows / 64 + 2 N + 1
  // Workspace (device), laid out by bwd_workspace().
  // qn, kn, A, M, dA, R, dR, S, G: recurrent backward only.
  float *qn = nullptr, *kn = nullptr;  ///< [rows, H, Kp] normalised q (times scale) and k
  float *rq = nullptr, *rk = nullptr;  ///< [rows, H] their inverse norms (1 without the L2 norm)
  float *A = nullptr, *M = nullptr;    ///< [rows, H, Kp] statistics and squash (M reused by step 7)
  float *R = nullptr, *dR = nullptr;   ///< [rows, HV, V] residuals r_t and their gradients dr_t
  float *S = nullptr, *G = nullptr;    ///< [slots, HV, Kp, V] chunk-entry states, future state gradients
  float *dQ = nullptr, *dKn = nullptr, *dKW = nullptr;  ///< [rows, HV, Kp] gradients of qr, read key, write key
  float* dA = nullptr;                                  ///< [rows, H, Kp] local dA, then the scanned one
  float* dcen = nullptr;                                ///< [rows, H] per-token dcenter terms (chunkwise: [chunks, H])
  float2* sums = nullptr;  ///< [slots, H, Kp] per-chunk (decay product, local scan) of a stats scan
  float* carry = nullptr;  ///< [slots, H, Kp] a stats scan's value entering each chunk
};

/// Whether the chunkwise backward's gradient kernel finishes dq and dk itself (Identity preconditioner,
/// one value head per key head): steps 6 and 8 do not run and qn, kn, dQ, dKn, dKW are not allocated.
__host__ __device__ inline bool fused_key_grads(const BwdArgs& b) {
  return b.chunk != nullptr && b.a.precond == kPrecondIdentity && b.a.group == 1;
}

/// Thread c of key head h, sequence n: the reverse scan of the statistics' gradient across the
/// sequence's chunks `first` .. `first + count - 1` (rows of b.sums / b.carry, [chunks, H, Kp]): each
/// chunk's carry from its future (daT at the end), x <- P x + local per chunk, then da0.
__device__ __forceinline__ void stats_reverse_carry(const BwdArgs& b, int n, int h, int c, int64_t first,
                                                    int64_t count) {
  const RecArgs& a = b.a;
  float x = (b.daT && c < a.K) ? b.daT[n * b.sdaT[0] + h * b.sdaT[1] + c] : 0.f;
  const int64_t e0 = (first * a.H + h) * b.Kp + c;
  x = scan_chunk_sums<true>(b.sums + e0, b.carry + e0, int64_t(a.H) * b.Kp, count, x);
  if (b.da0 && c < a.K) b.da0[n * b.sda0[0] + h * b.sda0[1] + c] = x;
}

/// Bytes of workspace of the backward; with `base` non-null (256-byte aligned), also points `b`'s
/// workspace pointers into it.
size_t bwd_workspace(BwdArgs& b, void* base);

/// Launches the backward for input type Tin (float, __nv_bfloat16 or __half).
template <class Tin>
cudaError_t launch_backward(const BwdArgs& b, cudaStream_t stream);

}  // namespace dgps::cuda::kernels
