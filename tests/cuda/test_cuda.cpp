/// @brief GPU tests of dgps::cuda against the float64 reference: conformance cases, large random cases, decode
/// (and, from test_cuda_backward.cpp, the backward pass).
///
/// Skips (exit 0, with a message) when no GPU is present, so CI can build it without a GPU.
/// `--quick` runs the conformance cases, one small random case and the backward's gate sums only (for
/// compute-sanitizer); `--kw-state` only the cases of the write keys formed by the state pass (kw_state_cases);
/// `--exact` only the exact preconditioners' tests (test_cuda_exact.cpp; with `--quick` their small shapes);
/// `--backward` only the backward's tests (test_cuda_backward.cpp; with `--quick` its quick set).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpu_support.hpp"
#include "plan.hpp"
#include "squash_agreement.hpp"

namespace {

using namespace dgps_gpu_test;
using dgps::cuda::Plan;
using dgps::cuda::testing::PlanOverride;
using dgps::cuda::testing::ScopedPlanOverride;

/// The plan of the last CUDA call (compare's and gpu_forward's forward: the reference runs on the CPU).
Plan last_plan() { return dgps::cuda::testing::last_plan(); }

/// The algorithm the GPU runs in gpu_forward (tests switch it per section).
dgps::Algorithm g_alg = dgps::Algorithm::automatic;

/// Forces the chunkwise algorithm in gpu_forward for its lifetime (a section's cases), then restores
/// the algorithm it found.
struct ForceChunkwise {
  dgps::Algorithm saved = g_alg;
  ForceChunkwise() { g_alg = dgps::Algorithm::chunkwise; }
  ~ForceChunkwise() { g_alg = saved; }
  ForceChunkwise(const ForceChunkwise&) = delete;
  ForceChunkwise& operator=(const ForceChunkwise&) = delete;
};

/// Runs the case on the GPU with input type d and gate type gd; outputs poisoned with NaN first.
Arrays gpu_forward(const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws, std::string* impl) {
  const int64_t B = c.shape.batch, T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads,
                K = c.shape.key_dim, V = c.shape.value_dim, N = c.N;
  const bool diag_p = c.spec.precond != dgps::precond::Kind::identity;
  DeviceCase dc(c, d, gd, g_alg);
  DevBuf o = poisoned(size_t(B * T * HV * V) * elem_size(d)), hT = poisoned(size_t(N * HV * K * V) * 4),
         aT = poisoned(size_t(N * H * K) * 4);
  dgps::cuda::Params& p = dc.p;
  p.o = contiguous4(o, T, HV, V);
  p.hT = contiguous4(hT, HV, K, V);
  if (diag_p) p.aT = contiguous4(aT, H, K, 1);
  *impl = dgps::cuda::forward(p, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "forward");
  Arrays r;
  r["o"] = download(o, size_t(B * T * HV * V), d);
  r["hT"] = download(hT, size_t(N * HV * K * V), DType::f32);
  if (diag_p) r["aT"] = download(aT, size_t(N * H * K), DType::f32);
  return r;
}

/// SPEC §5: float32 within 1e-4, 16-bit inputs within 2e-2; the chunkwise kernels' products take
/// 16-bit operands, so forced chunkwise runs on float32 inputs get the 16-bit tolerance.
double tolerance(DType d) { return d == DType::f32 && g_alg != dgps::Algorithm::chunkwise ? 1e-4 : 2e-2; }

/// Compares GPU output (type d) with the reference on the inputs the GPU saw, and with `gold` if given.
/// Returns the variant that ran.
std::string compare(const std::string& name, const Case& c, DType d, DType gd, dgps::cuda::Workspace& ws,
                    const Arrays* gold) {
  std::string impl;
  const Arrays got = gpu_forward(c, d, gd, ws, &impl);
  const Arrays ref = reference_forward(rounded(c, d, gd));
  for (const char* t : {"o", "hT", "aT"}) {
    if (!got.count(t)) continue;
    double err = dgps_test::rel_err(got.at(t), ref.at(t));
    if (gold && d == DType::f32 && gold->count(t)) {
      const auto dn = c.denom.find(t);
      err = std::max(err, dgps_test::rel_err(got.at(t), gold->at(t), dn == c.denom.end() ? -1 : dn->second));
    }
    report(name + "/" + dgps::cuda::to_string(d), t, err, tolerance(d), impl);
  }
  return impl;
}

void conformance(dgps::cuda::Workspace& ws) {
  for (const auto& name : dgps_test::case_names()) {
    const Case c = dgps_test::load_case(name);
    if (dgps_test::is_exact(c.spec)) {
      std::printf("skip  %-44s (exact preconditioner: test_cuda_exact.cpp)\n", name.c_str());
      continue;
    }
    Arrays gold;
    for (const char* t : {"o", "hT", "aT"})
      if (c.has(t)) gold[t] = c.arr.at(t);
    compare("conf/" + name, c, DType::f32, DType::f32, ws, &gold);
    compare("conf/" + name, c, DType::bf16, DType::f32, ws, nullptr);
  }
}

void random_cases(dgps::cuda::Workspace& ws, bool quick) {
  const char* models[] = {"la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn", "pkda", "pmamba2"};
  uint64_t seed = 100;
  for (const char* m : models) {
    // K = V = 128 with GVA (HV = 2H), bf16 and f32.
    Case c = make_random(m, {.batch = 2, .time = 300, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
                         seed++);
    compare(std::string("rand/") + m + "/B2T300H2HV4K128", c, DType::f32, DType::f32, ws, nullptr);
    compare(std::string("rand/") + m + "/B2T300H2HV4K128", c, DType::bf16, DType::f32, ws, nullptr);
    if (quick) return;
    // K = V = 64, varlen with a one-token and an empty sequence, no initial states.
    dgps_test::Gen g0;
    g0.h0 = false;
    g0.a0 = false;
    Case v = make_random(m, {.batch = 1, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 64},
                         {0, 100, 101, 101, 400, 700}, seed++, g0);
    compare(std::string("rand/") + m + "/varlen_K64", v, DType::f32, DType::f32, ws, nullptr);
    compare(std::string("rand/") + m + "/varlen_K64", v, DType::f16, DType::bf16, ws, nullptr);
    // Sizes that are not powers of two; GVA x4.
    Case o = make_random(m, {.batch = 3, .time = 77, .heads = 1, .v_heads = 4, .key_dim = 100, .value_dim = 48}, {},
                         seed++);
    compare(std::string("rand/") + m + "/K100V48", o, DType::f32, DType::f32, ws, nullptr);
  }
  // Very strong decay and g = 0 (SPEC §5), long sequence.
  dgps_test::Gen strong;
  strong.g_lo = -50, strong.g_hi = -10;
  for (const char* m : {"gdn", "kda", "pkda"}) {
    Case c = make_random(m, {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, strong);
    compare(std::string("rand/") + m + "/strong_decay", c, DType::f32, DType::f32, ws, nullptr);
  }
  dgps_test::Gen zero;
  zero.g_lo = 0, zero.g_hi = 1e-300;
  Case z = make_random("pgdn", {.batch = 1, .time = 500, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128},
                       {}, seed++, zero);
  compare("rand/pgdn/g0", z, DType::f32, DType::f32, ws, nullptr);
  // Grids large enough for the one- and two-threads-per-column variants of the recurrent kernel.
  Case w1 = make_random("pkda", {.batch = 16, .time = 64, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128},
                        {}, seed++);
  compare("rand/pkda/B16H16HV32", w1, DType::bf16, DType::f32, ws, nullptr);
  Case w2 = make_random("pgdn", {.batch = 5, .time = 64, .heads = 16, .v_heads = 16, .key_dim = 128, .value_dim = 128},
                        {}, seed++);
  compare("rand/pgdn/B5H16", w2, DType::f32, DType::f32, ws, nullptr);
  Case w3 = make_random("pmamba2", {.batch = 12, .time = 40, .heads = 8, .v_heads = 32, .key_dim = 64, .value_dim = 64},
                        {}, seed++);
  compare("rand/pmamba2/B12H8HV32K64", w3, DType::f32, DType::f32, ws, nullptr);
  {  // The warp-per-column kernel (used when state rows cannot move 16 bytes at a time), forced.
    PlanOverride warp;
    warp.warp_kernel = true;
    const ScopedPlanOverride forced(warp);
    auto check_warp = [](const std::string& name, const std::string& impl) {
      report_check(last_plan().kernel == Plan::Kernel::warp, name + ": the warp kernel ran (" + impl + ")");
    };
    for (const char* m : {"pgdn", "pkda", "pmamba2", "gla"}) {
      Case c = make_random(m, {.batch = 2, .time = 100, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 64}, {},
                           seed++);
      const std::string name = std::string("warp/") + m;
      check_warp(name, compare(name, c, DType::bf16, DType::f32, ws, nullptr));
      check_warp(name, compare(name, c, DType::f32, DType::f32, ws, nullptr));
    }
    Case wl = make_random(
        "pgdn", {.batch = 16, .time = 64, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128}, {}, seed++);
    check_warp("warp/pgdn/B16H16HV32", compare("warp/pgdn/B16H16HV32", wl, DType::f32, DType::f32, ws, nullptr));
  }
  // Odd V (no 16-byte state rows): the warp kernel is chosen automatically, also for decode.
  Case odd = make_random("kda", {.batch = 2, .time = 50, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 30}, {},
                         seed++);
  compare("rand/kda/V30", odd, DType::f32, DType::f32, ws, nullptr);
  // A large case: B = 2, T = 2048, H = 4, K = V = 128.
  for (const char* m : {"pgdn", "pkda"}) {
    Case big = make_random(m, {.batch = 2, .time = 2048, .heads = 4, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                           {}, seed++);
    compare(std::string("rand/") + m + "/B2T2048H4K128", big, DType::bf16, DType::bf16, ws, nullptr);
    compare(std::string("rand/") + m + "/B2T2048H4K128", big, DType::f32, DType::f32, ws, nullptr);
  }
}

/// The chunkwise tensor-core kernels (every covered model, forced, all input types) and the
/// recurrent kernels on 16-bit inputs (which the automatic choice no longer sends there).
void chunkwise_cases(dgps::cuda::Workspace& ws, bool quick) {
  const char* models[] = {"la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn", "pkda", "pmamba2"};
  uint64_t seed = 9000;
  g_alg = dgps::Algorithm::chunkwise;
  for (const auto& name : dgps_test::case_names()) {
    const Case c = dgps_test::load_case(name);
    if (!dgps::cuda::supports(c.spec, dgps::Algorithm::chunkwise)) continue;
    compare("chunk/conf/" + name, c, DType::f32, DType::f32, ws, nullptr);
    compare("chunk/conf/" + name, c, DType::bf16, DType::f32, ws, nullptr);
  }
  for (const char* m : models) {
    // Full chunks, GVA, K = V = 128 with h0/a0.
    Case c = make_random(m, {.batch = 2, .time = 256, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
                         seed++);
    for (DType d : {DType::bf16, DType::f16, DType::f32})
      compare(std::string("chunk/") + m + "/B2T256HV4", c, d, DType::f32, ws, nullptr);
    if (quick) continue;
    // Partial chunks, varlen with empty and one-token sequences, K = V = 64, no initial states.
    dgps_test::Gen g0;
    g0.h0 = false;
    g0.a0 = false;
    Case v = make_random(m, {.batch = 1, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 64},
                         {0, 100, 101, 101, 400, 700}, seed++, g0);
    compare(std::string("chunk/") + m + "/varlen_K64", v, DType::bf16, DType::bf16, ws, nullptr);
    // Sizes that are not multiples of anything; GVA x4.
    Case o = make_random(m, {.batch = 3, .time = 77, .heads = 1, .v_heads = 4, .key_dim = 100, .value_dim = 48}, {},
                         seed++);
    compare(std::string("chunk/") + m + "/K100V48", o, DType::bf16, DType::f32, ws, nullptr);
  }
  // Strong decay and g = 0 (SPEC §5).
  dgps_test::Gen strong;
  strong.g_lo = -50, strong.g_hi = -10;
  for (const char* m : {"gdn", "pgdn", "gla", "kda", "pkda"}) {
    Case c = make_random(m, {.batch = 1, .time = 200, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, strong);
    compare(std::string("chunk/") + m + "/strong_decay", c, DType::bf16, DType::f32, ws, nullptr);
  }
  // Diagonal decay: channels that barely decay beside channels that decay strongly, in one head
  // (per-channel gamma spans from about 0 to -3000 over a chunk).
  dgps_test::Gen mixed;
  mixed.g_lo = -50, mixed.g_hi = 0;
  for (const char* m : {"kda", "pkda"}) {
    Case c = make_random(m, {.batch = 1, .time = 260, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {},
                         seed++, mixed);
    compare(std::string("chunk/") + m + "/mixed_decay", c, DType::bf16, DType::f32, ws, nullptr);
  }
  dgps_test::Gen zero;
  zero.g_lo = 0, zero.g_hi = 1e-300;
  Case z = make_random("pgdn", {.batch = 1, .time = 500, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128},
                       {}, seed++, zero);
  compare("chunk/pgdn/g0", z, DType::bf16, DType::f32, ws, nullptr);
  // Long sequences and many heads (the state pass's 16-, 32- and 64-column tiles).
  for (const char* m : {"gdn", "pgdn", "pkda"}) {
    Case big = make_random(m, {.batch = 2, .time = 2048, .heads = 4, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                           {}, seed++);
    compare(std::string("chunk/") + m + "/B2T2048H4", big, DType::bf16, DType::bf16, ws, nullptr);
    if (quick) break;
    Case wide = make_random(m, {.batch = 8, .time = 130, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128},
                            {}, seed++);
    compare(std::string("chunk/") + m + "/B8H16HV32", wide, DType::bf16, DType::f32, ws, nullptr);
  }
  // The state pass's raw q / k rows (16-bit inputs, K = 128, enough heads for its 8-warp variant;
  // ChunkArgs::raw_q): varlen with an empty and a one-token sequence (rows past a sequence's end are
  // zero-filled, the last chunk's also past the tensor's end), GVA, the norm off with another scale
  // (models without the delta rule); then the same problems without raw rows (allow_raw_qk: the
  // intra-chunk kernel's Qn / KWn tiles), and on Hopper's warpgroup state pass the raw rows by cp.async
  // instead of tensor copies (allow_tma; with them, a sequence's last, partial chunk still goes by
  // cp.async) and with W and U from the intra-chunk kernel instead of the residual from the raw v rows and
  // Tm (allow_raw_v; raw v rows only with the delta rule's Online solve), and with raw rows the
  // intra-chunk kernel's standard layout where its quad layout applies (allow_quad; GDN, PGDN).
  struct RawMode {
    const char* tag;
    bool raw, tma, raw_v, quad = true;
  };
  for (const RawMode& r : {RawMode{"1", true, true, true}, RawMode{"0", false, true, true},
                           RawMode{"1/cp", true, false, true}, RawMode{"1/w", true, true, false},
                           RawMode{"1/std", true, true, true, false}}) {
    PlanOverride mode;
    mode.allow_raw_qk = r.raw, mode.allow_tma = r.tma, mode.allow_raw_v = r.raw_v, mode.allow_quad = r.quad;
    const ScopedPlanOverride forced(mode);
    const std::string tag = std::string("chunk/raw") + r.tag + "/";
    for (const char* m : {"gdn", "pgdn", "pmamba2", "mamba2"}) {
      Case c = make_random(m, {.batch = 1, .time = 300, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128},
                           {0, 1, 70, 70, 200, 300}, seed++);
      const bool mamba = std::string(m).find("mamba2") != std::string::npos;  // Offline: no raw v rows
      if (mamba) c.opt.l2norm_qk = false, c.opt.scale = 0.03;
      const std::string impl = compare(tag + m + "/varlen_K128", c, DType::bf16, DType::bf16, ws, nullptr);
      const Plan pl = last_plan();
      report_check((pl.raw_q || pl.raw_kw) == r.raw, tag + m + ": variant " + impl);
      const bool wg = pl.wgmma, rv = wg && r.raw_v && !mamba;
      report_check(pl.tma == (wg && r.tma && (r.raw || rv)), tag + m + ": tensor copies " + impl);
      report_check(pl.raw_v == rv, tag + m + ": raw v rows " + impl);
      if (!r.quad) report_check(pl.quad == 0, tag + m + ": the standard intra-chunk layout " + impl);
      compare(tag + m + "/varlen_K128", c, DType::f16, DType::f32, ws, nullptr);
    }
  }
  // The state pass on Hopper's warpgroup products (sm_90a, the default there for 64- and 128-column
  // tiles) and on mma.sync (allow_wgmma off; narrower tiles; every other GPU): each value-tile width
  // (128 columns with raw rows and with Diagonal decay, 64, 32, and 32 of a 64-wide V, 16), an Offline
  // model (W S = 0), K = 64 (padded keys), packed sequences with empty and one-token ones, f16 operands.
  {
    int dev = 0;
    cudaDeviceProp prop{};
    check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
    check_cuda(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    const bool hopper = prop.major == 9 && prop.minor == 0;
    struct WgCase {
      const char* model;
      dgps::Shape shape;
      std::vector<int64_t> cu;
      DType d;
      const char* tile;
      bool rv = true;  // 128 columns on Hopper: the residual from the raw v rows (V = 128)
      int vt = 0;      // the tile forced (PlanOverride::state_vt; the automatic plan picks 128 at these heads)
    };
    const WgCase cases[] = {
        {"gdn", {.batch = 4, .time = 200, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128}, {},
         DType::bf16, "v128/raw"},
        {"kda", {.batch = 4, .time = 100, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128}, {},
         DType::bf16, "v128"},
        {"gdn", {.batch = 4, .time = 100, .heads = 16, .v_heads = 32, .key_dim = 64, .value_dim = 128}, {},
         DType::bf16, "v128"},
        {"pgdn", {.batch = 3, .time = 150, .heads = 8, .v_heads = 24, .key_dim = 128, .value_dim = 128}, {}, DType::f16,
         "v64", true, 64},
        {"pkda", {.batch = 1, .time = 300, .heads = 10, .v_heads = 10, .key_dim = 128, .value_dim = 128},
         {0, 1, 65, 65, 130, 300}, DType::bf16, "v32", true, 32},
        {"gdn", {.batch = 4, .time = 100, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 64}, {}, DType::bf16,
         "v32"},
        // Narrower V in the warpgroup pass's tiles: o's rows staged and written 16 bytes at a time for
        // the 48 columns of a 64-column tile, element by element for V = 100 (rows not 16-byte multiples).
        {"gdn", {.batch = 5, .time = 100, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 48}, {}, DType::bf16,
         "v64"},
        {"gdn", {.batch = 4, .time = 100, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 100}, {},
         DType::bf16, "v128/raw", false},
        {"mamba2", {.batch = 2, .time = 130, .heads = 4, .v_heads = 8, .key_dim = 128, .value_dim = 128}, {},
         DType::bf16, "v16"},
        {"pdn", {.batch = 2, .time = 100, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 64}, {}, DType::bf16,
         "v16"},
    };
    for (const char* wg : {"1", "0"}) {
      for (const WgCase& w : cases) {
        PlanOverride pass;
        pass.allow_wgmma = wg[0] == '1';
        pass.state_vt = w.vt;
        const ScopedPlanOverride forced(pass);
        Case c = make_random(w.model, w.shape, w.cu, seed++);
        const std::string name = std::string("chunk/wgmma") + wg + "/" + w.model + "/" + w.tile;
        const std::string impl = compare(name, c, w.d, DType::f32, ws, nullptr);
        const std::string tile = w.tile;
        const bool want = wg[0] == '1' && hopper && (tile.rfind("v128", 0) == 0 || tile == "v64");
        // Hopper copies the raw rows with tensor copies (on by default) and, with the
        // delta rule and 128-column tiles, v's too (ChunkArgs::raw_v: KDA's with its K ⊙ e^gamma tile,
        // K = 64's likewise).
        const std::string expect = !want || tile.rfind("v128", 0) != 0 ? tile : tile + (w.rv ? "/tma/rv" : "/tma");
        report_check(impl == std::string(want ? "cuda/chunkwise/wgmma/" : "cuda/chunkwise/") + expect &&
                         last_plan().wgmma == want,
                     name + ": variant " + impl);
        if (quick) break;
      }
    }
    // The split state pass (ChunkArgs::split: a few long sequences, Hopper's warpgroup pass with raw v
    // rows): forced segments of 3 chunks (the last segment and chunk partial) for each kind of k rows
    // (raw with raw q: GDN, DN; raw with the intra kernel's write key: PGDN, PDN; K ⊙ e^gamma: KDA,
    // PKDA, K = 64), two sequences, GVA, h0 in and hT out, the raw rows by cp.async once; then the
    // automatic choice on one long sequence (96 chunks: 6 segments of 16), and no split there (split_chunks 0);
    // packed sequences (an empty one, a one-token one, lengths that end mid-segment and mid-chunk: segments
    // up to the longest possible, the shorter sequences' blocks idle), forced and automatic.
    struct SplitCase {
      const char* model;
      dgps::Shape shape;
      const char* split;
      bool tma;
      std::vector<int64_t> cu = {};
    };
    const SplitCase splits[] = {
        {"gdn", {.batch = 2, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, "3", true},
        {"pgdn", {.batch = 1, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, "3", true},
        {"kda", {.batch = 2, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, "3", true},
        {"pkda", {.batch = 1, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, "3", true},
        {"dn", {.batch = 1, .time = 900, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, "2", true},
        {"pdn", {.batch = 1, .time = 900, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, "4", true},
        {"gdn", {.batch = 1, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 128}, "3", true},
        {"pgdn", {.batch = 2, .time = 800, .heads = 1, .v_heads = 2, .key_dim = 128, .value_dim = 128}, "3", false},
        {"pgdn", {.batch = 1, .time = 6144, .heads = 1, .v_heads = 1, .key_dim = 128, .value_dim = 128}, "", true},
        {"gdn", {.batch = 1, .time = 6144, .heads = 1, .v_heads = 1, .key_dim = 128, .value_dim = 128}, "0", true},
        {"gdn", {.batch = 1, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, "3", true,
         {0, 1, 1, 450, 1000}},
        {"pgdn", {.batch = 1, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, "4", true,
         {0, 300, 301, 1000}},
        {"kda", {.batch = 1, .time = 700, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, "3", false,
         {0, 500, 700}},
        {"pkda", {.batch = 1, .time = 900, .heads = 2, .v_heads = 2, .key_dim = 64, .value_dim = 128}, "2", true,
         {0, 130, 900}},
        {"gdn", {.batch = 1, .time = 6336, .heads = 1, .v_heads = 1, .key_dim = 128, .value_dim = 128}, "", true,
         {0, 192, 6336}},
    };
    for (const SplitCase& w : splits) {
      PlanOverride segs;
      if (w.split[0]) segs.split_chunks = std::atoll(w.split);
      segs.allow_tma = w.tma;
      const ScopedPlanOverride forced(segs);
      Case c = make_random(w.model, w.shape, w.cu, seed++);
      const std::string name = std::string("chunk/split") + (w.split[0] ? w.split : "auto") + "/" + w.model + "/B" +
                               std::to_string(w.shape.batch) + "T" + std::to_string(w.shape.time) + "K" +
                               std::to_string(w.shape.key_dim) + (w.tma ? "" : "/cp") +
                               (w.cu.empty() ? "" : "/N" + std::to_string(w.cu.size() - 1));
      for (DType d : {DType::bf16, DType::f16}) {
        const std::string impl = compare(name, c, d, DType::f32, ws, nullptr);
        const bool want = hopper && std::string(w.split) != "0";
        const Plan pl = last_plan();
        report_check((impl.size() > 6 && impl.compare(impl.size() - 6, 6, "/split") == 0) == want &&
                         (pl.split > 1) == want && (!want || !w.split[0] || std::atoll(w.split) == pl.seg_chunks),
                     name + ": variant " + impl);
        if (quick) break;
      }
      if (quick) break;
    }
  }
  // A diagonal preconditioner with many (sequence, key head) pairs, 16-bit inputs and K = 128 (the
  // state pass's 8-warp variant): packed sequences with an empty one, a one-token one and whole
  // chunks; the norm off for P-Mamba-2.
  for (const char* m : {"pgdn", "pkda", "pmamba2"}) {
    Case c = make_random(m, {.batch = 1, .time = 1500, .heads = 16, .v_heads = 16, .key_dim = 128, .value_dim = 128},
                         {0, 1, 1, 200, 264, 400, 700, 1000, 1200, 1500}, seed++);
    if (std::string(m) == "pmamba2") c.opt.l2norm_qk = false, c.opt.scale = 0.03;
    compare(std::string("chunk/") + m + "/N9H16", c, DType::bf16, DType::f32, ws, nullptr);
    if (quick) break;
  }
  // Forced chunkwise where it does not apply (V > 128): a dgps::Error naming the reason.
  for (const auto& [m, V] : {std::pair<const char*, int64_t>{"kda", 192}, {"gdn", 192}}) {
    Case c = make_random(m, {.batch = 1, .time = 70, .heads = 1, .v_heads = 1, .key_dim = 64, .value_dim = V}, {},
                         seed++);
    std::string impl, what;
    try {
      gpu_forward(c, DType::bf16, DType::f32, ws, &impl);
    } catch (const dgps::Error& e) {
      what = e.what();
    }
    const bool ok = what.find(V > 128 ? "value_dim <= 128" : "chunkwise") != std::string::npos;
    report_check(ok, std::string("chunk/refuses/") + m + "/V" + std::to_string(V) + ": " +
                         (what.empty() ? "(no error; ran " + impl + ")" : what));
  }
  // The recurrent kernels with 16-bit inputs.
  g_alg = dgps::Algorithm::recurrent;
  for (const char* m : {"gdn", "pgdn", "pmamba2"}) {
    Case c = make_random(m, {.batch = 2, .time = 300, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128}, {},
                         seed++);
    compare(std::string("recurrent/") + m + "/bf16", c, DType::bf16, DType::f32, ws, nullptr);
  }
  g_alg = dgps::Algorithm::automatic;
}

/// Decode of Tn tokens for N sequences addressed through a slot table into a pool of P states.
void decode_case(const char* model, int64_t Tn, DType d, uint64_t seed, dgps::cuda::Workspace& ws, int64_t N = 3,
                 int64_t K = 128, int64_t V = 128) {
  const int64_t P = 2 * N, H = 2, HV = 4;
  std::vector<int64_t> slots(N);
  for (int64_t n = 0; n < N; ++n) slots[n] = (n * 7 + 4) % P;  // distinct while 7 does not divide P
  Case c = make_random(model, {.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V}, {},
                       seed);
  const bool diag_p = c.spec.precond != dgps::precond::Kind::identity;
  dgps_test::Rng rng(seed + 7);
  std::vector<double> hpool(P * HV * K * V), apool(P * H * K);
  for (auto& x : hpool) x = 0.5 * rng.normal();
  for (auto& x : apool) x = rng.uniform(0.0, 2.0);
  std::vector<double> h0(N * HV * K * V), a0(N * H * K);
  for (int64_t n = 0; n < N; ++n) {
    std::copy_n(hpool.begin() + slots[n] * HV * K * V, HV * K * V, h0.begin() + n * HV * K * V);
    std::copy_n(apool.begin() + slots[n] * H * K, H * K, a0.begin() + n * H * K);
  }
  c.arr["h0"] = h0;
  if (diag_p) c.arr["a0"] = a0;
  const Arrays ref = reference_forward(rounded(c, d, DType::f32));
  std::vector<double> hexp = hpool, aexp = apool;
  for (int64_t n = 0; n < N; ++n) {
    std::copy_n(ref.at("hT").begin() + n * HV * K * V, HV * K * V, hexp.begin() + slots[n] * HV * K * V);
    if (diag_p) std::copy_n(ref.at("aT").begin() + n * H * K, H * K, aexp.begin() + slots[n] * H * K);
  }
  std::map<std::string, DevBuf> buf;
  for (const char* n : {"q", "k", "v"}) buf[n] = upload(c.arr.at(n), d);
  for (const char* n : {"g", "beta", "g_p", "beta_p", "center"})
    if (c.has(n)) buf[n] = upload(c.arr.at(n), DType::f32);
  DevBuf hp = upload(hpool, DType::f32), ap = upload(apool, DType::f32);
  DevBuf sl(slots.size() * 8), o(size_t(N * Tn * HV * V) * elem_size(d));
  check_cuda(cudaMemcpy(sl.p, slots.data(), sl.bytes, cudaMemcpyHostToDevice), "slots");
  poison(o.p, o.bytes);
  dgps::cuda::Params p;
  p.spec = c.spec;
  p.dtype = d;
  p.B = N, p.T = Tn, p.H = H, p.HV = HV, p.K = K, p.V = V, p.N = N;
  p.q = contiguous4(buf["q"], Tn, H, K);
  p.k = contiguous4(buf["k"], Tn, H, K);
  p.v = contiguous4(buf["v"], Tn, HV, V);
  if (c.has("g"))
    p.g = c.spec.decay == dgps::decay::Kind::diagonal ? contiguous4(buf["g"], Tn, HV, K)
                                                      : contiguous4(buf["g"], Tn, HV, 1);
  if (c.has("beta")) p.beta = contiguous4(buf["beta"], Tn, HV, 1);
  if (c.has("g_p")) p.g_p = contiguous4(buf["g_p"], Tn, H, 1);
  if (c.has("beta_p")) p.beta_p = contiguous4(buf["beta_p"], Tn, H, 1);
  if (c.has("center")) p.center = contiguous4(buf["center"], 1, 1, 1);
  p.h0 = contiguous4(hp, HV, K, V);
  if (diag_p) p.a0 = contiguous4(ap, H, K, 1);
  p.o = contiguous4(o, Tn, HV, V);
  p.slots = static_cast<const int64_t*>(sl.p);
  const std::string impl = dgps::cuda::decode(p, ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "decode");
  const std::string name = std::string("decode/") + model + "/T" + std::to_string(Tn) + "/N" + std::to_string(N) +
                           (K != 128 || V != 128 ? "/K" + std::to_string(K) + "V" + std::to_string(V) : "") + "/" +
                           dgps::cuda::to_string(d);
  report(name, "o", dgps_test::rel_err(download(o, size_t(N * Tn * HV * V), d), ref.at("o")), tolerance(d), impl);
  report(name, "h", dgps_test::rel_err(download(hp, hpool.size(), DType::f32), hexp), tolerance(d), impl);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  if (Tn == 1 && N * H >= 4 * sms)  // one block per (sequence, key head) walks the group's value heads
    report_check(impl == "cuda/decode/v64g", name + ": the grouped one-token kernel ran (" + impl + ")");
  // Small batches, one token: a warp per 8 columns, or with a preconditioner (or the override) 32-column blocks.
  const PlanOverride* forced = dgps::cuda::testing::plan_override();
  const bool block_rows = diag_p || (forced && !forced->allow_decode_columns);
  if (Tn == 1 && N * HV * ((V + 63) / 64) < sms && V % 4 == 0)
    report_check(impl == (block_rows ? "cuda/decode/v32" : "cuda/decode/w32"),
                 name + ": the expected one-token kernel ran (" + impl + ")");
  if (diag_p)
    report(name, "a", dgps_test::rel_err(download(ap, apool.size(), DType::f32), aexp), tolerance(d), impl);
}

/// A decode loop of Tn one-token calls captured in a CUDA graph (the calls are programmatic dependent
/// launches on sm_90) gives the same outputs and states, bit for bit, as the same calls made eagerly,
/// and both match the float64 reference of the Tn tokens within the float32 tolerance.
void decode_graph_case(const char* model, int64_t N, uint64_t seed, dgps::cuda::Workspace& ws) {
  const int64_t Tn = 3, H = 2, HV = 4, K = 128, V = 128;
  Case c =
      make_random(model, {.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V}, {}, seed);
  const bool diag_p = c.spec.precond != dgps::precond::Kind::identity;
  dgps_test::Rng rng(seed + 3);
  std::vector<double> h0(N * HV * K * V), a0(N * H * K);
  for (auto& x : h0) x = 0.5 * rng.normal();
  for (auto& x : a0) x = rng.uniform(0.0, 2.0);
  c.arr["h0"] = h0;
  if (diag_p) c.arr["a0"] = a0;
  const Arrays ref = reference_forward(rounded(c, DType::f32, DType::f32));
  std::map<std::string, DevBuf> buf;
  for (const char* n : {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center"})
    if (c.has(n)) buf[n] = upload(c.arr.at(n), DType::f32);
  const bool dg = c.spec.decay == dgps::decay::Kind::diagonal;
  // Two copies of the states and outputs: [0] eager, [1] graph.
  DevBuf hs[2] = {upload(h0, DType::f32), upload(h0, DType::f32)},
         as[2] = {upload(a0, DType::f32), upload(a0, DType::f32)};
  DevBuf os[2] = {poisoned(size_t(N * Tn * HV * V) * 4), poisoned(size_t(N * Tn * HV * V) * 4)};
  // The call of token t on copy i: every tensor's rows of token t (strides of the [N, Tn, ., .] inputs).
  auto step = [&](int i, int64_t t) {
    auto at = [&](const DevBuf& b, int64_t d2, int64_t d3) {
      dgps::cuda::Tensor x = contiguous4(b, Tn, d2, d3);
      if (x.data) x.data = static_cast<const float*>(x.data) + t * x.stride[1];
      return x;
    };
    dgps::cuda::Params p;
    p.spec = c.spec;
    p.dtype = DType::f32;
    p.B = N, p.T = 1, p.H = H, p.HV = HV, p.K = K, p.V = V, p.N = N;
    p.q = at(buf["q"], H, K), p.k = at(buf["k"], H, K), p.v = at(buf["v"], HV, V);
    if (c.has("g")) p.g = at(buf["g"], HV, dg ? K : 1);
    if (c.has("beta")) p.beta = at(buf["beta"], HV, 1);
    if (c.has("g_p")) p.g_p = at(buf["g_p"], H, 1);
    if (c.has("beta_p")) p.beta_p = at(buf["beta_p"], H, 1);
    if (c.has("center")) p.center = contiguous4(buf["center"], 1, 1, 1);
    p.h0 = contiguous4(hs[i], HV, K, V);
    if (diag_p) p.a0 = contiguous4(as[i], H, K, 1);
    p.o = at(os[i], HV, V);
    return p;
  };
  std::string impl;
  for (int64_t t = 0; t < Tn; ++t) impl = dgps::cuda::decode(step(0, t), ws, nullptr);
  check_cuda(cudaDeviceSynchronize(), "eager decode");
  CapturedGraph([&](cudaStream_t s) {
    for (int64_t t = 0; t < Tn; ++t) dgps::cuda::decode(step(1, t), ws, s);
  }).replay();
  const std::string name = std::string("decode/graph/") + model + "/N" + std::to_string(N);
  auto same = [&](const DevBuf& x, const DevBuf& y, size_t n, const char* what) {
    report_check(same_bits(download(x, n, DType::f32), download(y, n, DType::f32)),
                 name + ": " + what + " of the graph replay equals the eager calls' bit for bit (" + impl + ")");
  };
  same(os[0], os[1], size_t(N * Tn * HV * V), "o");
  same(hs[0], hs[1], h0.size(), "h");
  report(name, "o", dgps_test::rel_err(download(os[1], size_t(N * Tn * HV * V), DType::f32), ref.at("o")), 1e-4, impl);
  report(name, "h", dgps_test::rel_err(download(hs[1], h0.size(), DType::f32), ref.at("hT")), 1e-4, impl);
  if (diag_p) {
    same(as[0], as[1], a0.size(), "a");
    report(name, "a", dgps_test::rel_err(download(as[1], a0.size(), DType::f32), ref.at("aT")), 1e-4, impl);
  }
}

/// (allow_lookback off throughout: the forward's look-back replaces these kernels; the training forward
/// and the backward keep them.) The statistics' sums kernel is persistent (block b takes the (chunk, key
/// head) items b, b + grid, ..., the next item's k rows in flight while it sums the current one). With
/// sums_blocks = 3 every block takes many items in turn, among them a packed batch's chunks past
/// its sequences' ends: the cp.async path (16-bit rows of 128: PGDN on packed sequences with an empty and
/// a one-token one, PKDA), and the synchronous one (float32 inputs; K = 64: P-Mamba-2); then, without
/// that override, a problem with more items than the default grid holds (B = 1, T = 8192, H = 8: 1024 items,
/// 792 blocks on an H200).
void sums_cases(dgps::cuda::Workspace& ws, bool quick) {
  const ForceChunkwise chunkwise;
  uint64_t seed = 7100;
  PlanOverride sums;
  sums.allow_lookback = false;  // (the forward's default forms the statistics in the intra-chunk kernel)
  const ScopedPlanOverride no_lookback(sums);
  sums.sums_blocks = 3;
  std::optional<ScopedPlanOverride> three(std::in_place, sums);
  Case pg = make_random("pgdn", {.batch = 1, .time = 300, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128},
                        {0, 1, 70, 70, 200, 300}, seed++);
  compare("chunk/sums3/pgdn/varlen_K128", pg, DType::bf16, DType::bf16, ws, nullptr);
  report_check(!last_plan().lookback && last_plan().sums_blocks == 3, "chunk/sums3: the sums kernel on 3 blocks");
  Case pk = make_random("pkda", {.batch = 2, .time = 500, .heads = 4, .v_heads = 8, .key_dim = 128, .value_dim = 128},
                        {}, seed++);
  compare("chunk/sums3/pkda/B2T500", pk, DType::bf16, DType::f32, ws, nullptr);
  if (!quick) {
    compare("chunk/sums3/pgdn/varlen_K128", pg, DType::f32, DType::f32, ws, nullptr);
    Case pm = make_random("pmamba2",
                          {.batch = 2, .time = 260, .heads = 4, .v_heads = 4, .key_dim = 64, .value_dim = 64}, {},
                          seed++);
    pm.opt.l2norm_qk = false, pm.opt.scale = 0.03;
    for (DType d : {DType::bf16, DType::f32}) compare("chunk/sums3/pmamba2/K64", pm, d, DType::f32, ws, nullptr);
  }
  three.reset();
  if (!quick) {
    Case big = make_random("pgdn",
                           {.batch = 1, .time = 8192, .heads = 8, .v_heads = 8, .key_dim = 128, .value_dim = 128}, {},
                           seed++);
    compare("chunk/sums/pgdn/B1T8192H8", big, DType::bf16, DType::bf16, ws, nullptr);
    report_check(!last_plan().lookback && last_plan().sums_blocks == 0,
                 "chunk/sums/pgdn/B1T8192H8: the sums kernel on its default grid");
  }
}

/// The chunkwise forward of a model with a diagonal preconditioner on packed sequences of 40, 0 and 64
/// chunks (the statistics' chunk scan over more than one batch of 32 loads, an empty sequence's aT):
/// two eager calls, then three replays of a CUDA graph captured on another stream, all giving the
/// same o, hT and aT bit for bit, which match the float64 reference.
void chunk_graph_case(const char* model, uint64_t seed, dgps::cuda::Workspace& ws) {
  Case c = make_random(model, {.batch = 1, .time = 6600, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128},
                       {0, 2560, 2560, 6600}, seed);
  const int64_t T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = 128, V = 128, N = c.N;
  const DType d = DType::bf16;
  DeviceCase dc(c, d, DType::f32, dgps::Algorithm::chunkwise);
  const size_t no = size_t(T * HV * V), nh = size_t(N * HV * K * V), na = size_t(N * H * K);
  DevBuf o = poisoned(no * elem_size(d)), hT = poisoned(nh * 4), aT = poisoned(na * 4);
  dgps::cuda::Params& p = dc.p;
  p.o = contiguous4(o, T, HV, V);
  p.hT = contiguous4(hT, HV, K, V);
  p.aT = contiguous4(aT, H, K, 1);
  const std::string name = std::string("chunk/graph/") + model;
  std::vector<double> first[3];
  auto check_run = [&](const std::string& run, const std::string& impl) {
    const std::vector<double> got[3] = {download(o, no, d), download(hT, nh, DType::f32), download(aT, na, DType::f32)};
    const char* what[3] = {"o", "hT", "aT"};
    for (int i = 0; i < 3; ++i) {
      if (first[i].empty()) {
        first[i] = got[i];
        continue;
      }
      report_check(same_bits(got[i], first[i]),
                   name + ": " + what[i] + " of " + run + " equals the first call's bit for bit (" + impl + ")");
    }
  };
  std::string impl;
  for (int r = 0; r < 2; ++r) {
    impl = dgps::cuda::forward(p, ws, nullptr);
    check_cuda(cudaDeviceSynchronize(), "forward");
    check_run("eager call " + std::to_string(r + 1), impl);
  }
  const Arrays ref = reference_forward(rounded(c, d, DType::f32));
  report(name, "o", dgps_test::rel_err(first[0], ref.at("o")), tolerance(d), impl);
  report(name, "hT", dgps_test::rel_err(first[1], ref.at("hT")), tolerance(d), impl);
  report(name, "aT", dgps_test::rel_err(first[2], ref.at("aT")), tolerance(d), impl);
  CapturedGraph graph([&](cudaStream_t s) { dgps::cuda::forward(p, ws, s); });
  for (int r = 0; r < 3; ++r) {
    poison(o.p, o.bytes);
    poison(aT.p, aT.bytes);
    graph.replay();
    check_run("graph replay " + std::to_string(r + 1), impl);
  }
  // A fresh workspace first used inside a capture (global mode; what torch.cuda.graph does on its own capture
  // stream): it allocates outside the capture. Then a larger call grows it eagerly, and the first graph, which
  // holds the outgrown buffer, still replays correctly.
  {
    dgps::cuda::Workspace fresh;
    CapturedGraph first_use([&](cudaStream_t s) { dgps::cuda::forward(p, fresh, s); });
    report_check(fresh.bytes() > 0, name + ": a workspace first used inside a capture allocated its buffer");
    poison(o.p, o.bytes);
    first_use.replay();
    check_run("graph replay on a workspace allocated during capture", impl);
    const size_t before = fresh.bytes();
    fresh.get(before * 4);  // outgrow the captured buffer
    poison(o.p, o.bytes);
    first_use.replay();
    check_run("graph replay after its workspace grew", impl);
  }
}

/// dgps::forward / dgps::decode with float32 device pointers pick the CUDA backend automatically.
void public_api() {
  Case c = make_random("pgdn", {.batch = 1, .time = 150, .heads = 2, .v_heads = 4, .key_dim = 64, .value_dim = 32},
                       {0, 50, 150}, 999);
  const Arrays ref = reference_forward(rounded(c, DType::f32, DType::f32));
  std::map<std::string, DevBuf> b;
  for (const auto& [n, v] : c.arr)
    if (n != "do" && n != "dhT" && n != "daT") b[n] = upload(v, DType::f32);
  DevBuf cu(c.cu.size() * 8), o(ref.at("o").size() * 4), hT(ref.at("hT").size() * 4), aT(ref.at("aT").size() * 4);
  check_cuda(cudaMemcpy(cu.p, c.cu.data(), cu.bytes, cudaMemcpyHostToDevice), "cu");
  auto f = [&](const char* n) { return static_cast<const float*>(b[n].p); };
  auto in = dgps::inputs<float>(c.shape, f("q"), f("k"), f("v"));
  in.decay(f("g")).gain(f("beta")).precond(f("g_p"), f("beta_p"), f("center")).initial_state(f("h0"), f("a0"));
  in.varlen(static_cast<const int64_t*>(cu.p), 2);
  auto out = dgps::outputs<float>(static_cast<float*>(o.p)).final_state(static_cast<float*>(hT.p),
                                                                         static_cast<float*>(aT.p));
  const dgps::RunInfo info = dgps::forward<dgps::PGDN>(in, out);
  check_cuda(cudaDeviceSynchronize(), "dgps::forward");
  report_check(info.backend == dgps::Backend::cuda, std::string("dgps::forward on device pointers chose backend ") +
                                                        dgps::to_string(info.backend) + " (" + info.impl + ")");
  report("api/forward/pgdn/varlen", "o", dgps_test::rel_err(download(o, ref.at("o").size(), DType::f32), ref.at("o")),
         1e-4, info.impl);
  report("api/forward/pgdn/varlen", "aT",
         dgps_test::rel_err(download(aT, ref.at("aT").size(), DType::f32), ref.at("aT")), 1e-4, info.impl);
}

}  // namespace

/// A model, shape, packed sequences (none: a batch) and input type of the cases that set one variant
/// against another, with a plan override set around the case (`tag` names it; none: "").
struct VariantCase {
  const char* model;
  dgps::Shape shape;
  std::vector<int64_t> cu;
  DType d;
  const char* tag = "";
  PlanOverride plan = {};
};

/// One check per output tensor that two runs' outputs `a` and `b` agree bit for bit (`how`: the two runs).
void same_bits(const std::string& name, const Arrays& a, const Arrays& b, const std::string& how) {
  for (const auto& [t, x] : a) {
    size_t diff = 0;
    for (size_t i = 0; i < x.size(); ++i) diff += !(x[i] == b.at(t)[i]);
    report_check(diff == 0, name + ": " + t + " the same bits " + how + " (" + std::to_string(diff) + " of " +
                                std::to_string(x.size()) + " differ)");
  }
}

/// The statistics entering each chunk by the intra-chunk kernel's look-back (ChunkArgs::lookback, the
/// forward's default with a diagonal preconditioner) against the sums and scan kernels
/// (allow_lookback off): the same statistics up to float32 association and the sums kernel's unrounded
/// keys (aT within 1e-5 of each other relative to its largest element for float32 inputs, 4e-3 for 16-bit
/// ones), both within the reference's tolerance, and two runs of the look-back give the same bits (its
/// folds' order is fixed). Sequences longer than kLookback + 1 = 5 chunks (the chain through the
/// statistics leaving earlier chunks), packed sequences with an empty one (its aT is a0) and a one-token
/// one, GVA, each intra-chunk layout that forms statistics (PGDN and PDN quad, PKDA lean, P-Mamba-2
/// standard with DiagonalATQ), 16-bit and float32 inputs; then PGDN with negative beta_p against the
/// reference.
void lookback_cases(dgps::cuda::Workspace& ws, bool quick) {
  const ForceChunkwise chunkwise;
  const VariantCase cases[] = {
      {"pgdn", {.batch = 2, .time = 2500, .heads = 4, .v_heads = 8, .key_dim = 128, .value_dim = 128}, {}, DType::bf16},
      {"pgdn", {.batch = 1, .time = 2900, .heads = 16, .v_heads = 16, .key_dim = 128, .value_dim = 128},
       {0, 1, 1300, 1300, 2900}, DType::bf16},
      {"pkda", {.batch = 1, .time = 2000, .heads = 4, .v_heads = 8, .key_dim = 128, .value_dim = 128},
       {0, 700, 700, 701, 2000}, DType::bf16},
      {"pdn", {.batch = 3, .time = 1200, .heads = 8, .v_heads = 8, .key_dim = 128, .value_dim = 128}, {}, DType::f16},
      {"pmamba2", {.batch = 2, .time = 1500, .heads = 4, .v_heads = 4, .key_dim = 64, .value_dim = 64}, {}, DType::f32},
  };
  uint64_t seed = 7400;
  for (const VariantCase& k : cases) {
    const std::string name = std::string("chunk/lookback/") + k.model + (k.cu.empty() ? "" : "/varlen");
    Case c = make_random(k.model, k.shape, k.cu, seed++);
    if (std::string(k.model) == "pmamba2") c.opt.l2norm_qk = false, c.opt.scale = 0.03;
    std::string impl[3];
    Arrays got[3];
    PlanOverride sums;
    sums.allow_lookback = false;
    for (int r = 0; r < 3; ++r) {  // the look-back twice, then the sums and scan kernels
      std::optional<ScopedPlanOverride> forced;
      if (r == 2) forced.emplace(sums);
      got[r] = gpu_forward(c, k.d, DType::f32, ws, &impl[r]);
      report_check(last_plan().lookback == (r < 2),
                   name + ": the look-back ran " + (r < 2 ? "" : "not ") + "(" + impl[r] + ")");
    }
    compare(name, c, k.d, DType::f32, ws, nullptr);
    same_bits(name, got[0], got[1], "in two runs");
    // (the sums kernel squares the k rows as read, times their inverse norms; the look-back the normalised
    // rows rounded to 16 bits, as the statistics' loop does: 2^-8 apart at most for 16-bit inputs)
    report(name, "aT look-back vs sums and scan", dgps_test::rel_err(got[0].at("aT"), got[2].at("aT")),
           k.d == DType::f32 ? 1e-5 : 4e-3, impl[0]);
    if (quick) break;
  }
  {  // A third of the rows with negative beta_p: statistics below -eps, where the squash clamps to M = x as
     // the reference does (the look-back's words and folds carry negative statistics too).
    const dgps::Shape shape{.batch = 2, .time = 700, .heads = 16, .v_heads = 16, .key_dim = 128, .value_dim = 128};
    Case c = make_random("pgdn", shape, {}, seed++);
    std::vector<double>& bp = c.arr.at("beta_p");
    for (size_t i = 0; i < bp.size(); i += 3) bp[i] = -2.0 * bp[i];
    compare("chunk/lookback/pgdn/negative_beta_p", c, DType::bf16, DType::f32, ws, nullptr);
  }
}

/// Runs case c (input type d) with the write keys formed by the state pass where it can (kw_state, the default)
/// and by the intra-chunk kernel (allow_kw_state off), checks that o, hT and aT agree bit for bit, and returns the
/// two plans (their names in `impl`).
std::array<Plan, 2> kw_state_pair(const std::string& name, const Case& c, DType d, dgps::cuda::Workspace& ws,
                                  std::array<std::string, 2>& impl) {
  std::array<Plan, 2> plan;
  Arrays got[2];
  const PlanOverride* outer = dgps::cuda::testing::plan_override();  // (a case's own override stays in force)
  PlanOverride tiles = outer ? *outer : PlanOverride{};
  tiles.allow_kw_state = false;
  for (int off = 0; off < 2; ++off) {
    std::optional<ScopedPlanOverride> forced;
    if (off) forced.emplace(tiles);
    got[off] = gpu_forward(c, d, DType::f32, ws, &impl[off]);
    plan[off] = last_plan();
  }
  same_bits(name, got[0], got[1], "with and without kw_state");
  return plan;
}

/// DiagonalATK's write keys formed by the warpgroup state pass (ChunkArgs::kw_state, the default for
/// PGDN and PDN with 16-bit inputs and K = V = 128 on Hopper, variant "/kw") from its raw k rows, against
/// the intra-chunk kernel's KW tiles (allow_kw_state off): both form them by the same operations on the
/// same values, so o, hT and aT must agree bit for bit, and both lie within the tolerance of the float64
/// reference (enough (sequence, value head) pairs for the pass's 128-column tiles, which kw_state
/// needs). Packed sequences with an empty and a one-token one (rows past a sequence's end), GVA, f16,
/// the raw rows by cp.async (allow_tma off), and the split pass (segments of 3 chunks), which keeps the
/// intra-chunk kernel's KW tiles.
void kw_state_cases(dgps::cuda::Workspace& ws, bool quick) {
  const ForceChunkwise chunkwise;
  PlanOverride cp, split3;
  cp.allow_tma = false;
  split3.split_chunks = 3;
  const VariantCase cases[] = {
      {"pgdn",
       {.batch = 1, .time = 300, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128},
       {0, 1, 70, 70, 200, 300},
       DType::bf16},
      {"pdn", {.batch = 4, .time = 200, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128}, {}, DType::f16},
      {"pgdn",
       {.batch = 1, .time = 300, .heads = 32, .v_heads = 32, .key_dim = 128, .value_dim = 128},
       {0, 1, 70, 70, 200, 300},
       DType::bf16,
       "cp.async",
       cp},
      {"pgdn",
       {.batch = 1, .time = 1000, .heads = 2, .v_heads = 4, .key_dim = 128, .value_dim = 128},
       {},
       DType::bf16,
       "split3",
       split3},
  };
  uint64_t seed = 7300;
  for (const VariantCase& k : cases) {
    const std::string tag = k.tag;
    const std::string name = std::string("chunk/kw_state/") + k.model + "/" + (tag.empty() ? "-" : tag);
    const ScopedPlanOverride forced(k.plan);
    const Case c = make_random(k.model, k.shape, k.cu, seed++);
    std::array<std::string, 2> impl;
    const std::array<Plan, 2> plan = kw_state_pair(name, c, k.d, ws, impl);
    const std::string dflt = compare(name, c, k.d, DType::f32, ws, nullptr);
    const bool split = plan[0].split > 1;
    report_check(
        split == (tag == "split3") && plan[0].kw_state == !split && !plan[1].kw_state && last_plan().kw_state == !split,
        name + ": variants " + impl[0] + ", " + impl[1] + ", by default " + dflt);
    if (quick) break;
  }
}

/// The chunkwise kernels' squash (squash_fast) away from the default bound x = 1.5 of every other case:
/// x = 0.7 (M above 1 for large statistics) and x = 3 (M in [1/3, 3]), PGDN and PKDA against the float64
/// reference, and PGDN's write keys formed by the state pass's warpgroup (kw_state) and by the intra-chunk
/// kernel giving the same bits.
void squash_cases(dgps::cuda::Workspace& ws) {
  const ForceChunkwise chunkwise;
  // (5 x 32 (sequence, value head) pairs: enough for the pass's 128-column tiles, which kw_state needs)
  const dgps::Shape shape{.batch = 5, .time = 300, .heads = 16, .v_heads = 32, .key_dim = 128, .value_dim = 128};
  uint64_t seed = 7500;
  for (const double x : {0.7, 3.0}) {
    for (const char* m : {"pgdn", "pkda"}) {
      Case c = make_random(m, shape, {}, seed++);
      c.opt.x = x;
      const std::string name = std::string("chunk/squash/") + m + "/x=" + (x < 1 ? "0.7" : "3");
      compare(name, c, DType::bf16, DType::f32, ws, nullptr);
      if (std::string(m) != "pgdn") continue;
      std::array<std::string, 2> impl;
      const std::array<Plan, 2> plan = kw_state_pair(name, c, DType::bf16, ws, impl);
      report_check(plan[0].kw_state && !plan[1].kw_state, name + ": variants " + impl[0] + ", " + impl[1]);
    }
  }
}

namespace dgps_gpu_test { void unified_tests(); }  // test_cuda_unified.cpp

/// The chunkwise kernels' approximate squash (squash_fast; squash_grad_fast with its slopes) against dgps::maths
/// in float32 (logf, expf) over a grid of statistics, centers and bounds (squash_agreement): M within 2e-5 and the
/// slopes within 5e-5 relative (the approximate log2, exp2 and reciprocals are good to a few ulp; the chunkwise
/// kernels round M to 16 bits), and the slopes exactly 0 at the same points (A + eps <= 0).
void squash_fast_cases() {
  const SquashAgreement r = squash_agreement();
  const std::string grid = std::to_string(r.points) + " points";
  report("squash/fast", "M", r.m_fast, 2e-5, "squash_fast vs maths::squash, " + grid);
  report("squash/grad_fast", "M", r.m_grad, 2e-5, "squash_grad_fast vs maths::squash, " + grid);
  report("squash/grad_fast", "dA", r.dmda, 5e-5, "vs maths::squash_slope, " + grid);
  report("squash/grad_fast", "dc", r.dmdc, 5e-5, "vs maths::squash_slope, " + grid);
  report_check(r.zero_mismatch == 0, "squash/grad_fast: slopes 0 where maths::squash_slope's are (" +
                                         std::to_string(r.zero_mismatch) + " points differ)");
}

/// The variant names impl_name gives plans (what the entry points return; host only, run without a GPU too).
void plan_names() {
  auto chunk = [](int vt, bool wg, bool raw, bool tma, bool rv, bool kw, int split) {
    Plan p;
    p.kernel = Plan::Kernel::chunkwise;
    p.state_vt = vt, p.wgmma = wg, p.raw_q = raw, p.tma = tma, p.raw_v = rv, p.kw_state = kw, p.split = split;
    return p;
  };
  auto of = [](Plan::Kernel k, int cols, int keys = 0, int split = 0) {
    Plan p;
    p.kernel = k, p.cols = cols, p.warp_keys = keys, p.warp_split = split;
    return p;
  };
  auto exact = [](Plan::Kernel k, int keys) {
    Plan p;
    p.kernel = k, p.exact_keys = keys;
    return p;
  };
  using K = Plan::Kernel;
  const std::pair<Plan, const char*> names[] = {
      {chunk(16, false, false, false, false, false, 0), "cuda/chunkwise/v16"},
      {chunk(128, false, true, false, false, false, 0), "cuda/chunkwise/v128/raw"},
      {chunk(64, true, false, false, false, false, 0), "cuda/chunkwise/wgmma/v64"},
      {chunk(128, true, false, true, true, false, 0), "cuda/chunkwise/wgmma/v128/tma/rv"},
      {chunk(128, true, true, true, true, true, 0), "cuda/chunkwise/wgmma/v128/raw/tma/rv/kw"},
      {chunk(128, true, true, false, true, false, 6), "cuda/chunkwise/wgmma/v128/raw/rv/split"},
      {of(K::rowblock, 64), "cuda/rowblock/v64"},
      {of(K::rowblock, 32), "cuda/rowblock/v32"},
      {of(K::warp, 0, 64, 2), "cuda/recurrent/k64/ks2"},
      {of(K::warp, 0, 128, 4), "cuda/recurrent/k128/ks4"},
      {of(K::decode_columns, 32), "cuda/decode/w32"},
      {of(K::decode_rowblock, 32), "cuda/decode/v32"},
      {of(K::decode_rowblock, 128), "cuda/decode/v128"},
      {of(K::decode_grouped, 64), "cuda/decode/v64g"},
      {of(K::backward_recurrent, 0), "cuda/backward/recurrent"},
      {exact(K::exact_forward, 16), "cuda/exact/k16"},
      {exact(K::exact_decode, 64), "cuda/exact/decode/k64"},
      {exact(K::exact_backward, 128), "cuda/exact/backward/k128"},
  };
  for (const auto& [plan, want] : names) {
    const std::string got = dgps::cuda::impl_name(plan);
    report_check(got == want, std::string("plan/name: ") + got + " (expected " + want + ")");
  }
}

int main(int argc, char** argv) {
  plan_names();
  if (!dgps::cuda::available() || !dgps::cuda_available()) {
    std::printf("SKIP: no CUDA GPU available; dgps::cuda GPU tests not run (plan names: %d failure(s))\n", g_failures);
    return g_failures ? 1 : 0;
  }
  bool quick = false, exact_only = false, backward_only = false;
  for (int i = 1; i < argc; ++i) {
    quick = quick || std::string(argv[i]) == "--quick";
    exact_only = exact_only || std::string(argv[i]) == "--exact";
    backward_only = backward_only || std::string(argv[i]) == "--backward";
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "device properties");
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  dgps::cuda::Workspace ws;
  const bool kw_only = argc > 1 && std::string(argv[1]) == "--kw-state";  // (for compute-sanitizer)
  try {
    if (exact_only) {
      exact_tests(ws, quick);
      std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
      return g_failures ? 1 : 0;
    }
    if (backward_only) {
      backward_tests(ws, quick);
      std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
      return g_failures ? 1 : 0;
    }
    if (kw_only) {
      kw_state_cases(ws, false);
      std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
      return g_failures ? 1 : 0;
    }
    squash_fast_cases();
    conformance(ws);
    random_cases(ws, quick);
    chunkwise_cases(ws, quick);
    sums_cases(ws, quick);
    lookback_cases(ws, quick);
    kw_state_cases(ws, quick);
    squash_cases(ws);
    for (const char* m : {"pgdn", "pkda"}) {
      chunk_graph_case(m, 4242, ws);
      if (quick) break;
    }
    uint64_t seed = 5000;
    for (const char* m : {"pgdn", "pkda", "mamba2", "pmamba2", "gdn"})
      for (int64_t Tn : {1, 3}) {
        decode_case(m, Tn, DType::f32, seed++, ws);
        if (!quick) decode_case(m, Tn, DType::bf16, seed++, ws);
      }
    // K < 128 (masked key channels) and V not a multiple of the block's 32 columns, one token.
    for (const char* m : {"pgdn", "kda", "gdn", "mamba2"}) decode_case(m, 1, DType::bf16, seed++, ws, 3, 100, 36);
    {  // The 32-column block-row kernel without a preconditioner (allow_decode_columns off).
      PlanOverride rows;
      rows.allow_decode_columns = false;
      const ScopedPlanOverride forced(rows);
      for (const char* m : {"gdn", "kda"}) decode_case(m, 1, DType::bf16, seed++, ws);
    }
    // Large batches: a preconditioner's statistics read from a private copy (not a cluster barrier).
    decode_case("pgdn", 1, DType::bf16, seed++, ws, 200);
    decode_case("pgdn", 3, DType::f32, seed++, ws, 200);
    decode_case("kda", 2, DType::f32, seed++, ws, 66);
    for (const char* m : {"gdn", "pgdn"})
      for (int64_t n : {2, 40, 200}) decode_graph_case(m, n, seed++, ws);
    // Larger batches (N * H >= 4 blocks per SM on an H200), one token: the grouped kernel, every decay
    // and preconditioner, the statistics updated in place by the block that owns them.
    for (const char* m : {"pgdn", "pkda", "kda", "gdn", "mamba2"}) decode_case(m, 1, DType::f32, seed++, ws, 300);
    decode_case("pgdn", 1, DType::bf16, seed++, ws, 300);
    decode_graph_case("pgdn", 300, seed++, ws);
    public_api();
    backward_tests(ws, quick);
    exact_tests(ws, quick);
    unified_tests();
  } catch (const std::exception& e) {
    std::printf("FAIL  exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
