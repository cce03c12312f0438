/// @brief The boundary of the compiled CPU leaf kernels (library dgps_cpu_kernels): a plain params struct.
///
/// The header side (dgps/cpu/backend.hpp) converts a validated detail::Problem<T> into KernelParams
/// and calls one of the entry points below. The kernels are compiled once per instruction set
/// (AVX-512, AVX2+FMA, generic on x86; NEON64, generic on aarch64) and chosen at run time in one place
/// (backends/cpu/dispatch.cpp); the environment variable DGPS_MAX_CPU_ISA (avx512 | avx2 | neon64 | generic) caps
/// the choice.
#pragma once

#include <cstdint>

#include "dgps/export.hpp"
#include "dgps/model_spec.hpp"

namespace dgps::cpu::kernels {

/// Element type of the inputs and outputs of one call. States (h0/hT/a0/aT) are double for f64 and
/// float otherwise: bf16 and f16 inputs are converted to float at load and `o` is rounded at store,
/// all computation is float32 (SPEC §5).
enum class DType { f32, f64, bf16, f16 };

/// A strided view as the kernels see it: element (i0, .., i3) at data[i0*stride[0] + .. + i3*stride[3]];
/// the last used dimension is contiguous. `data == nullptr` means absent.
struct KView {
  void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
};

/// Everything one forward or decode call needs, already validated (detail/check.hpp).
struct KernelParams {
  DType dtype = DType::f32;
  ModelSpec spec;
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0;
  const int64_t* cu_seqlens = nullptr;  ///< [N+1] or null
  const int64_t* slots = nullptr;       ///< decode: state index of sequence n, or null
  /// Decode through a state pool (dgps::DecodeState), each [N] or null: the state read by sequence n
  /// (-1: zero / default start; null: `slots`), the state its final state is written to (-1: none),
  /// padding sequences (o zero, nothing read or written). `token_slots` [N, token_ld]: the state
  /// after token t of sequence n is written to slot token_slots[n * token_ld + t] (skipped when
  /// negative), and no final state is written.
  const int64_t* in_slots = nullptr;
  const int64_t* out_slots = nullptr;
  const unsigned char* padded = nullptr;
  const int64_t* token_slots = nullptr;
  int64_t token_ld = 0;
  KView q, k, v, g, beta, g_p, beta_p, center;  ///< inputs [B,T,H,K] .. center [H]
  KView h0, a0;                                 ///< initial states [N,HV,K,V], [N,H,K] (or [N,H,K,K])
  KView o, hT, aT;                              ///< outputs
  KView d_o, dhT, daT;                          ///< backward cotangents [B,T,HV,V], [N,HV,K,V], [N,H,K]
  KView dq, dk, dv, dg, dbeta, dg_p, dbeta_p, dcenter;  ///< backward: input gradients (absent = not wanted)
  KView dh0, da0;                                       ///< backward: initial-state gradients
  double scale = 1, x = 1.5, eps = 1e-6, lambda = 1;
  bool l2norm = true;
  int threads = 0;     ///< 0 = all available
  int64_t chunk = 64;  ///< chunk length C of the chunkwise algorithm
  /// Training cache (dgps::TrainingCache) of the chunkwise kernels, or null: written by a forward when
  /// `save`, read by a backward otherwise. Elements of the state type; for sequence n, value head hv
  /// and chunk ci, one block of `saved_block` elements at (saved_chunk0[n] * HV + hv * chunks(n) + ci)
  /// * saved_block, chunks(n) = ceil(len_n / chunk): S_in (K rows of `saved_ld`), then for the Online
  /// solve R (chunk rows of `saved_ld`), then P (chunk rows of `saved_pld`; P[i][j] = Aqk[i][j] for
  /// j <= i, the unscaled key product Akk[j][i] / beta_j for j > i), then with a diagonal
  /// preconditioner the statistics A entering the chunk (K values at `saved_aoff`). Rows are 64-byte
  /// aligned. Checkpoints (`saved_seg` > 0): one block per segment of saved_seg chunks (chunks(n)
  /// counts segments), the state entering the segment and the statistics at `saved_aoff`.
  void* saved = nullptr;
  bool save = false;
  const int64_t* saved_chunk0 = nullptr;  ///< [N + 1] prefix sums of chunks(n)
  int64_t saved_ld = 0, saved_pld = 0, saved_aoff = 0, saved_block = 0;
  int64_t saved_seg = 0;  ///< 0: the full cache; else chunks per checkpoint

  /// First token and length of sequence n; its batch row; its state index.
  int64_t seq_begin(int64_t n) const { return cu_seqlens ? cu_seqlens[n] : 0; }
  int64_t seq_len(int64_t n) const { return cu_seqlens ? cu_seqlens[n + 1] - cu_seqlens[n] : T; }
  int64_t seq_batch(int64_t n) const { return cu_seqlens ? 0 : n; }
  int64_t state_index(int64_t n) const { return slots ? slots[n] : n; }
};

using dgps::chunkwise_covers;

/// Name of the instruction set the kernels use in this process: "avx512", "avx2", "neon64" or "generic".
DGPS_API const char* isa_name();

/// Chunkwise forward (SPEC §4) of a call `chunkwise_covers` accepts: writes o, and hT/aT when given,
/// and the training cache when `saved` and `save` are set. Parallel over (sequence, value head) on
/// `threads` threads. Returns "cpu/chunkwise/<isa>".
DGPS_API const char* chunkwise_forward(const KernelParams& p);

/// Chunkwise backward (SPEC §4, paper App. D) of a call `chunkwise_covers` accepts: writes every
/// gradient whose view is given (dq .. dcenter, dh0, da0) for the cotangents d_o and, when given,
/// dhT/daT. With `saved` (and `save` false) it reads each chunk's S_in, R and intra-chunk matrices from
/// the training cache instead of recomputing them with a forward sweep. Parallel over (sequence, key
/// head); dcenter is reduced over sequences in a fixed order.
/// Returns "cpu/chunkwise/<isa>".
DGPS_API const char* chunkwise_backward(const KernelParams& p);

/// Decode of `p.T` tokens per sequence (SPEC §2 token by token) for every model: reads the states
/// from h0/a0 and writes them to hT/aT (the same memory is allowed: states are updated in place).
/// Returns "cpu/decode/<isa>".
DGPS_API const char* decode(const KernelParams& p);

/// Backward of the exact preconditioners (ExactATK / ExactATQ with every decay, gain and solve; SPEC §2 and §3.8)
/// in float or double: the recurrence in reverse, the inverse Gram in double, run back from the end of each
/// sequence by the Sherman-Morrison step's inverse (backends/cpu/exact_backward.hpp). Writes every gradient whose
/// view is given; da0 is the raw gradient of the update as written (as the reference). States are checkpointed
/// every `chunk` tokens. Parallel over (sequence, key head). Returns "cpu/exact/<isa>".
DGPS_API const char* exact_backward(const KernelParams& p);

}  // namespace dgps::cpu::kernels
