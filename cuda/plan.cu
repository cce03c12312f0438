/// @brief The CUDA backend's plan of a call: every heuristic that picks a kernel, a tile width or a launch attribute.
#include "plan.hpp"

#include <array>
#include <atomic>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch/chunk.cuh"
#include "launch/exact.cuh"
#include "launch/recurrent.cuh"

namespace dgps::cuda {

namespace testing {
namespace {
std::atomic<const PlanOverride*> g_override{nullptr};
thread_local Plan g_last;
}  // namespace

const PlanOverride* plan_override() { return g_override.load(std::memory_order_acquire); }

ScopedPlanOverride::ScopedPlanOverride(const PlanOverride& o) : o_(o), prev_(g_override.exchange(&o_)) {}

ScopedPlanOverride::~ScopedPlanOverride() { g_override.store(prev_); }

Plan last_plan() { return g_last; }

}  // namespace testing

void record_plan(const Plan& plan) { testing::g_last = plan; }

namespace {

using namespace kernels;

/// The override in force, or the automatic choices.
const testing::PlanOverride& choices() {
  static const testing::PlanOverride automatic;
  const testing::PlanOverride* o = testing::plan_override();
  return o ? *o : automatic;
}

/// The warp kernel's variant: one thread per column when the grid already fills the GPU (about 4 warps
/// per SM), else 2 or 4 threads per column for more parallelism.
void plan_warp(Plan& plan, const RecArgs& a, int sms) {
  plan.kernel = Plan::Kernel::warp;
  plan.warp_keys = a.K <= 64 ? 64 : 128;
  const int64_t warps1 = int64_t(a.N) * a.HV * ((a.V + 31) / 32);
  plan.warp_split = warps1 >= 4 * sms ? 1 : 2 * warps1 >= 4 * sms ? 2 : 4;
}

/// Whether the forward of `p` runs the chunkwise kernels: when asked to (they must cover the call), or
/// automatically for 16-bit inputs (the tensor-core operands are 16-bit, so float32 inputs keep the
/// float32 recurrent kernels' accuracy unless chunkwise is requested).
bool use_chunkwise(const Params& p, const RecArgs& a) {
  const bool covers = chunk_covers(a);
  if (p.algorithm == Algorithm::chunkwise) {
    if (!covers)
      throw Error("cuda: the chunkwise kernels need key_dim <= " + std::to_string(kChunkKeys) +
                  ", value_dim <= " + std::to_string(kChunkMaxV) + " and a GPU with at least " +
                  std::to_string(layout::state_smem_bytes(16) / 1024) +
                  " kB of shared memory per block; got K = " + std::to_string(p.K) + ", V = " + std::to_string(p.V) +
                  ", " + std::to_string(chunk_max_smem() / 1024) + " kB");
    return true;
  }
  return p.algorithm == Algorithm::automatic && covers && p.dtype != DType::f32 && !choices().warp_kernel;
}

/// Whether the forward's state pass of `c` runs on warpgroup products here (chunk_wg_pass) for input type d.
bool wg_pass(DType d, const ChunkArgs& c) {
  switch (d) {
    case DType::f16:
      return chunk_wg_pass<__half>(c);
    case DType::bf16:
      return chunk_wg_pass<__nv_bfloat16>(c);
    case DType::f32:
      break;
  }
  return chunk_wg_pass<float>(c);
}

}  // namespace

Plan plan_forward(const Params& p, const RecArgs& a) {
  Plan plan;
  // T = 0 has no chunks: the recurrent kernel copies h0/a0 to hT/aT.
  if (p.T > 0 && use_chunkwise(p, a)) {
    plan.kernel = Plan::Kernel::chunkwise;  // (plan_chunkwise makes the rest of the choices)
    return plan;
  }
  plan.pdl = sm90_kernels();
  const int sms = sm_count();
  if (choices().warp_kernel || !rowblock_vectorizable(a)) {
    plan_warp(plan, a, sms);
    return plan;
  }
  // The block-row kernel: 64 columns per block when that gives at least one block per SM, else 32.
  plan.kernel = Plan::Kernel::rowblock;
  plan.tokens = 8;
  plan.cols = int64_t(a.N) * a.HV * ((a.V + 63) / 64) >= sms ? 64 : 32;
  return plan;
}

void plan_chunkwise(Plan& plan, const Params& p, ChunkArgs& c) {
  const testing::PlanOverride& o = choices();
  const RecArgs& a = c.a;
  plan.kernel = Plan::Kernel::chunkwise;
  plan.pdl = sm90_kernels();
  // The state pass reads q and k rows straight from the inputs (ChunkArgs::raw_q) where they are its
  // operands already: 16-bit, 128 keys, 16-byte rows, the decays per token (not per channel); and
  // only in its 8-warp configuration (many heads). With a producer warp (few, long sequences) the
  // strided raw rows made it slower. On Hopper's warpgroup state pass (128-column tiles) the residual's
  // products move there too (ChunkArgs::raw_v): the intra-chunk kernel writes the solve Tm (and,
  // without raw k rows, K ⊙ e^gamma) instead of W and U, and reads no v rows.
  auto choose_rows = [&] {
    const bool raw = o.allow_raw_qk && p.dtype != DType::f32 && p.K == kChunkKeys && c.vec_qk &&
                     a.decay != kDecayDiagonal && c.state_vt == 128;
    c.raw_q = raw && a.precond != kPrecondATQ;
    c.raw_kw = raw && a.precond != kPrecondATK;
    c.raw_v = p.dtype != DType::f32 && c.state_vt == 128 && a.online && p.V == kChunkMaxV && c.vec_v && o.allow_raw_v &&
              o.allow_wgmma && wg_pass(p.dtype, c);
    // DiagonalATK: the warpgroup pass forms the write keys from its raw k rows (ChunkArgs::kw_state), but
    // not in the split pass, whose first pass (no outputs: a shorter chain per chunk) then waited on them.
    c.kw_state = c.raw_v && c.raw_q && a.precond == kPrecondATK && o.allow_kw_state && c.split <= 1;
  };
  // Few long sequences: the warpgroup pass with 128-column tiles over segments of each sequence
  // (ChunkArgs::split), where it has raw v rows; else the narrow tiles state_value_tile chose.
  if ((o.state_vt == 16 || o.state_vt == 32 || o.state_vt == 64 || o.state_vt == 128) && o.state_vt <= c.Vpad &&
      layout::state_smem_bytes(o.state_vt) <= chunk_max_smem())
    c.state_vt = o.state_vt;
  const int narrow = c.state_vt;
  c.split = split_segments(c, o.split_chunks ? *o.split_chunks : -1);
  if (c.split > 1) c.state_vt = 128;
  choose_rows();
  if (c.split > 1 && !c.raw_v) {
    c.split = 0;
    c.seg_chunks = 0;
    c.state_vt = narrow;
    choose_rows();
  }
  // The statistics entering each chunk by the intra-chunk kernel's look-back instead of the sums and
  // scan kernels (ChunkArgs::lookback): k is read once.
  c.lookback = a.precond != kPrecondIdentity && o.allow_lookback;
  // Hopper: the warpgroup state pass where the tile is 64 or 128 value columns (few heads keep the 16- or
  // 32-column mma.sync tiles: a warpgroup product is 64 value columns tall); the intra-chunk kernel then
  // writes its tiles blocked for it, and the raw rows come by tensor copies where their maps can be made.
  c.blocked = o.allow_wgmma && wg_pass(p.dtype, c);
  c.tma_rows = c.blocked && (c.raw_q || c.raw_kw || c.raw_v) && o.allow_tma;
  // The intra-chunk kernel's quad layout (four blocks per SM): the forward with scalar or no decay, raw q
  // and raw v rows (the warpgroup pass, blocked tiles) of the Identity preconditioner (raw k rows too:
  // GDN, DeltaNet) or of DiagonalATK (PGDN, PDN).
  int quad = 0;
  if (o.allow_quad && a.decay != kDecayDiagonal && c.raw_v && c.raw_q && c.blocked && !c.bwd && a.online)
    quad = a.precond == kPrecondIdentity && c.raw_kw ? layout::kQuadIdentity
           : a.precond == kPrecondATK                ? layout::kQuadATK
                                                     : 0;
  plan.state_vt = c.state_vt;
  plan.wgmma = c.blocked;
  plan.raw_q = c.raw_q, plan.raw_kw = c.raw_kw, plan.raw_v = c.raw_v, plan.kw_state = c.kw_state;
  plan.tma = c.tma_rows;
  plan.lookback = c.lookback;
  plan.split = c.split, plan.seg_chunks = c.seg_chunks;
  plan.quad = quad;
  plan.sums_blocks = o.sums_blocks > 0 ? o.sums_blocks : 0;
}

Plan plan_decode(const RecArgs& a) {
  const testing::PlanOverride& o = choices();
  Plan plan;
  plan.pdl = sm90_kernels();
  // With a diagonal preconditioner, every block of a key head reads its statistics a0 and one of them
  // writes the updated ones back in place. For small batches the one-token kernels run each key head's
  // blocks as one thread block cluster (at most 8 blocks, Hopper) and order the write after the reads
  // with the cluster barrier; elsewhere the kernels read a private copy, one more small kernel (clusters
  // were slower at large batches), except the grouped kernel below, whose blocks own their key head.
  const bool has_p = a.precond != kPrecondIdentity, rows16 = !o.warp_kernel && rowblock_vectorizable(a);
  const bool one_token = a.T == 1 && !a.cu_seqlens;
  const int sms = sm_count();
  // One token per call (the common case): 64 columns per block and one token staged, so four blocks fit
  // per SM and their state reads and writes overlap better. Fewer than one such block per SM (small
  // batches): 32 columns, twice the blocks.
  const int forced = o.decode_cols == 32 || o.decode_cols == 64 ? o.decode_cols : 0;
  const int cols = forced ? forced : int64_t(a.N) * a.HV * ((a.V + 63) / 64) < sms ? 32 : 64;
  // Large batches, one token: one block per (sequence, key head) runs the group's value heads and column
  // blocks in turn (rowblock_kernel's GROUPED), staging the key side once and owning the statistics (no
  // private copy), when that still gives four blocks per SM.
  const bool grouped = rows16 && one_token && cols == 64 &&
                       (o.decode_grouped ? *o.decode_grouped : int64_t(a.N) * a.H >= 4 * int64_t(sms));
  // Small batches, one token, no preconditioner: decode_warp_kernel (a warp per 8 columns, no block
  // barrier; decode always passes the state as h0 = hT). With a preconditioner it was slower (the cluster
  // barrier's release drains every load first), so those stay on the 32-column block-row kernel.
  const bool by_warps =
      rows16 && one_token && !forced && cols == 32 && !has_p && a.K <= 128 && a.h0 && a.hT && o.allow_decode_columns;
  if (has_p && !grouped) {
    const int64_t xblocks = (a.V + cols - 1) / cols, blocks = int64_t(a.N) * a.HV * xblocks;
    plan.cluster_a = rows16 && one_token && xblocks * a.group <= 8 && blocks <= 4 * int64_t(sms) && sm90_kernels();
    plan.private_copy = !plan.cluster_a;
  }
  if (!rows16) {
    plan_warp(plan, a, sms);
    return plan;
  }
  plan.kernel = Plan::Kernel::decode_rowblock;
  if (by_warps) {
    plan.kernel = Plan::Kernel::decode_columns;
    plan.cols = 8 * kDecodeWarps;
  } else if (one_token) {
    plan.tokens = 1;
    plan.cols = cols;
    if (grouped) plan.kernel = Plan::Kernel::decode_grouped;
  } else {
    // More tokens: 128 columns per block when that fills the GPU twice over, else 32 (more, smaller
    // blocks for small batches).
    plan.tokens = kDecodeGroup;
    plan.cols = int64_t(a.N) * a.HV * ((a.V + 127) / 128) >= 2 * sms ? 128 : 32;
  }
  return plan;
}

Plan plan_backward(const Params& p, const RecArgs& a) {
  Plan plan;
  plan.pdl = sm90_kernels();
  const bool half = p.dtype != DType::f32 || p.algorithm == Algorithm::chunkwise;
  const bool chunk =
      p.T != 0 && p.algorithm != Algorithm::recurrent && !choices().warp_kernel && chunk_backward_covers(a, half);
  plan.kernel = chunk ? Plan::Kernel::backward_chunkwise : Plan::Kernel::backward_recurrent;
  return plan;
}

Plan plan_exact(Plan::Kernel kernel, const RecArgs& a) {
  // The inverse Gram's tile: K padded to 16, 32, 64 or 128 keys (4 threads per row of P, a quarter of its
  // columns each); the state kernels take the same padding.
  Plan plan;
  plan.kernel = kernel;
  plan.exact_keys = exact_keys(a.K);
  return plan;
}

Plan plan_backward_mode(const ChunkArgs& c) {
  Plan plan;
  plan.kernel = Plan::Kernel::chunkwise;
  plan.state_vt = c.state_vt;
  plan.pdl = sm90_kernels();
  return plan;
}

const char* impl_name(const Plan& p) {
  using K = Plan::Kernel;
  switch (p.kernel) {
    case K::chunkwise: {
      // bit 0: wgmma; bits 1-2: the state tile 16 << i; then raw, tma, rv, kw, split
      static const std::array<std::string, 256> names = [] {
        std::array<std::string, 256> r;
        for (int i = 0; i < 256; ++i)
          r[i] = std::string("cuda/chunkwise/") + (i & 1 ? "wgmma/" : "") + "v" + std::to_string(16 << (i >> 1 & 3)) +
                 (i & 8 ? "/raw" : "") + (i & 16 ? "/tma" : "") + (i & 32 ? "/rv" : "") + (i & 64 ? "/kw" : "") +
                 (i & 128 ? "/split" : "");
        return r;
      }();
      const int tile = p.state_vt >= 128 ? 3 : p.state_vt >= 64 ? 2 : p.state_vt >= 32 ? 1 : 0;
      return names[p.wgmma + 2 * tile + 8 * (p.raw_q || p.raw_kw) + 16 * p.tma + 32 * p.raw_v + 64 * p.kw_state +
                   128 * (p.split > 1)]
          .c_str();
    }
    case K::rowblock:
      return p.cols == 64 ? "cuda/rowblock/v64" : "cuda/rowblock/v32";
    case K::warp: {
      static constexpr const char* names[2][3] = {
          {"cuda/recurrent/k64/ks1", "cuda/recurrent/k64/ks2", "cuda/recurrent/k64/ks4"},
          {"cuda/recurrent/k128/ks1", "cuda/recurrent/k128/ks2", "cuda/recurrent/k128/ks4"}};
      return names[p.warp_keys == 64 ? 0 : 1][p.warp_split == 1 ? 0 : p.warp_split == 2 ? 1 : 2];
    }
    case K::decode_rowblock:
      return p.cols == 128 ? "cuda/decode/v128" : p.cols == 64 ? "cuda/decode/v64" : "cuda/decode/v32";
    case K::decode_grouped:
      return "cuda/decode/v64g";
    case K::decode_columns:
      return "cuda/decode/w32";
    case K::backward_chunkwise:
      return p.saved ? "cuda/backward/chunkwise/saved" : "cuda/backward/chunkwise";
    case K::exact_forward:
    case K::exact_decode:
    case K::exact_backward: {
      static constexpr const char* names[3][4] = {
          {"cuda/exact/k16", "cuda/exact/k32", "cuda/exact/k64", "cuda/exact/k128"},
          {"cuda/exact/decode/k16", "cuda/exact/decode/k32", "cuda/exact/decode/k64", "cuda/exact/decode/k128"},
          {"cuda/exact/backward/k16", "cuda/exact/backward/k32", "cuda/exact/backward/k64",
           "cuda/exact/backward/k128"}};
      const int row = p.kernel == K::exact_forward ? 0 : p.kernel == K::exact_decode ? 1 : 2;
      const int col = p.exact_keys <= 16 ? 0 : p.exact_keys <= 32 ? 1 : p.exact_keys <= 64 ? 2 : 3;
      return names[row][col];
    }
    case K::backward_recurrent:
      break;
  }
  return "cuda/backward/recurrent";
}

}  // namespace dgps::cuda
