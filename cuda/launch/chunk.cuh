/// @brief The chunkwise forward's launch arguments (SPEC §4 on tensor cores) and its launcher.
///
/// The forward runs as up to five kernels on the caller's stream, all sized from host-known bounds so
/// that nothing synchronises with the host (varlen chunk positions are resolved on the device):
///   1. `chunk_map_kernel` (varlen only): the chunk list of a packed batch (sequence, chunk) and each
///      sequence's first chunk.
///   2. `precond_sums_kernel` and 3. `precond_scan_kernel` (diagonal preconditioners, the backward's
///      forward only): the statistics A_t of SPEC §2 at every chunk start, as a chunked first-order scan
///      (SPEC §4): each chunk's sums by a persistent kernel that copies the next chunk's k rows while it
///      sums the current one, then the scan over each sequence's chunks (a programmatic dependent launch
///      on Hopper). The forward instead zeroes the look-back's words (one memset) and the intra-chunk
///      kernel forms the statistics entering each chunk itself (ChunkArgs::lookback), so that k is read once.
///   4. `intra_kernel`: everything inside a chunk that does not depend on the state, in parallel over
///      (chunk, value head): normalised q, k, the write key kw or read query qr, the triangular solve
///      Tm = (I + Akk)^{-1} Diag(beta) (16 x 16 diagonal blocks by float32 substitution, the blocks
///      below them merged on tensor cores with f16 operands), W = Tm (K ⊙ e^gamma), U = Tm V, the masked decayed
///      block P = (Q KW^T) ⊙ e^(gamma_i - gamma_j), and gamma; products on tensor cores (bf16 or f16
///      operands, float32 accumulation). Bound by the latency of its phases, so its shared-memory
///      layouts are chosen for blocks per SM: the quad layout (forward, scalar or no decay, raw rows,
///      Identity or DiagonalATK: four), the lean Diagonal-decay layout (three), the standard one (three,
///      two with Diagonal decay without raw v rows). After the statistics' scan (backward) it is a
///      programmatic dependent launch on Hopper.
///   5. `state_kernel`: the sequential pass over chunks per (sequence, value head, value tile): R = U - W S,
///      O = Diag(e^gamma) Q S + P R, S <- e^gamma_C S + KW^T Diag(e^(gamma_C - gamma)) R with the state
///      in float32 registers (its bf16 copy feeds the tensor cores); the decays scale accumulator rows.
///      The value tile is the widest that still gives every SM a block (state_value_tile). The 8-warp
///      pass reads q and k rows straight from 16-bit inputs where they are its operands (raw_q,
///      raw_kw: K = 128, per-token decays), and the intra kernel then writes their inverse norms
///      instead of the Q and KW tiles. With 4 compute warps (value tiles of 16-64 columns: few
///      sequences, long ones) a fifth warp copies the chunk tiles ahead (ProducerPipe in
///      launch/chunk_launch.cuh); with 8 the compute warps copy one chunk ahead themselves. On Hopper, tiles of
///      64 and 128 columns run `state_wg_kernel` instead (warpgroup products, the state in
///      accumulators): the intra-chunk kernel writes its tiles blocked for it (ChunkArgs::blocked), one
///      thread copies each chunk's tiles with bulk copies and the raw q, k rows with tensor copies
///      (ChunkArgs::tma_rows), all completing on an mbarrier per buffer. With 128-column tiles, 16-bit
///      inputs, the delta rule and V = 128 that pass also reads the raw v rows and the solve Tm and forms
///      R = Tm (V - Diag(e^gamma) K S) itself (ChunkArgs::raw_v): the intra-chunk kernel then stops
///      after the solve (no v rows, no W or U products). A few long sequences (too few (sequence, value
///      head) pairs for the SMs) split that pass into segments (ChunkArgs::split): each segment's
///      transition and offset in parallel, `split_scan_kernel` chaining them, then every segment's
///      outputs from its start state.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "plan.hpp"
#include "launch/recurrent.cuh"

namespace dgps::cuda::kernels {

/// Chunk length of the CUDA chunkwise forward.
constexpr int kChunk = 64;
/// Key dimension capacity of the chunkwise kernels (K is zero-padded to it).
constexpr int kChunkKeys = 128;
/// Largest value dimension of the chunkwise kernels.
constexpr int kChunkMaxV = 128;

/// Tile layout of the chunkwise kernels (shared-memory sizes are known on the host, so a launch can
/// pick the value-tile width that fits the device).
namespace layout {
constexpr int C = kChunk;
constexpr int KP = kChunkKeys;
constexpr int LDK = KP + 8;  ///< padded row of a C x 128 tile of 16-bit operands
constexpr int LDC = C + 8;   ///< padded row of a C x C tile
/// Bytes of the intra-chunk kernel's solve region: Akk's 16 x 16 diagonal blocks in float32, Akk
/// and Tinv in f16 ([C][LDC] each) and four 16 x 24 f16 scratch tiles; the v tile reuses it.
constexpr size_t kSolveBytes = sizeof(float) * 4 * 16 * 17 + sizeof(uint16_t) * (2 * C * LDC + 4 * 16 * 24);
static_assert(kSolveBytes >= sizeof(uint16_t) * C * (kChunkMaxV + 8), "the v tile fits in the solve region");
/// Row length of the per-channel gamma tile (Diagonal decay), in floats: rows 16 banks apart, so the
/// float2 reads of an mma fragment's two row groups fall in different banks.
constexpr int LDG = KP + 8;
/// Dynamic shared memory of the intra-chunk kernel: q, k (and kw for DiagonalATK) tiles, Tm, the solve region.
/// With Diagonal decay a third tile holds the rescaled kw, and the C x C staging tile and the solve's
/// scratch live in the gamma tile's place (see intra_kernel), so KDA and PKDA keep two blocks per SM.
/// DiagonalATK with scalar or no decay: no Tm tile and no scratch in the solve region (they live in
/// Tinv's place and the q tile), so PGDN and PDN keep three blocks per SM like GDN.
constexpr size_t intra_smem_bytes(bool atk, bool diag = false) {
  return diag  ? sizeof(uint16_t) * 3 * C * LDK + sizeof(float) * 4 * 16 * 17 + sizeof(uint16_t) * 2 * C * LDC +
                    sizeof(float) * C * LDG
         : atk ? sizeof(uint16_t) * (3 * C * LDK + 2 * C * LDC) + sizeof(float) * 4 * 16 * 17
               : sizeof(uint16_t) * (2 * C * LDK + C * LDC) + kSolveBytes;
}
static_assert(sizeof(uint16_t) * C * LDK >= sizeof(uint16_t) * 4 * 16 * 24, "the q tile holds the solve's scratch");
/// Bytes of the intra-chunk kernel's shared memory with Diagonal decay and raw v rows (its lean layout,
/// three blocks per SM): three key tiles, Akk's diagonal blocks, Akk, and gamma at each 16-row block's
/// first and last rows ([8][KP] floats); Tinv and the solve's scratch take the q tile once it is out.
constexpr size_t intra_lean_smem_bytes() {
  return sizeof(uint16_t) * (3 * C * LDK + C * LDC) + sizeof(float) * (4 * 16 * 17 + 8 * KP);
}
static_assert(C * LDK >= C * LDC + 4 * 16 * 24, "the q tile holds Tinv and the solve's scratch");
/// Bytes of the intra-chunk kernel's quad layout (scalar or no decay, raw rows, Identity or DiagonalATK:
/// four blocks per SM): the q and k tiles, and kw's with DiagonalATK. Akk goes into the q tile's rows,
/// Tinv, the solve's scratch and Tm into the k tile after the products.
constexpr size_t intra_quad_smem_bytes(bool atk) { return sizeof(uint16_t) * (atk ? 3 : 2) * C * LDK; }
/// The quad layouts' instances of the intra-chunk kernel (its QUAD parameter; 0: the other layouts).
constexpr int kQuadIdentity = 1, kQuadATK = 2;
static_assert(LDK % 2 == 0 && C + 2 * 16 <= LDK, "Akk's diagonal block fits in the q rows' tails");
static_assert(sizeof(float) * C * LDG >= sizeof(uint16_t) * (C * (kChunkMaxV + 8) + 4 * 16 * 24),
              "the gamma tile holds the v tile and the solve's scratch");
/// 16-bit elements of one buffer of a chunk's tiles in the state kernel with VT value columns: W, Q,
/// KW (C x 128 each), U (C x VT), P (C x C) and 192 floats of row factors: C of gamma and 2 C of the
/// raw rows' inverse norms (ChunkArgs::raw_q), or with Diagonal decay 128 of e^gamma_C.
constexpr int state_buffer_elems(int VT) { return 3 * C * LDK + C * (VT + 8) + C * LDC + 3 * KP; }
/// Dynamic shared memory of the state kernel: `stages` tile buffers, the state's operand copy, R and
/// R ⊙ e^(gamma_C - gamma).
constexpr size_t state_smem_bytes(int VT, int stages = 2) {
  return sizeof(uint16_t) * (stages * state_buffer_elems(VT) + kChunkKeys * (VT + 8) + 2 * C * (VT + 8));
}
/// The warpgroup state pass (sm_90a, forward; wgmma.cuh's blocked tiles). The intra-chunk kernel writes
/// W, Q, KW, P and U packed for it (ChunkArgs::blocked: column groups of C rows x 16 bytes), so each
/// tile arrives by one bulk copy; the raw q and k rows (ChunkArgs::raw_q, raw_kw) are copied by the
/// threads, into column groups of kWgColGroup bytes (128 + 16 of padding) against bank conflicts.
constexpr int kWgColGroup = 144;
constexpr int kWgKeyTile = C / 8 * (KP / 8) * kWgColGroup;  ///< room for a C x 128 tile, raw or packed
constexpr int kWgPacked = C * KP * 2;                       ///< a packed C x 128 tile
/// Byte offsets in one buffer of a chunk's tiles with VT value columns: W, U (C x VT), P (packed), the
/// row factors (kWgFactorBytes), then Q and KW (packed, or raw rows padded) and Tm (packed, C x C). With
/// ChunkArgs::raw_v, W's place holds the raw k rows (when KW is not k itself) and U's the raw v rows.
/// The row factors: C floats of gamma and 2 C of the raw rows' inverse norms (or 128 of e^gamma_C with
/// Diagonal decay), then with ChunkArgs::kw_state the statistics entering the chunk (128 floats, at
/// kWgAinOff) and the rows' e^g_p and beta_p (2 C floats, at kWgPgOff).
constexpr int kWgAinOff = 768, kWgPgOff = kWgAinOff + 4 * KP, kWgFactorBytes = kWgPgOff + 8 * C;
constexpr int wg_u_off() { return kWgPacked; }
constexpr int wg_p_off(int VT) { return kWgPacked + 2 * C * VT; }
constexpr int wg_g_off(int VT) { return wg_p_off(VT) + 2 * C * C; }
constexpr int wg_q_off(int VT) { return wg_g_off(VT) + kWgFactorBytes; }
constexpr int wg_kw_off(int VT) { return wg_q_off(VT) + kWgKeyTile; }
constexpr int wg_tm_off(int VT) { return wg_kw_off(VT) + kWgKeyTile; }
constexpr int wg_buffer_bytes(int VT) { return wg_tm_off(VT) + 2 * C * C; }
/// Byte offset of the warpgroup state pass's output stage (C token rows of VT 16-bit values and 16 bytes
/// of padding), after the two buffers, each warpgroup's 3 C row factors and the buffers' mbarriers (two
/// per buffer: all of a chunk's copies, and with ChunkArgs::kw_state the write keys' inputs first).
constexpr int wg_o_off(int VT) {
  return 2 * wg_buffer_bytes(VT) + static_cast<int>(sizeof(float)) * 3 * C * (VT / 64) + 4 * 8;
}
/// Dynamic shared memory of the warpgroup state pass.
constexpr size_t wg_smem_bytes(int VT) { return size_t(wg_o_off(VT)) + size_t(C) * (2 * VT + 16); }
static_assert(wg_o_off(64) % 16 == 0 && wg_o_off(128) % 16 == 0, "the output stage's rows are 16-byte aligned");
static_assert(wg_q_off(64) % 16 == 0 && wg_buffer_bytes(64) % 16 == 0, "bulk copies land 16-byte aligned");
static_assert(wg_smem_bytes(128) <= 232448, "the 128-column warpgroup state pass fits an H100 / H200 block");
/// Backward mode: the prep kernel's tiles T2, P [C][LDC], do, Y, KWn [C][LDK] and C gates and gains.
constexpr size_t bwd_prep_smem_bytes() {
  return sizeof(uint16_t) * (2 * C * LDC + 3 * C * LDK) + sizeof(float) * 2 * C;
}
/// Backward mode: the reverse pass with VT value columns: `stages` buffers of {Wb, Qe, Ke [C][LDK], Ub,
/// do [C][VT + 8], the decays (C floats of gamma, or with Diagonal decay 128 of e^gamma_C)}, the state
/// gradient's operand copy [128][VT + 8] and dX [C][VT + 8].
constexpr int bwd_rev_buffer_elems(int VT) { return 3 * C * LDK + 2 * C * (VT + 8) + 2 * KP; }
constexpr size_t bwd_rev_smem_bytes(int VT, int stages = 2) {
  return sizeof(uint16_t) * (stages * bwd_rev_buffer_elems(VT) + (KP + C) * (VT + 8));
}
/// Backward mode: the gradient kernel's do, r, dX [C][LDK], S_0, H [128][LDK], qr, kn, kw,
/// Diag(beta) kw [C][LDK], the masked products [C][LDC] x 2, float row sums of 4 column groups, a
/// 512-thread reduction and (Diagonal decay) 5 x 128 per-channel sums. With Diagonal decay, phase 1's
/// region (do .. H) later holds gamma [C][LDG] and two scaled key tiles [C][LDK], then dgamma [C][LDG].
constexpr size_t bwd_grad_smem_bytes() {
  return sizeof(uint16_t) * (7 * C * LDK + 2 * KP * LDK + 2 * C * LDC) + sizeof(float) * (15 * C + 6 * KP + 512);
}
static_assert(sizeof(float) * 2 * C * LDG <= sizeof(uint16_t) * (3 * C * LDK + 2 * KP * LDK),
              "gamma and dgamma fit in phase 1's region");
}  // namespace layout

/// A first-order scan across a sequence's `count` chunks, x <- P x + s with (P, s) = sums[k * stride],
/// forward (REVERSE false) or from the last chunk: carry[k * stride] gets the x entering chunk k; returns
/// the x leaving the sequence. The sums are loaded kAhead at a time, so one memory round trip serves
/// kAhead chunks (a scan over 512 chunks was 512 round trips). (Splitting the chunks over 4 threads
/// per channel, a compose pass then a rescan, measured slower at 512 chunks.)
template <bool REVERSE>
__device__ __forceinline__ float scan_chunk_sums(const float2* sums, float* carry, int64_t stride, int64_t count,
                                                 float x) {
  constexpr int kAhead = 32;
  for (int64_t i0 = 0; i0 < count; i0 += kAhead) {
    float2 s[kAhead];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int64_t k = REVERSE ? count - 1 - i0 - j : i0 + j;
      s[j] = i0 + j < count ? sums[k * stride] : make_float2(1.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int64_t k = REVERSE ? count - 1 - i0 - j : i0 + j;
      if (i0 + j < count) carry[k * stride] = x;
      x = fmaf(s[j].x, x, s[j].y);
    }
  }
  return x;
}

/// Largest dynamic shared memory per block on the current device (opt-in), in bytes.
size_t chunk_max_smem();

/// Launch arguments of the chunkwise forward: the recurrent kernels' arguments plus the workspace.
struct ChunkArgs {
  RecArgs a;
  int64_t chunks_per_seq = 0;  ///< ceil(T / C) when cu_seqlens is null
  int64_t chunk_bound = 0;     ///< grid size in chunks: B * ceil(T / C), or ceil(T / C) + N with cu_seqlens
  int Vpad = 0;                ///< V rounded up to 64 (row length of U in the workspace)
  int state_vt = 0;            ///< value columns per block of the state pass (state_value_tile)
  bool vec_qk = false;         ///< q and k rows can be read 16 bytes at a time (aligned, K % 8 == 0)
  bool vec_v = false;          ///< v rows can be read 16 bytes at a time
  bool pair_o = false;         ///< o can be written two adjacent elements at a time (pair_rows)
  bool vec_o = false;          ///< o rows can be written 16 bytes at a time (aligned, V % 8 == 0)
  // Workspace (device), laid out by chunk_workspace().
  int2* map = nullptr;       ///< [chunk_bound] (sequence, chunk) of each global chunk, n = -1 past the end
  int64_t* first = nullptr;  ///< [N + 1] first global chunk of each sequence
  void *W = nullptr, *Qn = nullptr, *KWn = nullptr;  ///< [chunk_bound, HV, C, 128] operand type: W, q (qr), kw
  void *U = nullptr, *P = nullptr;                   ///< [chunk_bound, HV, C, Vpad], [chunk_bound, HV, C, C]
  float* gam = nullptr;    ///< [chunk_bound, HV, C] cumulative log decay gamma within the chunk
  float* egC = nullptr;    ///< [chunk_bound, HV, 128] Diagonal decay: e^gamma_C per key channel
  float2* sums = nullptr;  ///< [chunk_bound, H, 128] (decay product, weighted sum) of the statistics
  float* Ain = nullptr;    ///< [chunk_bound, H, 128] statistics entering each chunk
  /// Forward with a diagonal preconditioner: the intra-chunk kernel forms the statistics entering each
  /// chunk itself by a look-back over the previous chunks (no sums or scan kernel, so k is read once), and
  /// writes aT and, with kw_state, Ain (the warpgroup pass forms the write keys from it). Each block
  /// publishes its chunk's statistics from zero with the chunk's product of e^g_p and, once it has the
  /// statistics entering the chunk, those leaving it (tagged 64-bit words, one per channel: no barrier,
  /// no fence); chunk c folds the words of chunks max(c - kLookback, 0) .. c - 1 onto a0 or onto the
  /// statistics leaving the chunk before them, always in that order (the same bits in every run). The
  /// grid is one-dimensional, its blocks ordered so that a chunk's predecessors have smaller indices
  /// (chunk index major with equal-length sequences, global chunk major with packed ones): a block waits
  /// only on blocks dispatched before it. The workspace has no sums then (nor Ain without kw_state).
  bool lookback = false;
  /// [2, chunk_bound, HV, 128] words (st_word; zeroed per call): the chunks' statistics from zero with
  /// their products of e^g_p, then the statistics leaving them
  uint64_t* lb = nullptr;
  /// Forward only, 16-bit inputs of the operand type, K = 128, 16-byte rows, scalar or no decay: the
  /// state pass copies the raw q rows (raw_q: no DiagonalATQ) and k rows as the write key (raw_kw: no
  /// DiagonalATK) from the inputs instead of the intra-chunk kernel's Qn and KWn tiles (which are then
  /// neither allocated nor written: 16 KB less traffic per tile each), and applies the rows' inverse
  /// norms (and q's scale) to its accumulator rows; the intra-chunk kernel writes the norms to `rn`.
  bool raw_q = false, raw_kw = false;
  /// DiagonalATK with raw q, k and v rows on the warpgroup state pass (PGDN, PDN; 16-bit, K = V = 128):
  /// the pass forms the write keys itself from its raw k rows, the statistics entering the chunk (Ain)
  /// and the rows' e^g_p and beta_p, which the intra-chunk kernel writes to `pg`, exactly as the
  /// intra-chunk kernel forms them for its Akk (the same operations on the same values: the same bits),
  /// so KWn is neither allocated nor written (16 KB less traffic per tile each way). Not in the split
  /// pass (its first pass would wait on the write keys).
  bool kw_state = false;
  float* pg = nullptr;  ///< [chunk_bound, HV, 2, C] kw_state: e^g_p of the chunk's rows, then beta_p (0 past L)
  /// Set by the plan when the warpgroup state pass follows: the intra-chunk kernel writes W, Qn, KWn,
  /// P and U blocked (element (r, c) of a tile at c / 8 * 8 C + r * 8 + c % 8: wgmma.cuh's packed layout),
  /// so that the pass copies each tile whole.
  bool blocked = false;
  /// Set by the plan (and cleared by the launcher where a tensor map cannot be made) when the warpgroup
  /// state pass copies the raw q and k rows with the copy engine (tensor maps over q and k, whose boxes
  /// land as packed blocked tiles) instead of cp.async.
  bool tma_rows = false;
  float* rn = nullptr;  ///< [chunk_bound, HV, 2, C] inverse norms of the chunk's q rows, then its k rows
  /// Forward on the warpgroup state pass with 128-column tiles, 16-bit inputs, an Online solve and V =
  /// 128: the pass forms the residual as R = Tm (V - Diag(e^gamma) K S) from the raw v rows (tensor
  /// copies where the map can be made), k rows and the solve Tm, which the intra-chunk kernel writes
  /// blocked to `Tm` instead of W = Tm (K ⊙ e^gamma) and U = Tm V (U is neither allocated nor written:
  /// the intra-chunk kernel reads no v rows and makes neither product; 24 KB less traffic per tile).
  /// The k rows are raw (KW's tile with raw_kw, else copied into W's place when raw_q is set) or, without
  /// raw rows, K ⊙ e^gamma (normalised, decayed per channel with Diagonal decay) that the intra-chunk
  /// kernel writes blocked to `W`.
  bool raw_v = false;
  void* Tm = nullptr;  ///< [chunk_bound, HV, C, C] the solve Tm = (I + Akk)^{-1} Diag(beta) (raw_v)
  /// The split state pass (raw_v, few (sequence, value head) pairs, long sequences; split_segments):
  /// each sequence's chunks in segments of `seg_chunks` (the last may be shorter; `split` of them for
  /// equal lengths, at most `split` for packed sequences), so that one sequence's sequential pass runs
  /// on several SMs. Each segment's state map S -> A S + B is linear: pass 1 (state_wg_kernel with TR) runs every segment but the last from
  /// S = I with no values (giving A) and from S = 0 (giving B), `split_scan_kernel` chains the segments
  /// from h0 in float32, and pass 2 (the forward's state pass) runs every segment from its start state,
  /// writing o and, in the last segment, hT. 0 or 1: no split.
  int split = 0;
  int64_t seg_chunks = 0;  ///< chunks per segment (split)
  float* Tseg = nullptr;   ///< [N, HV, split - 1, 2, 128, 128] per segment A^T, then B^T (rows: columns of S)
  float* Sseg = nullptr;   ///< [N, HV, split, 128, 128] the state entering each segment, transposed
  // Backward mode (launch_chunk_backward, chunk_backward.cuh): the intra-chunk kernel forms the
  // unscaled residuals' solve T2 = (I + Bm Diag(beta))^{-1} (W = T2 (K ⊙ e^gamma), U = T2 V, so the
  // state pass's R is the residual r itself, its update rows scaled by the gains) and writes Kn and
  // T2, and P Diag(beta) in P's place; the state pass writes the chunk-entry states and r (and o
  // when a.o is set: a training forward, api.cu's forward_training).
  bool bwd = false;
  bool saved = false;  ///< backward: a training forward already filled this workspace (no recompute)
  bool vec_do = false;  ///< do rows can be read 16 bytes at a time
  float *rq = nullptr,
        *rk = nullptr;  ///< [B * T, H] inverse norms of q and k, written by the intra-chunk kernel when set
  void *Kn = nullptr, *T2 = nullptr;  ///< [chunk_bound, HV, C, 128] read keys; [.., C, C] T2
  void *S0 = nullptr, *Hc = nullptr;  ///< [chunk_bound, HV, 128, Vpad] states entering / gradients leaving each chunk
  void *Rr = nullptr, *dX = nullptr, *dO = nullptr;  ///< [chunk_bound, HV, C, Vpad] r, dv and a copy of do
  /// Backward mode with Diagonal decay: Qn, Kn and KWn carry the decays (q ⊙ e^gamma, k ⊙ e^gamma,
  /// kw ⊙ e^(gamma_C - gamma)) and these [chunk_bound, HV, C, 128] tiles the undecayed rows (KWu is Ku
  /// when the write key is the read key).
  void *Qu = nullptr, *Ku = nullptr, *KWu = nullptr;
};

/// Bytes of the look-back's tagged words (ChunkArgs::lb).
inline size_t lookback_bytes(const ChunkArgs& c) {
  return sizeof(uint64_t) * size_t(c.chunk_bound) * size_t(c.a.HV) * 2 * kChunkKeys;
}

/// Bytes of workspace the chunkwise forward (or, with `c.bwd`, the chunkwise backward) needs; with `base` non-null,
/// also points `c`'s workspace pointers into it (base must be 256-byte aligned).
size_t chunk_workspace(ChunkArgs& c, void* base);

/// Value columns per block of the forward's state pass (128 with 8 warps, or 64, 32, 16 with 4 compute
/// warps and a producer warp): in the `forward` on Hopper (the warpgroup pass) 128 from a fifth of the SMs'
/// worth of (sequence, value head) pairs, else the widest tile that still gives every SM a block and fits
/// the device.
int state_value_tile(const RecArgs& a, int Vpad, bool forward);

/// Segments per sequence of the split state pass (ChunkArgs::split) for a call with 128-column tiles
/// and raw v rows: 0 (no split) unless the (sequence, value head) pairs leave three quarters of the SMs
/// idle and the sequences are long (64 chunks at least); then segments of about (chunks x HV / SMs)
/// chunks rounded up to a multiple of 16, so that pass 2 has about a block per SM. Packed sequences
/// (cu_seqlens) get as many segments as the whole batch could need (T / 64 chunks); the blocks of
/// shorter ones return at once. `forced`: 0 turns it off, n > 0 forces segments of n chunks wherever the split
/// applies at all (the tests' plan override), negative leaves the automatic choice. Sets c.seg_chunks
/// (the caller sets c.split).
int split_segments(ChunkArgs& c, int64_t forced);

/// True when the chunkwise kernels cover the call: Identity or diagonal preconditioner, every decay,
/// K <= 128, V <= 128, and the device has the shared memory of the smallest variant
/// (about 142 kB per block: Hopper and A100 class GPUs).
bool chunk_covers(const RecArgs& a);

/// True when the forward's sequential pass of `c` can run on warpgroup products (state_wg_kernel: Hopper
/// with its sm_90a code, 64- or 128-column tiles, not backward mode) for input type Tin.
template <class Tin>
bool chunk_wg_pass(const ChunkArgs& c);

/// Launches the chunkwise forward of `c` (its choices set by plan_chunkwise) for input type Tin (float,
/// __nv_bfloat16 or __half) with the launch choices of `plan`. The tensor-core operands are f16 for __half
/// inputs, bf16 otherwise. Where the driver cannot make a tensor map over the raw rows, the pass copies
/// them by cp.async and `plan.tma` is cleared.
template <class Tin>
cudaError_t launch_chunkwise(const ChunkArgs& c, Plan& plan, cudaStream_t stream);

struct BwdArgs;

/// True when the chunkwise backward covers the call: the chunkwise forward covers it (every decay), K
/// >= 64 and the inputs are 16-bit (its products run on 16-bit operands; float32 inputs keep the
/// float32 backward unless the chunkwise algorithm is asked for).
bool chunk_backward_covers(const RecArgs& a, bool half_inputs);

/// Launches the middle of the chunkwise backward (chunk_backward.cuh): from the normalised keys and
/// statistics in `b`'s workspace to the key-side gradients dQ, dKn, dKW, dbeta, dg, dv and dh0.
template <class Tin>
cudaError_t launch_chunk_backward(const ChunkArgs& c, const BwdArgs& b, cudaStream_t stream);

}  // namespace dgps::cuda::kernels
