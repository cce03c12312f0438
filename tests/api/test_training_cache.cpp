/// @brief dgps::TrainingCache: a training forward saves S_in, R and the intra-chunk matrices (or, over
/// max_full_bytes, the states entering 4096-token segments); the CPU chunkwise backward reads them instead of
/// recomputing.
///
/// Tolerances: gradients with the cache against gradients without, max|diff| / max|ref| < 2e-5 (float32;
/// the saved and the recomputed chunk states round differently; measured up to 7e-6) and < 1e-12
/// (float64); both against the float64 reference: < 1e-4 (float32) and < 1e-9 (float64), as the other
/// backward tests.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <dgps/cpu/kernels.hpp>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// CPU backend, chunkwise algorithm, chunk size `chunk`, two threads.
dgps::Options chunkwise(int64_t chunk) {
  dgps::Options o = on(dgps::Backend::cpu, 2);
  o.algorithm = dgps::Algorithm::chunkwise;
  o.chunk_size = chunk;
  return o;
}

/// Tensors of a case and its gradient buffers, owned together so that a forward and a backward see the
/// same input addresses (as the cache requires).
template <class T>
struct Bench : GradBuffers<T> {
  using S = dgps::state_t<T>;
  const Case& c;
  CaseTensors<T> ct;
  std::vector<T> o;
  std::vector<S> hT, aT;

  explicit Bench(const Case& cc) : GradBuffers<T>(cc), c(cc), ct(cc) {
    const int64_t HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim, H = c.shape.heads;
    o.assign(std::max<size_t>(size_t(c.shape.batch * c.shape.time * HV * V), 1), T(0));
    hT.assign(size_t(c.N * HV * K * V), S(0));
    const auto adims = precond_state_dims(c.spec, c.N, H, K);
    aT.assign(size_t(adims.empty() ? 0 : product(adims)), S(0));
  }
  dgps::Inputs<T> in() const { return ct.inputs(c); }
  /// Forward of the case, saving into `cache` when given.
  dgps::RunInfo forward(const dgps::Options& opt, dgps::TrainingCache* cache) {
    auto out = dgps::outputs<T>(o.data()).final_state(hT.data(), aT.empty() ? nullptr : aT.data());
    if (cache) out.save_for_backward(*cache);
    return dgps::dynamic::forward(c.spec, in(), out, opt);
  }
  /// Backward of the case (cotangents do, dhT, daT), reading `cache` when given; every gradient.
  Arrays backward(const dgps::Options& opt, const dgps::TrainingCache* cache) {
    auto gi = dgps::grads_in<T>(ct.p("do"), ct.ps("dhT"), ct.ps("daT"));
    if (cache) gi.use_saved(*cache);
    dgps::dynamic::backward(c.spec, in(), gi, this->g, opt);
    return this->arrays();
  }
};

/// Gradients of case c with input type T: without a cache, and with a cache filled by the forward.
/// Worst relative differences seen by check_cached: cached vs plain and cached vs reference, per type.
double g_worst_same[2] = {0, 0}, g_worst_ref[2] = {0, 0};

template <class T>
void check_cached(const Case& c, const dgps::Options& opt, double tol_same, double tol_ref, const std::string& what,
                  size_t max_full_bytes = dgps::TrainingCache::kDefaultMaxFullBytes) {
  Bench<T> bench(c);
  const Arrays plain = bench.backward(opt, nullptr);
  dgps::TrainingCache cache;
  cache.set_max_full_bytes(max_full_bytes);
  bench.forward(opt, &cache);
  REQUIRE(cache.filled());
  CHECK(cache.bytes() > 0);
  CHECK(cache.checkpoints_only() == (max_full_bytes == 0));
  if (max_full_bytes == 0) {
    // Per sequence, value head and segment of 4096 / C chunks: K rows of pad(V) and pad(K) statistics (diagonal
    // preconditioner), pad(n) = n rounded up to a 64-byte line.
    using S = dgps::state_t<T>;
    const int64_t line = int64_t(64 / sizeof(S)), C = opt.chunk_size, seg = 4096 / C;
    auto pad = [&](int64_t n) { return (n + line - 1) / line * line; };
    const bool diag_pre = c.spec.precond == dgps::precond::Kind::diagonal_atk ||
                          c.spec.precond == dgps::precond::Kind::diagonal_atq;
    int64_t segs = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      const int64_t len = c.cu.empty() ? c.shape.time : c.cu[size_t(n + 1)] - c.cu[size_t(n)];
      segs += ((len + C - 1) / C + seg - 1) / seg;
    }
    const int64_t K = c.shape.key_dim, block = K * pad(c.shape.value_dim) + (diag_pre ? pad(K) : 0);
    CHECK(cache.bytes() == size_t(segs * c.shape.v_heads * block) * sizeof(S));
  }
  const Arrays cached = bench.backward(opt, &cache);
  const Arrays ref = run_backward<double>(c, on(dgps::Backend::reference));
  std::string w1, w2;
  const double e_same = worst(cached, plain, &w1), e_ref = worst(cached, ref, &w2);
  INFO(what << ": cached vs plain " << e_same << " (" << w1 << "), cached vs reference " << e_ref << " (" << w2 << ")");
  CHECK(e_same < tol_same);
  CHECK(e_ref < tol_ref);
  const int i = std::is_same_v<T, double> ? 1 : 0;
  g_worst_same[i] = std::max(g_worst_same[i], e_same);
  g_worst_ref[i] = std::max(g_worst_ref[i], e_ref);
}

}  // namespace

TEST_CASE(
    "training cache: gradients with the cache equal those without, named models, GVA, varlen, h0/dhT, f32 and f64") {
  struct Shape {
    int64_t H, HV, T, K, V, chunk;
    std::vector<int64_t> cu;
  };
  const Shape shapes[] = {
      {2, 4, 150, 32, 24, 64, {0, 20, 20, 150}},  // GVA, varlen with an empty sequence, partial chunks
      {1, 1, 200, 16, 16, 16, {}},                // several full chunks and a partial one
      {2, 2, 70, 128, 128, 64, {0, 5, 70}},       // K = V = 128, a sequence shorter than the chunk
      {1, 1, 100, 16, 64, 16, {0, 100}},          // one (sequence, head) pair: value columns split over threads
      {7, 7, 150, 16, 16, 32, {0, 150}},          // key heads in groups of 3, 3 and 1 (backward tasks)
  };
  uint64_t seed = 4100;
  for (const char* model : {"gdn", "pgdn", "kda", "pkda", "dn", "mamba2", "pmamba2", "la", "gla", "pdn"})
    for (const auto& sh : shapes) {
      Gen gen;
      gen.h0 = gen.a0 = gen.final_grads = true;
      const int64_t B = sh.cu.empty() ? 2 : 1;
      const Case c =
          random_case(dgps::model_by_name(model),
                      {.batch = B, .time = sh.T, .heads = sh.H, .v_heads = sh.HV, .key_dim = sh.K, .value_dim = sh.V},
                      sh.cu, ++seed, gen);
      const std::string what = std::string(model) + " T " + std::to_string(sh.T) + " K " + std::to_string(sh.K);
      check_cached<float>(c, chunkwise(sh.chunk), 2e-5, 1e-4, what + " f32");
      check_cached<double>(c, chunkwise(sh.chunk), 1e-12, 1e-9, what + " f64");
    }
  MESSAGE("cached vs plain: f32 " << g_worst_same[0] << ", f64 " << g_worst_same[1] << "; cached vs reference: f32 "
                                  << g_worst_ref[0] << ", f64 " << g_worst_ref[1]);
}

// A full cache over max_full_bytes: the forward saves only the state (and statistics) entering every 4096-token
// segment, and the backward recomputes each segment from it. Sequences of one, two and three segments (the last
// partial), an empty one, GVA, h0 and final cotangents, a chunk that does not divide 4096.
TEST_CASE("training cache: checkpoints only, sequences of several segments, GVA, varlen, f32 and f64") {
  uint64_t seed = 4700;
  for (const char* model : {"gdn", "pgdn", "kda", "pkda", "dn", "mamba2", "la"})
    for (const int64_t chunk : {int64_t(16), int64_t(48)}) {
      Gen gen;
      gen.h0 = gen.a0 = gen.final_grads = true;
      const std::vector<int64_t> cu = {0, 8500, 8500, 12600, 12700};
      const Case c =
          random_case(dgps::model_by_name(model),
                      {.batch = 1, .time = cu.back(), .heads = 2, .v_heads = 4, .key_dim = 16, .value_dim = 8}, cu,
                      ++seed, gen);
      const std::string what = std::string(model) + " chunk " + std::to_string(chunk);
      check_cached<float>(c, chunkwise(chunk), 2e-5, 1e-4, what + " f32", 0);
      check_cached<double>(c, chunkwise(chunk), 1e-12, 1e-9, what + " f64", 0);
    }
}

TEST_CASE("training cache: the backward reads it (a zeroed cache changes the gradients)") {
  const Case c =
      random_case(dgps::model_by_name("gdn"),
                  {.batch = 1, .time = 64, .heads = 1, .v_heads = 1, .key_dim = 16, .value_dim = 16}, {}, 71);
  Bench<double> bench(c);
  const dgps::Options opt = chunkwise(16);
  const Arrays plain = bench.backward(opt, nullptr);
  dgps::TrainingCache cache;
  bench.forward(opt, &cache);
  CHECK(worst(bench.backward(opt, &cache), plain) < 1e-12);
  std::memset(dgps::detail::TrainingCacheAccess::data(cache), 0, cache.bytes());
  CHECK(worst(bench.backward(opt, &cache), plain) > 1e-2);
  // Checkpoints only: the states entering the segments are read (T = 5000: two segments).
  const Case c2 =
      random_case(dgps::model_by_name("gdn"),
                  {.batch = 1, .time = 5000, .heads = 1, .v_heads = 1, .key_dim = 16, .value_dim = 16}, {}, 72);
  Bench<double> bench2(c2);
  const Arrays plain2 = bench2.backward(opt, nullptr);
  cache.set_max_full_bytes(0);
  bench2.forward(opt, &cache);
  REQUIRE(cache.checkpoints_only());
  CHECK(worst(bench2.backward(opt, &cache), plain2) < 1e-12);
  std::memset(dgps::detail::TrainingCacheAccess::data(cache), 0, cache.bytes());
  CHECK(worst(bench2.backward(opt, &cache), plain2) > 1e-2);
}

TEST_CASE("training cache: every covered combination, without h0 and final cotangents, odd chunk, f64") {
  uint64_t seed = 4300;
  for (const auto& spec : covered_specs()) {
    Gen gen;
    gen.h0 = gen.a0 = gen.final_grads = false;
    const Case c = random_case(spec, {.batch = 1, .time = 45, .heads = 2, .v_heads = 4, .key_dim = 16, .value_dim = 8},
                               {0, 17, 45}, ++seed, gen);
    check_cached<double>(c, chunkwise(7), 1e-12, 1e-9, dgps::to_string(spec));
  }
}

TEST_CASE("training cache: strong decay, zero keys, forward and backward on different ISAs") {
  Gen gen;
  gen.g_lo = gen.g_hi = -50;
  gen.zero_key_tokens = {0, 3, 64, 65, 99};
  for (const char* model : {"kda", "pkda", "pgdn"}) {
    const Case c =
        random_case(dgps::model_by_name(model),
                    {.batch = 1, .time = 100, .heads = 2, .v_heads = 2, .key_dim = 32, .value_dim = 32}, {}, 7, gen);
    Bench<float> bench(c);
    const dgps::Options opt = chunkwise(64);
    const Arrays plain = bench.backward(opt, nullptr);
    const Arrays ref = run_backward<double>(c, on(dgps::Backend::reference));
    for (const char* fwd_isa : kCpuIsas)
      for (const char* bwd_isa : kCpuIsaEnds) {
        dgps::TrainingCache cache;
        {
          IsaCap cap(fwd_isa);
          bench.forward(opt, &cache);
        }
        IsaCap cap(bwd_isa);
        const Arrays cached = bench.backward(opt, &cache);
        INFO(model << " forward " << fwd_isa << " backward " << bwd_isa);
        for (const auto& [n, v] : cached) CHECK(all_finite(v));
        CHECK(worst(cached, plain) < 2e-5);
        CHECK(worst(cached, ref) < 1e-4);
      }
  }
}

TEST_CASE("training cache: bf16 inputs (forward and backward through the compile-time API)") {
  const Case c =
      random_case(dgps::model_by_name("pgdn"),
                  {.batch = 1, .time = 90, .heads = 2, .v_heads = 2, .key_dim = 32, .value_dim = 32}, {}, 61);
  CaseTensors<dgps::bf16> ct(c);
  auto in = ct.inputs(c);
  std::vector<dgps::bf16> o(c.arr.at("v").size());
  std::vector<dgps::bf16> dk0(c.arr.at("k").size()), dk1(dk0.size()), dv0(o.size()), dv1(o.size());
  const dgps::Options opt = chunkwise(32);
  auto grads = [&](std::vector<dgps::bf16>& dk, std::vector<dgps::bf16>& dv) {
    dgps::Grads<dgps::bf16> g;
    g.dk = tv<dgps::bf16>(dk, c.shapes.at("k"));
    g.dv = tv<dgps::bf16>(dv, c.shapes.at("v"));
    return g;
  };
  dgps::backward<dgps::PGDN>(in, dgps::grads_in<dgps::bf16>(ct.p("do")), grads(dk0, dv0), opt);
  dgps::TrainingCache cache;
  dgps::forward<dgps::PGDN>(in, dgps::outputs<dgps::bf16>(o.data()).save_for_backward(cache), opt);
  REQUIRE(cache.filled());
  dgps::backward<dgps::PGDN>(in, dgps::grads_in<dgps::bf16>(ct.p("do")).use_saved(cache), grads(dk1, dv1), opt);
  // The gradients are rounded to bf16: they agree to its rounding.
  std::vector<double> a(dk0.begin(), dk0.end()), b(dv0.begin(), dv0.end());
  CHECK(rel_err(dk1, a) < 1e-2);
  CHECK(rel_err(dv1, b) < 1e-2);
}

TEST_CASE("training cache: size, reuse, and the paths that save nothing") {
  const Case c =
      random_case(dgps::model_by_name("gdn"),
                  {.batch = 1, .time = 100, .heads = 2, .v_heads = 2, .key_dim = 128, .value_dim = 128}, {}, 81);
  Bench<float> bench(c);
  const dgps::Options opt = chunkwise(64);
  // Online, K = V = 128, C = 64, float: 4 * (K * V / C + V + C) = 1792 bytes per token and value head,
  // a partial chunk taking a whole chunk's block (2 chunks of 64 here).
  const size_t expect = size_t(2 * 2 * 64) * 1792;
  CHECK(dgps::training_cache_bytes<dgps::GDN>(bench.in(), opt) == expect);
  // Up to max_full_bytes the full cache; above it the checkpoints: one 4096-token segment per value head here,
  // K x V floats each.
  const size_t checkpoints = size_t(2 * 128 * 128) * 4;
  CHECK(dgps::training_cache_bytes<dgps::GDN>(bench.in(), opt, expect) == expect);
  CHECK(dgps::training_cache_bytes<dgps::GDN>(bench.in(), opt, expect - 1) == checkpoints);
  CHECK(dgps::training_cache_bytes<dgps::GDN>(bench.in(), opt, 0) == checkpoints);
  std::vector<float> gp(size_t(c.shape.time * c.shape.heads), -0.1f), bp(gp.size(), 0.5f);
  CHECK(
      dgps::training_cache_bytes<dgps::MesaLayer>(
          dgps::inputs<float>(c.shape, bench.ct.p("q"), bench.ct.p("k"), bench.ct.p("v")).precond(gp.data(), bp.data()),
          opt) == 0);
  dgps::TrainingCache cache;
  CHECK(!cache.filled());
  CHECK(cache.bytes() == 0);
  bench.forward(opt, &cache);
  CHECK(cache.filled());
  CHECK(cache.bytes() == expect);
  CHECK(cache.capacity() >= expect);
  const Arrays plain = bench.backward(opt, nullptr);
  CHECK(worst(bench.backward(opt, &cache), plain) < 2e-5);
  // A second forward reuses the memory; a moved-to cache keeps the contents.
  bench.forward(opt, &cache);
  dgps::TrainingCache moved = std::move(cache);
  CHECK(!cache.filled());
  CHECK(moved.filled());
  CHECK(worst(bench.backward(opt, &moved), plain) < 2e-5);
  // Reference and recurrent forwards save nothing: the cache is empty afterwards and ignored.
  for (dgps::Options other : {on(dgps::Backend::reference), on(dgps::Backend::cpu)}) {
    if (other.backend == dgps::Backend::cpu) other.algorithm = dgps::Algorithm::recurrent;
    bench.forward(other, &moved);
    CHECK(!moved.filled());
    CHECK(moved.bytes() == 0);
    CHECK(worst(bench.backward(opt, &moved), plain) < 1e-12);
  }
  // The reference and recurrent backward ignore a filled cache.
  bench.forward(opt, &moved);
  const Arrays ref = run_backward<double>(c, on(dgps::Backend::reference));
  CHECK(worst(bench.backward(on(dgps::Backend::reference), &moved), ref) < 1e-4);
  dgps::Options rec = on(dgps::Backend::cpu);
  rec.algorithm = dgps::Algorithm::recurrent;
  CHECK(worst(bench.backward(rec, &moved), ref) < 1e-4);
  moved.clear();
  CHECK(!moved.filled());
  CHECK(moved.capacity() == 0);
}

TEST_CASE("training cache: a cache from another call throws and writes nothing") {
  const Case c =
      random_case(dgps::model_by_name("pgdn"),
                  {.batch = 1, .time = 40, .heads = 2, .v_heads = 2, .key_dim = 16, .value_dim = 16}, {0, 15, 40}, 91);
  Bench<float> bench(c);
  const dgps::Options opt = chunkwise(16);
  dgps::TrainingCache cache;
  bench.forward(opt, &cache);
  REQUIRE(cache.filled());
  auto expect_throw = [&](const std::string& what, const std::function<void()>& call, const std::string& needle) {
    INFO(what);
    bench.gt["dq"].assign(bench.gt["dq"].size(), 7.0f);
    try {
      call();
      FAIL("no error");
    } catch (const dgps::Error& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("training cache") != std::string::npos);
      CHECK(msg.find(needle) != std::string::npos);
    }
    for (float x : bench.gt["dq"]) REQUIRE(x == 7.0f);  // nothing written
  };
  auto gi = [&] { return dgps::grads_in<float>(bench.ct.p("do")).use_saved(cache); };
  expect_throw(
      "another model with the same inputs",
      [&] { dgps::dynamic::backward(dgps::model_by_name("pmamba2"), bench.in(), gi(), bench.g, opt); }, "model");
  // The backward with one option changed from the forward that filled the cache.
  auto expect_option_throw = [&](const char* what, auto&& change, const char* needle) {
    expect_throw(
        what,
        [&] {
          dgps::Options o = opt;
          change(o);
          dgps::dynamic::backward(c.spec, bench.in(), gi(), bench.g, o);
        },
        needle);
  };
  expect_option_throw(
      "another chunk size", [](dgps::Options& o) { o.chunk_size = 32; }, "chunk_size");
  expect_option_throw(
      "another scale", [](dgps::Options& o) { o.scale = 0.5; }, "scale");
  expect_option_throw(
      "another squash bound", [](dgps::Options& o) { o.x = 1.2; }, "'x'");
  expect_option_throw(
      "no L2 norm", [](dgps::Options& o) { o.l2norm_qk = false; }, "l2norm_qk");
  expect_throw(
      "other sequence boundaries",
      [&] {
        std::vector<int64_t> cu{0, 20, 40};
        auto in = bench.in();
        in.varlen(cu.data(), 2);
        dgps::dynamic::backward(c.spec, in, gi(), bench.g, opt);
      },
      "cu_seqlens");
  expect_throw(
      "a copy of q",
      [&] {
        std::vector<float> q(bench.ct.t.at("q"));
        auto in = bench.in();
        in.q = dgps::view<const float>(q.data(), c.shapes.at("q"));
        dgps::dynamic::backward(c.spec, in, gi(), bench.g, opt);
      },
      "tensor 'q'");
  expect_throw(
      "no h0 in the backward",
      [&] {
        auto in = bench.in();
        in.h0 = {};
        dgps::dynamic::backward(c.spec, in, gi(), bench.g, opt);
      },
      "tensor 'h0'");
  expect_throw(
      "a shorter problem",
      [&] {
        auto in = bench.in();
        in.shape.time = 30;
        in.cu_seqlens = {};
        std::vector<int64_t> cu{0, 15, 30};
        in.varlen(cu.data(), 2);
        dgps::Grads<float> g;
        dgps::dynamic::backward(c.spec, in, gi(), g, opt);
      },
      "time");
  // Float64 inputs against a float32 cache.
  {
    Bench<double> b64(c);
    INFO("float64 backward, float32 cache");
    try {
      dgps::dynamic::backward(c.spec, b64.in(), dgps::grads_in<double>(b64.ct.p("do")).use_saved(cache), b64.g, opt);
      FAIL("no error");
    } catch (const dgps::Error& e) {
      CHECK(std::string(e.what()).find("float32") != std::string::npos);
    }
  }
  // The failed calls left the cache usable.
  CHECK(worst(bench.backward(opt, &cache), bench.backward(opt, nullptr)) < 2e-5);
}
