/// @brief Host side of the chunkwise forward: coverage and the workspace layout.
#include <algorithm>

#include "launch/chunk.cuh"

namespace dgps::cuda::kernels {

size_t chunk_max_smem() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<size_t>(bytes);
}

int state_value_tile(const RecArgs& a, int Vpad, bool forward) {
  const int sms = sm_count();
  const int64_t heads = int64_t(a.N) * a.HV;
  const size_t smem = chunk_max_smem();
  // A block per head: in the forward on Hopper (the warpgroup pass) from a fifth of the SMs' worth of heads
  // (the plan grid, docs/performance-cuda.md: 128 columns beat 64, 32 and 16 at every point with 32 or more
  // heads, though most SMs idle), elsewhere (the 8-warp mma.sync pass) once the heads fill the GPU.
  const int64_t wide = forward && sm90_kernels() ? (sms + 4) / 5 : sms * 9 / 10;
  if (Vpad == 128 && heads >= wide && layout::state_smem_bytes(128) <= smem) return 128;
  if (heads * (Vpad / 64) >= sms && layout::state_smem_bytes(64) <= smem) return 64;
  if (heads * (Vpad / 32) >= sms && layout::state_smem_bytes(32) <= smem) return 32;
  return 16;
}

int split_segments(ChunkArgs& c, int64_t forced) {
  const RecArgs& a = c.a;
  c.seg_chunks = 0;
  // The most chunks one sequence has: every sequence's count, or the whole packed batch's at most.
  const int64_t count = a.cu_seqlens ? (a.T + kChunk - 1) / kChunk : c.chunks_per_seq;
  if (count < 2 || forced == 0) return 0;
  int64_t per = forced;
  if (per < 0) {
    // Automatic: only where the (sequence, value head) pairs leave three quarters of the SMs idle (from
    // half of them on, the unsplit 128-column pass was faster on the plan grid) and the sequences are 64
    // chunks long or more (2048 tokens with 8 or 16 heads ran faster on the unsplit 16-column pass); then
    // segments of a multiple of 16 chunks that spread every sequence's chunks (all of the batch's, or a
    // packed batch's total) over about one block per SM.
    const int sms = sm_count();
    const int64_t heads = int64_t(a.N) * a.HV, chunks = a.cu_seqlens ? count : int64_t(a.N) * count;
    if (4 * heads > sms || count < 64) return 0;
    per = ((chunks * a.HV + sms - 1) / sms + 15) / 16 * 16;
  }
  const int64_t segs = (count + per - 1) / per;  // every segment of the longest sequence non-empty
  // (pass 2's grid has N x segments blocks in z, at most 65535; only a forced segment length gets near)
  if (segs < 2 || segs * a.N > 65535) return 0;
  c.seg_chunks = per;
  return static_cast<int>(segs);
}

bool chunk_covers(const RecArgs& a) {
  const size_t need = std::max(layout::intra_smem_bytes(true, true), layout::state_smem_bytes(16));
  return a.K <= kChunkKeys && a.V <= kChunkMaxV && chunk_max_smem() >= need;
}

bool chunk_backward_covers(const RecArgs& a, bool half_inputs) {
  // K >= 64: the tiles are 128 channels wide (narrow heads mostly multiply padding), and a chunk's 64
  // keys in fewer dimensions make (I + Bm Diag(beta)) ill-conditioned for 16-bit operands.
  return half_inputs && a.K >= 64 && chunk_covers(a) && a.N > 0 &&
         chunk_max_smem() >= std::max(layout::bwd_grad_smem_bytes(), layout::bwd_rev_smem_bytes(16));
}

size_t chunk_workspace(ChunkArgs& c, void* base) {
  const RecArgs& a = c.a;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return base ? static_cast<char*>(base) + at : nullptr;
  };
  const size_t tiles = size_t(c.chunk_bound) * size_t(a.HV);
  const size_t op = 2;  // bf16 or f16 operands
  c.map = reinterpret_cast<int2*>(take(a.cu_seqlens ? sizeof(int2) * size_t(c.chunk_bound) : 0));
  c.first = reinterpret_cast<int64_t*>(take(a.cu_seqlens ? sizeof(int64_t) * size_t(a.N + 1) : 0));
  // raw_v: no W, but K ⊙ e^gamma in its place unless the state pass reads raw k rows (the same test
  // decides in intra_kernel's tiles_out whether it writes K ⊙ e^gamma, and in state_wg_kernel `kg`)
  const bool raw_k = c.raw_v && (c.raw_q || c.raw_kw);
  c.W = (a.online || c.bwd) && !raw_k ? take(op * tiles * kChunk * kChunkKeys) : nullptr;
  c.Qn = c.raw_q ? nullptr : take(op * tiles * kChunk * kChunkKeys);
  c.KWn = c.raw_kw || c.kw_state ? nullptr : take(op * tiles * kChunk * kChunkKeys);
  // (null unless set: the intra-chunk kernel writes it whenever it is not null)
  c.pg = c.kw_state ? reinterpret_cast<float*>(take(sizeof(float) * tiles * 2 * kChunk)) : nullptr;
  c.rn = c.raw_q || c.raw_kw ? reinterpret_cast<float*>(take(sizeof(float) * tiles * 2 * kChunk)) : nullptr;
  c.U = c.raw_v ? nullptr : take(op * tiles * kChunk * size_t(c.Vpad));
  c.Tm = c.raw_v ? take(op * tiles * kChunk * kChunk) : nullptr;
  c.P = take(op * tiles * kChunk * kChunk);
  c.gam = reinterpret_cast<float*>(take(sizeof(float) * tiles * kChunk));
  c.egC = reinterpret_cast<float*>(take(a.decay == kDecayDiagonal ? sizeof(float) * tiles * kChunkKeys : 0));
  const size_t heads = size_t(a.N) * size_t(a.HV), square = size_t(kChunkKeys) * kChunkKeys;
  c.Tseg = reinterpret_cast<float*>(take(c.split > 1 ? sizeof(float) * heads * size_t(c.split - 1) * 2 * square : 0));
  c.Sseg = reinterpret_cast<float*>(take(c.split > 1 ? sizeof(float) * heads * size_t(c.split) * square : 0));
  const bool diag = a.precond != kPrecondIdentity;
  const size_t stats = size_t(c.chunk_bound) * size_t(a.H) * kChunkKeys;
  c.sums = reinterpret_cast<float2*>(take(diag && !c.lookback ? sizeof(float2) * stats : 0));
  c.lb = reinterpret_cast<uint64_t*>(take(diag && c.lookback ? lookback_bytes(c) : 0));
  // (the look-back writes Ain only for the warpgroup pass's write keys, ChunkArgs::kw_state)
  c.Ain = reinterpret_cast<float*>(take(diag && (!c.lookback || c.kw_state) ? sizeof(float) * stats : 0));
  if (c.bwd) {
    c.Kn = take(op * tiles * kChunk * kChunkKeys);
    c.T2 = take(op * tiles * kChunk * kChunk);
    c.S0 = take(op * tiles * kChunkKeys * size_t(c.Vpad));
    c.Hc = take(op * tiles * kChunkKeys * size_t(c.Vpad));
    c.Rr = take(op * tiles * kChunk * size_t(c.Vpad));
    c.dX = take(op * tiles * kChunk * size_t(c.Vpad));
    c.dO = take(op * tiles * kChunk * size_t(c.Vpad));
    if (a.decay == kDecayDiagonal) {
      c.Qu = take(op * tiles * kChunk * kChunkKeys);
      c.Ku = take(op * tiles * kChunk * kChunkKeys);
      c.KWu = a.precond == kPrecondATK ? take(op * tiles * kChunk * kChunkKeys) : c.Ku;
    }
  }
  return off;
}

}  // namespace dgps::cuda::kernels
