/// @brief The CUDA backend's plan of a call (every kernel, tile width and launch attribute, chosen in one place) and
/// the tests' override of it.
///
/// plan.cu decides a Plan from the call's shape, dtype, model and device; the launchers read it and
/// impl_name() names it (the name dgps::cuda::forward, decode and backward return, RunInfo::impl). This header
/// needs no CUDA header, so the GPU tests include it to force variants (testing::ScopedPlanOverride) and to
/// check which one ran (testing::last_plan()).
#pragma once

#include <cstdint>
#include <optional>

#include "dgps/cuda.hpp"

namespace dgps::cuda {

namespace kernels {
struct RecArgs;
struct ChunkArgs;
}  // namespace kernels

/// Every choice of one CUDA call.
struct Plan {
  /// The kernels that run.
  enum class Kernel : uint8_t {
    chunkwise,           ///< the chunkwise forward (launch/chunk.cuh): intra-chunk kernel, then the state pass
    rowblock,            ///< the block-row recurrent forward (16-byte state rows)
    warp,                ///< the warp-per-column recurrent kernel (forward or decode; any V)
    decode_rowblock,     ///< decode by the block-row kernel: a block per (sequence, value head, `cols` columns)
    decode_grouped,      ///< one-token decode, a block per (sequence, key head) walking its group's units
    decode_columns,      ///< one-token decode, a warp per 8 value columns (decode_warp_kernel)
    backward_chunkwise,  ///< the chunkwise backward (tensor cores)
    backward_recurrent,  ///< the float32 recurrent backward
    exact_forward,       ///< the exact preconditioners' forward (launch/exact.cuh): inverse Gram, then the state
    exact_decode,        ///< the same kernels in decode (states through slots, in place)
    exact_backward,      ///< the exact preconditioners' backward (launch/exact.cuh)
  };
  Kernel kernel = Kernel::warp;
  int cols = 0;        ///< block-row and decode kernels: value columns per block (32, 64 or 128)
  int tokens = 0;      ///< block-row kernels: tokens staged per group (8 forward; 1 or 4 decode)
  int warp_keys = 0;   ///< warp kernel: key rows it covers (64 or 128)
  int warp_split = 0;  ///< warp kernel: threads per value column (1, 2 or 4)
  int exact_keys = 0;  ///< exact kernels: K padded to their key tile (16, 32, 64 or 128)
  /// Decode with a diagonal preconditioner, not grouped: a key head's blocks form one thread block cluster
  /// (RecArgs::cluster_a), or else read the statistics from a private copy (one more small kernel).
  bool cluster_a = false, private_copy = false;
  // The chunkwise forward (ChunkArgs carries the same choices to the kernels).
  int state_vt = 0;        ///< value columns per block of the state pass (128, 64, 32 or 16)
  bool wgmma = false;      ///< the state pass on Hopper's warpgroup products (its tiles blocked: ChunkArgs::blocked)
  bool raw_q = false;      ///< ChunkArgs::raw_q
  bool raw_kw = false;     ///< ChunkArgs::raw_kw
  bool raw_v = false;      ///< ChunkArgs::raw_v
  bool kw_state = false;   ///< ChunkArgs::kw_state
  bool tma = false;        ///< the warpgroup pass's raw rows by tensor copies (ChunkArgs::tma_rows)
  bool lookback = false;   ///< ChunkArgs::lookback
  int split = 0;           ///< segments per sequence of the split state pass (ChunkArgs::split; 0: none)
  int64_t seg_chunks = 0;  ///< chunks per segment (split)
  int quad = 0;            ///< the intra-chunk kernel's quad layout (kQuadIdentity, kQuadATK) or 0
  int sums_blocks = 0;     ///< blocks of the statistics' sums kernel; 0: as many as fit on the device
  bool saved = false;      ///< backward: starts from a training forward's saved activations
  bool pdl = false;        ///< programmatic dependent launches (the sm_90a build on Hopper)
};

/// The name of the plan's variant (what the entry points return): "cuda/chunkwise/" + "wgmma/" (warpgroup pass) +
/// "v128" (state tile) + "/raw" (raw q, k rows) + "/tma" + "/rv" (raw v rows) + "/kw" (kw_state) + "/split";
/// "cuda/rowblock/v64"; "cuda/recurrent/k128/ks2"; "cuda/decode/w32", "/v32", "/v64", "/v64g", "/v128";
/// "cuda/backward/chunkwise" ("/saved"), "cuda/backward/recurrent"; "cuda/exact/k128", "cuda/exact/decode/k128",
/// "cuda/exact/backward/k128" (k16, k32, k64: exact_keys). The string lives as long as the program.
const char* impl_name(const Plan& plan);

/// The plan of a forward call: the chunkwise kernels (their choices are made by plan_chunkwise, which
/// needs the call's ChunkArgs) or a recurrent kernel. Throws dgps::Error where the chunkwise algorithm is
/// asked for and does not cover the call.
Plan plan_forward(const Params& p, const kernels::RecArgs& a);

/// The chunkwise forward's choices for call `p` with the geometry of `c` (api.cu's make_chunk_args): state
/// tile, raw rows, split, look-back, warpgroup pass, layouts. Sets them in `plan` and in `c`.
void plan_chunkwise(Plan& plan, const Params& p, kernels::ChunkArgs& c);

/// The plan of a call with an exact preconditioner (forward, decode or backward: `kernel` is one of the three
/// exact kernels): the key tile.
Plan plan_exact(Plan::Kernel kernel, const kernels::RecArgs& a);

/// The plan of a decode call (arguments `a` as decode passes them: h0 = hT, a0 = aT).
Plan plan_decode(const kernels::RecArgs& a);

/// The plan of a backward call: chunkwise (when it covers the call, 16-bit inputs or Algorithm::chunkwise)
/// or recurrent.
Plan plan_backward(const Params& p, const kernels::RecArgs& a);

/// The plan of the chunkwise kernels in backward mode (`c.bwd`: a training forward, or the backward's recompute of
/// the forward): the state tile of `c`, and no warpgroup pass, raw rows, quad layout or look-back.
Plan plan_backward_mode(const kernels::ChunkArgs& c);

/// Records `plan` as the calling thread's last plan (testing::last_plan).
void record_plan(const Plan& plan);

/// Test-only control of the plan. Not for production code: the variants forced here are the ones the
/// automatic choice passes over (slower, or for other devices and shapes), kept reachable so the GPU tests
/// cover them. An override never forces a variant onto a call that it does not cover.
namespace testing {

/// Forced choices; an unset field (or a true `allow_*`) leaves the automatic choice.
struct PlanOverride {
  /// Every recurrent call on the warp-per-column kernel, and the automatic algorithm never chunkwise
  /// (forward and backward).
  bool warp_kernel = false;
  bool allow_raw_qk = true;          ///< false: the intra-chunk kernel's Qn / KWn tiles instead of raw q, k rows
  bool allow_raw_v = true;           ///< false: W and U from the intra-chunk kernel instead of raw v rows and Tm
  bool allow_kw_state = true;        ///< false: the intra-chunk kernel's KW tiles instead of kw_state
  bool allow_lookback = true;        ///< false: the statistics' sums and scan kernels instead of the look-back
  bool allow_wgmma = true;           ///< false: the mma.sync state pass on Hopper too
  bool allow_tma = true;             ///< false: the warpgroup pass's raw rows by cp.async
  bool allow_quad = true;            ///< false: the intra-chunk kernel's standard layout where the quad one applies
  bool allow_decode_columns = true;  ///< false: the block-row kernel where decode_warp_kernel would run
  /// 0: never split the state pass; n > 0: segments of n chunks wherever the split applies at all.
  std::optional<int64_t> split_chunks;
  /// 16, 32, 64 or 128: the forward's state pass on tiles of that many value columns where they fit (V
  /// padded to 64, the device's shared memory) instead of state_value_tile's choice (a split pass still
  /// runs 128).
  int state_vt = 0;
  int sums_blocks = 0;  ///< n > 0: the statistics' sums kernel on n blocks (each takes many chunks in turn)
  int decode_cols = 0;  ///< 32 or 64: the one-token decode's block width (block-row kernels only)
  std::optional<bool> decode_grouped;  ///< the grouped one-token decode kernel on or off (where it applies)
};

/// The override in force, or null.
const PlanOverride* plan_override();

/// Sets an override for its lifetime (the one it replaces comes back after). Single-threaded use: the
/// override is process-wide.
class ScopedPlanOverride {
 public:
  explicit ScopedPlanOverride(const PlanOverride& o);
  ~ScopedPlanOverride();
  ScopedPlanOverride(const ScopedPlanOverride&) = delete;
  ScopedPlanOverride& operator=(const ScopedPlanOverride&) = delete;

 private:
  PlanOverride o_;
  const PlanOverride* prev_;
};

/// The plan of the calling thread's last forward, decode or backward call.
Plan last_plan();

}  // namespace testing

}  // namespace dgps::cuda
