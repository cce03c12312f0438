/// @brief Validation (issue 2 item 5): every malformed call throws dgps::Error with a clear message and writes nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

constexpr float kSentinel = 12345.5f;
using View = dgps::TensorView<const float>;
using MView = dgps::TensorView<float>;

/// A valid PGDN call (B = 2, T = 5, H = 2, HV = 4, K = 3, V = 2) with every output pre-filled
/// with a sentinel; `junk` backs the malformed views (large enough for any of them).
struct Fix {
  static constexpr int64_t B = 2, T = 5, H = 2, HV = 4, K = 3, V = 2;
  dgps::Shape shape{.batch = B, .time = T, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  std::vector<float> q = fill(B * T * H * K, 0.3f), k = fill(B * T * H * K, -0.2f), v = fill(B * T * HV * V, 0.5f);
  std::vector<float> g = fill(B * T * HV * K, -0.1f), beta = fill(B * T * HV, 0.5f);
  std::vector<float> g_p = fill(B * T * H, -0.1f), beta_p = fill(B * T * H, 0.9f), center = fill(H, -0.2f);
  std::vector<float> h0 = fill(B * HV * K * V, 0.1f), a0 = fill(B * H * K * K, 0.2f);
  std::vector<float> o, hT, aT, d_o = fill(B * T * HV * V, 1.0f), junk = fill(4096, 0.25f);
  std::vector<float> grads[10];

  static std::vector<float> fill(int64_t n, float x) { return std::vector<float>(static_cast<size_t>(n), x); }
  Fix() { reset(); }
  void reset() {
    o = fill(B * T * HV * V, kSentinel);
    hT = fill(B * HV * K * V, kSentinel);
    aT = fill(B * H * K * K, kSentinel);
    for (auto& gr : grads) gr = fill(B * T * HV * K * 4, kSentinel);
  }
  bool untouched() const {
    auto same = [](const std::vector<float>& x) {
      for (float e : x)
        if (e != kSentinel) return false;
      return true;
    };
    bool ok = same(o) && same(hT) && same(aT);
    for (const auto& gr : grads) ok = ok && same(gr);
    return ok;
  }
  /// Complete valid PGDN inputs (bare pointers: contiguous in the SPEC shapes).
  dgps::Inputs<float> in() const {
    return dgps::inputs<float>(shape, q.data(), k.data(), v.data())
        .decay(g.data())
        .gain(beta.data())
        .precond(g_p.data(), beta_p.data(), center.data())
        .initial_state(h0.data(), a0.data());
  }
  dgps::Outputs<float> out() { return dgps::outputs<float>(o.data()).final_state(hT.data(), aT.data()); }
  /// A view of `junk` with the given sizes.
  View bad(std::initializer_list<int64_t> sizes) const { return View(junk.data(), sizes); }
  MView mbad(std::initializer_list<int64_t> sizes) { return MView(junk.data(), sizes); }
};

dgps::Options ref_opt() {
  dgps::Options o;
  o.backend = dgps::Backend::reference;
  return o;
}

/// Runs `call` on fresh sentinels; asserts dgps::Error with every needle in its message and that
/// no output was written.
void expect_error(Fix& f, const std::string& label, const std::function<void()>& call,
                  std::initializer_list<const char*> needles) {
  f.reset();
  std::string msg;
  bool thrown = false;
  try {
    call();
  } catch (const dgps::Error& e) {
    thrown = true;
    msg = e.what();
  }
  INFO(label << ": message \"" << msg << "\"");
  CHECK(thrown);
  for (const char* n : needles) {
    INFO("expected substring: " << n);
    CHECK(msg.find(n) != std::string::npos);
  }
  CHECK(f.untouched());
}

}  // namespace

TEST_CASE("validation: the valid fixture call succeeds and writes its outputs") {
  Fix f;
  const auto info = dgps::forward<dgps::PGDN>(f.in(), f.out(), ref_opt());
  CHECK(info.backend == dgps::Backend::reference);
  CHECK(!f.untouched());
}

TEST_CASE("validation: wrong rank or size of every input") {
  Fix f;
  using dgps::Inputs;
  struct Bad {
    const char* name;
    std::function<void(Inputs<float>&, const Fix&)> set_rank, set_size;
    const char *rank_got, *size_got, *expected;
  };
  const Bad cases[] = {
      {"q",
       [](auto& in, auto& f) {
         in.q = f.bad({2, 5, 6});
       },
       [](auto& in, auto& f) {
         in.q = f.bad({2, 5, 2, 4});
       },
       "[2, 5, 6]", "[2, 5, 2, 4]", "[2, 5, 2, 3]"},
      {"k",
       [](auto& in, auto& f) {
         in.k = f.bad({10, 2, 3});
       },
       [](auto& in, auto& f) {
         in.k = f.bad({2, 4, 2, 3});
       },
       "[10, 2, 3]", "[2, 4, 2, 3]", "[2, 5, 2, 3]"},
      {"v",
       [](auto& in, auto& f) {
         in.v = f.bad({2, 5, 8});
       },
       [](auto& in, auto& f) {
         in.v = f.bad({2, 5, 2, 2});
       },
       "[2, 5, 8]", "[2, 5, 2, 2]", "[2, 5, 4, 2]"},
      {"g",
       [](auto& in, auto& f) {
         in.g = f.bad({2, 5, 4, 3});
       },
       [](auto& in, auto& f) {
         in.g = f.bad({2, 5, 2});
       },
       "[2, 5, 4, 3]", "[2, 5, 2]", "[2, 5, 4]"},
      {"beta",
       [](auto& in, auto& f) {
         in.beta = f.bad({10, 4});
       },
       [](auto& in, auto& f) {
         in.beta = f.bad({2, 5, 5});
       },
       "[10, 4]", "[2, 5, 5]", "[2, 5, 4]"},
      {"g_p",
       [](auto& in, auto& f) {
         in.g_p = f.bad({2, 5, 2, 1});
       },
       [](auto& in, auto& f) {
         in.g_p = f.bad({2, 5, 4});
       },
       "[2, 5, 2, 1]", "[2, 5, 4]", "[2, 5, 2]"},
      {"beta_p", [](auto& in, auto& f) { in.beta_p = f.bad({10}); },
       [](auto& in, auto& f) {
         in.beta_p = f.bad({1, 5, 2});
       },
       "[10]", "[1, 5, 2]", "[2, 5, 2]"},
      {"center",
       [](auto& in, auto& f) {
         in.center = f.bad({1, 2});
       },
       [](auto& in, auto& f) { in.center = f.bad({4}); }, "[1, 2]", "[4]", "[2]"},
      {"h0",
       [](auto& in, auto& f) {
         in.h0 = f.bad({2, 4, 6});
       },
       [](auto& in, auto& f) {
         in.h0 = f.bad({2, 4, 3, 3});
       },
       "[2, 4, 6]", "[2, 4, 3, 3]", "[2, 4, 3, 2]"},
      {"a0",
       [](auto& in, auto& f) {
         in.a0 = f.bad({2, 2, 3, 3});
       },
       [](auto& in, auto& f) {
         in.a0 = f.bad({2, 2, 2});
       },
       "[2, 2, 3, 3]", "[2, 2, 2]", "[2, 2, 3]"},
  };
  for (const auto& c : cases) {
    const std::string tensor = std::string("tensor '") + c.name + "'";
    expect_error(f, std::string("rank of ") + c.name,
                 [&] {
                   auto in = f.in();
                   c.set_rank(in, f);
                   dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
                 },
                 {tensor.c_str(), c.rank_got, c.expected});
    expect_error(f, std::string("size of ") + c.name,
                 [&] {
                   auto in = f.in();
                   c.set_size(in, f);
                   dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
                 },
                 {tensor.c_str(), c.size_got, c.expected});
  }
}

TEST_CASE("validation: wrong rank or size of every output, missing o") {
  Fix f;
  expect_error(f, "o rank",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.mbad({2, 5, 8})).final_state(f.hT.data(), f.aT.data()), ref_opt());
               },
               {"tensor 'o'", "[2, 5, 8]", "expected [2, 5, 4, 2]"});
  expect_error(f, "o size",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.mbad({2, 5, 4, 3})).final_state(f.hT.data(), f.aT.data()),
                     ref_opt());
               },
               {"tensor 'o'", "[2, 5, 4, 3]", "expected [2, 5, 4, 2]"});
  expect_error(f, "o missing",
               [&] {
                 dgps::forward<dgps::PGDN>(f.in(), dgps::outputs<float>(nullptr).final_state(f.hT.data(), f.aT.data()),
                                           ref_opt());
               },
               {"tensor 'o'", "required"});
  expect_error(f, "hT size",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.o.data()).final_state(f.mbad({2, 4, 2, 3}), f.aT.data()),
                     ref_opt());
               },
               {"tensor 'hT'", "[2, 4, 2, 3]", "expected [2, 4, 3, 2]"});
  expect_error(f, "hT rank",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.o.data()).final_state(f.mbad({8, 3, 2}), f.aT.data()), ref_opt());
               },
               {"tensor 'hT'", "[8, 3, 2]", "expected [2, 4, 3, 2]"});
  expect_error(f, "aT size (exact shape for a diagonal preconditioner)",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.o.data()).final_state(f.hT.data(), f.mbad({2, 2, 3, 3})),
                     ref_opt());
               },
               {"tensor 'aT'", "[2, 2, 3, 3]", "expected [2, 2, 3]"});
}

TEST_CASE("validation: shape sizes, HV not a multiple of H") {
  Fix f;
  auto with_shape = [&](auto mutate) {
    return [&f, mutate] {
      auto in = f.in();
      mutate(in.shape);
      dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
    };
  };
  expect_error(f, "HV % H", with_shape([](dgps::Shape& s) { s.v_heads = 3; }),
               {"v_heads (3)", "multiple of heads (2)"});
  expect_error(f, "batch 0", with_shape([](dgps::Shape& s) { s.batch = 0; }), {"batch", ">= 1", "got 0"});
  expect_error(f, "heads 0", with_shape([](dgps::Shape& s) { s.heads = 0; }), {"heads", "got 0"});
  expect_error(f, "key_dim 0", with_shape([](dgps::Shape& s) { s.key_dim = 0; }), {"key_dim", "got 0"});
  expect_error(f, "value_dim -1", with_shape([](dgps::Shape& s) { s.value_dim = -1; }), {"value_dim", "got -1"});
  expect_error(f, "time -1", with_shape([](dgps::Shape& s) { s.time = -1; }), {"time", "got -1"});
}

TEST_CASE("validation: inputs the policies need but did not get") {
  Fix f;
  struct Miss {
    const char* name;
    std::function<void(dgps::Inputs<float>&)> drop;
  };
  const Miss misses[] = {
      {"g", [](auto& in) { in.g = {}; }},           {"beta", [](auto& in) { in.beta = {}; }},
      {"g_p", [](auto& in) { in.g_p = {}; }},       {"beta_p", [](auto& in) { in.beta_p = {}; }},
      {"center", [](auto& in) { in.center = {}; }}, {"q", [](auto& in) { in.q = {}; }},
      {"k", [](auto& in) { in.k = {}; }},           {"v", [](auto& in) { in.v = {}; }},
  };
  for (const auto& m : misses) {
    const std::string tensor = std::string("tensor '") + m.name + "'";
    expect_error(f, std::string("PGDN without ") + m.name,
                 [&] {
                   auto in = f.in();
                   m.drop(in);
                   dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
                 },
                 {tensor.c_str(), "is required", "pgdn"});
  }
  // Diagonal decay (KDA): g must be [B, T, HV, K]; the scalar-decay shape is rejected.
  expect_error(f, "KDA with scalar-decay g",
               [&] {
                 auto in = dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data())
                               .decay(View(f.g.data(), {2, 5, 4}))
                               .gain(f.beta.data());
                 dgps::forward<dgps::KDA>(in, dgps::outputs<float>(f.o.data()), ref_opt());
               },
               {"tensor 'g'", "[2, 5, 4]", "expected [2, 5, 4, 3]"});
  // The exact preconditioner's a0 is [N, H, K, K].
  expect_error(f, "Mesa with a diagonal a0",
               [&] {
                 auto in = dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data())
                               .precond(f.g_p.data(), f.beta_p.data())
                               .initial_state(nullptr, View(f.a0.data(), {2, 2, 3}));
                 dgps::forward<dgps::MesaLayer>(in, dgps::outputs<float>(f.o.data()), ref_opt());
               },
               {"tensor 'a0'", "[2, 2, 3]", "expected [2, 2, 3, 3]"});
}

TEST_CASE("validation: inputs given that the model does not use") {
  Fix f;
  auto base = [&] { return dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data()); };
  auto o_only = [&] { return dgps::outputs<float>(f.o.data()); };
  expect_error(
      f, "DeltaNet with g",
      [&] { dgps::forward<dgps::DeltaNet>(base().decay(f.g.data()).gain(f.beta.data()), o_only(), ref_opt()); },
      {"tensor 'g'", "decay=none"});
  expect_error(f, "linear attention with beta",
               [&] { dgps::forward<dgps::LinearAttention>(base().gain(f.beta.data()), o_only(), ref_opt()); },
               {"tensor 'beta'", "gain=unit"});
  expect_error(f, "GDN with g_p",
               [&] {
                 dgps::forward<dgps::GDN>(base().decay(f.g.data()).gain(f.beta.data()).precond(f.g_p.data(), nullptr),
                                          o_only(), ref_opt());
               },
               {"tensor 'g_p'", "precond=identity"});
  expect_error(f, "GDN with beta_p",
               [&] {
                 dgps::forward<dgps::GDN>(
                     base().decay(f.g.data()).gain(f.beta.data()).precond(nullptr, f.beta_p.data()), o_only(),
                     ref_opt());
               },
               {"tensor 'beta_p'", "precond=identity"});
  expect_error(f, "Mesa with center",
               [&] {
                 dgps::forward<dgps::MesaLayer>(base().precond(f.g_p.data(), f.beta_p.data(), f.center.data()),
                                                o_only(), ref_opt());
               },
               {"tensor 'center'", "diagonal preconditioners"});
  expect_error(f, "GDN with a0",
               [&] {
                 dgps::forward<dgps::GDN>(
                     base().decay(f.g.data()).gain(f.beta.data()).initial_state(f.h0.data(), f.a0.data()), o_only(),
                     ref_opt());
               },
               {"tensor 'a0'", "no preconditioner state"});
  expect_error(f, "GDN with aT",
               [&] {
                 dgps::forward<dgps::GDN>(base().decay(f.g.data()).gain(f.beta.data()),
                                          o_only().final_state(f.hT.data(), f.aT.data()), ref_opt());
               },
               {"tensor 'aT'", "no preconditioner state"});
}

TEST_CASE("validation: null data with a shape, non-contiguous last dimension, sizes/strides mismatch") {
  Fix f;
  expect_error(f, "null q with shape",
               [&] {
                 auto in = f.in();
                 in.q = View(nullptr, {2, 5, 2, 3});
                 dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
               },
               {"tensor 'q'", "null data", "[2, 5, 2, 3]"});
  expect_error(f, "null hT with shape",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(f.o.data()).final_state(MView(nullptr, {2, 4, 3, 2})), ref_opt());
               },
               {"tensor 'hT'", "null data"});
  expect_error(f, "k last stride 2",
               [&] {
                 auto in = f.in();
                 in.k = View(f.junk.data(), {2, 5, 2, 3}, {60, 12, 6, 2});
                 dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
               },
               {"tensor 'k'", "contiguous in its last dimension", "stride 2"});
  expect_error(f, "o last stride 3",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(MView(f.junk.data(), {2, 5, 4, 2}, {120, 24, 6, 3})), ref_opt());
               },
               {"tensor 'o'", "contiguous in its last dimension", "stride 3"});
  expect_error(f, "v sizes/strides lengths differ",
               [&] {
                 auto in = f.in();
                 in.v = View(f.junk.data(), {2, 5, 4, 2}, {40, 8, 2});
                 dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
               },
               {"tensor 'v'", "different lengths"});
  // A valid strided (non-contiguous in the outer dimensions) view is accepted.
  auto in = f.in();
  std::vector<float> wide(2 * 5 * 2 * 8, 0.3f);
  in.q = View(wide.data(), {2, 5, 2, 3}, {80, 16, 8, 1});
  CHECK_NOTHROW(dgps::forward<dgps::PGDN>(in, f.out(), ref_opt()));
}

TEST_CASE("validation: cu_seqlens and the number of initial states") {
  Fix f;
  const dgps::Shape s1{.batch = 1, .time = 5, .heads = 2, .v_heads = 4, .key_dim = 3, .value_dim = 2};
  auto call = [&](std::vector<int64_t> cu, dgps::Shape shape) {
    return [&f, cu, shape] {
      auto in = f.in();
      in.shape = shape;
      in.varlen(cu.data(), static_cast<int64_t>(cu.size()) - 1);
      in.initial_state(nullptr, nullptr);
      dgps::forward<dgps::PGDN>(in, dgps::outputs<float>(f.o.data()), ref_opt());
    };
  };
  expect_error(f, "cu starts at 1", call({1, 3, 5}, s1), {"cu_seqlens", "start at 0", "got 1"});
  expect_error(f, "cu decreases", call({0, 3, 2, 5}, s1), {"cu_seqlens", "not decrease", "cu_seqlens[2] = 2"});
  expect_error(f, "cu ends before T", call({0, 2, 4}, s1), {"cu_seqlens", "end at T = 5", "got 4"});
  expect_error(f, "cu ends after T", call({0, 2, 6}, s1), {"cu_seqlens", "end at T = 5", "got 6"});
  expect_error(f, "cu with batch 2", call({0, 2, 5}, f.shape), {"cu_seqlens", "batch == 1", "batch = 2"});
  expect_error(f, "cu with one entry", call({0}, s1), {"cu_seqlens", "[1]", "N+1"});
  expect_error(f, "cu null with shape",
               [&] {
                 auto in = f.in();
                 in.shape = s1;
                 in.initial_state(nullptr, nullptr);
                 in.varlen(dgps::TensorView<const int64_t>(nullptr, {3}));
                 dgps::forward<dgps::PGDN>(in, dgps::outputs<float>(f.o.data()), ref_opt());
               },
               {"cu_seqlens", "null data"});
  // Three sequences (N = 3) but h0 / a0 / hT / aT for two.
  const std::vector<int64_t> cu{0, 1, 3, 5};
  auto varlen_in = [&] {
    auto in = f.in();
    in.shape = s1;
    in.varlen(cu.data(), 3);
    in.initial_state(nullptr, nullptr);
    return in;
  };
  expect_error(f, "h0 for 2 of 3 sequences",
               [&] {
                 auto in = varlen_in();
                 in.h0 = View(f.h0.data(), {2, 4, 3, 2});
                 dgps::forward<dgps::PGDN>(in, dgps::outputs<float>(f.o.data()), ref_opt());
               },
               {"tensor 'h0'", "[2, 4, 3, 2]", "expected [3, 4, 3, 2]"});
  expect_error(f, "a0 for 2 of 3 sequences",
               [&] {
                 auto in = varlen_in();
                 in.a0 = View(f.a0.data(), {2, 2, 3});
                 dgps::forward<dgps::PGDN>(in, dgps::outputs<float>(f.o.data()), ref_opt());
               },
               {"tensor 'a0'", "[2, 2, 3]", "expected [3, 2, 3]"});
  expect_error(f, "hT for 2 of 3 sequences",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     varlen_in(), dgps::outputs<float>(f.o.data()).final_state(MView(f.hT.data(), {2, 4, 3, 2})),
                     ref_opt());
               },
               {"tensor 'hT'", "expected [3, 4, 3, 2]"});
}

TEST_CASE("validation: options and backends") {
  Fix f;
  auto with = [&](auto mutate) {
    return [&f, mutate] {
      dgps::Options o = ref_opt();
      mutate(o);
      dgps::forward<dgps::PGDN>(f.in(), f.out(), o);
    };
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  expect_error(f, "x = 0", with([](dgps::Options& o) { o.x = 0; }), {"option 'x'", "> 0"});
  expect_error(f, "x = -1", with([](dgps::Options& o) { o.x = -1; }), {"option 'x'", "-1"});
  expect_error(f, "x = nan", with([nan](dgps::Options& o) { o.x = nan; }), {"option 'x'"});
  expect_error(f, "eps < 0", with([](dgps::Options& o) { o.eps = -1e-3; }), {"option 'eps'", ">= 0"});
  expect_error(f, "lambda = 0", with([](dgps::Options& o) { o.lambda = 0; }), {"option 'lambda'", "> 0"});
  expect_error(f, "lambda < 0", with([](dgps::Options& o) { o.lambda = -2; }), {"option 'lambda'"});
  expect_error(f, "scale = inf", with([inf](dgps::Options& o) { o.scale = inf; }), {"option 'scale'", "finite"});
  expect_error(f, "scale = nan", with([nan](dgps::Options& o) { o.scale = nan; }), {"option 'scale'", "finite"});
  expect_error(f, "chunk_size = 0", with([](dgps::Options& o) { o.chunk_size = 0; }), {"option 'chunk_size'"});
  expect_error(f, "threads = -1", with([](dgps::Options& o) { o.threads = -1; }), {"option 'threads'"});
  if (!dgps::cuda_available())
    expect_error(f, "cuda unavailable", with([](dgps::Options& o) { o.backend = dgps::Backend::cuda; }),
                 {"backend 'cuda'", "not available"});
  expect_error(f, "reference chunkwise", with([](dgps::Options& o) { o.algorithm = dgps::Algorithm::chunkwise; }),
               {"backend 'reference'", "chunkwise"});
  CHECK_THROWS_AS(dgps::backend_from_string("gpu"), dgps::Error);
  CHECK_THROWS_AS(dgps::algorithm_from_string("parallel"), dgps::Error);
  CHECK_THROWS_WITH_AS(dgps::model_by_name("pgdn2"), doctest::Contains("unknown model 'pgdn2'"), dgps::Error);
}

TEST_CASE("validation: backward") {
  Fix f;
  auto dv = [&](int i, std::initializer_list<int64_t> sizes) { return MView(f.grads[i].data(), sizes); };
  auto gi = [&] { return dgps::grads_in<float>(f.d_o.data()); };
  expect_error(f, "do missing",
               [&] {
                 dgps::Grads<float> g;
                 g.dq = dv(0, {2, 5, 2, 3});
                 dgps::backward<dgps::PGDN>(f.in(), dgps::grads_in<float>(nullptr), g, ref_opt());
               },
               {"tensor 'do'", "required"});
  expect_error(
      f, "do wrong size",
      [&] {
        dgps::Grads<float> g;
        g.dq = dv(0, {2, 5, 2, 3});
        dgps::backward<dgps::PGDN>(f.in(), dgps::grads_in<float>(View(f.junk.data(), {2, 5, 4, 3})), g, ref_opt());
      },
      {"tensor 'do'", "[2, 5, 4, 3]", "expected [2, 5, 4, 2]"});
  expect_error(f, "dq wrong size",
               [&] {
                 dgps::Grads<float> g;
                 g.dv = dv(0, {2, 5, 4, 2});
                 g.dq = dv(1, {2, 5, 2, 4});
                 dgps::backward<dgps::PGDN>(f.in(), gi(), g, ref_opt());
               },
               {"tensor 'dq'", "[2, 5, 2, 4]", "expected [2, 5, 2, 3]"});
  expect_error(f, "dhT wrong size",
               [&] {
                 dgps::Grads<float> g;
                 g.dq = dv(0, {2, 5, 2, 3});
                 dgps::backward<dgps::PGDN>(
                     f.in(), dgps::grads_in<float>(f.d_o.data(), View(f.junk.data(), {1, 4, 3, 2})), g, ref_opt());
               },
               {"tensor 'dhT'", "[1, 4, 3, 2]", "expected [2, 4, 3, 2]"});
  expect_error(
      f, "daT for a model without preconditioner",
      [&] {
        dgps::Grads<float> g;
        g.dq = dv(0, {2, 5, 2, 3});
        auto in =
            dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data()).decay(f.g.data()).gain(f.beta.data());
        dgps::backward<dgps::GDN>(in, dgps::grads_in<float>(f.d_o.data(), nullptr, f.junk.data()), g, ref_opt());
      },
      {"tensor 'daT'", "no preconditioner state"});
  expect_error(f, "dg requested for a model without g",
               [&] {
                 dgps::Grads<float> g;
                 g.dq = dv(0, {2, 5, 2, 3});
                 g.dg = dv(1, {2, 5, 4});
                 auto in = dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data()).gain(f.beta.data());
                 dgps::backward<dgps::DeltaNet>(in, gi(), g, ref_opt());
               },
               {"tensor 'dg'", "input 'g' is absent"});
  expect_error(
      f, "dcenter requested for a model without center",
      [&] {
        dgps::Grads<float> g;
        g.dq = dv(0, {2, 5, 2, 3});
        g.dcenter = dv(1, {2});
        auto in =
            dgps::inputs<float>(f.shape, f.q.data(), f.k.data(), f.v.data()).precond(f.g_p.data(), f.beta_p.data());
        dgps::backward<dgps::MesaLayer>(in, gi(), g, ref_opt());
      },
      {"tensor 'dcenter'", "input 'center' is absent"});
  expect_error(f, "da0 with the wrong shape",
               [&] {
                 dgps::Grads<float> g;
                 g.dq = dv(0, {2, 5, 2, 3});
                 g.da0 = dv(1, {2, 2, 3, 3});
                 dgps::backward<dgps::PGDN>(f.in(), gi(), g, ref_opt());
               },
               {"tensor 'da0'", "[2, 2, 3, 3]", "expected [2, 2, 3]"});
  expect_error(f, "backward with a bad option",
               [&] {
                 dgps::Grads<float> g;
                 g.dq = dv(0, {2, 5, 2, 3});
                 dgps::Options o = ref_opt();
                 o.eps = -1;
                 dgps::backward<dgps::PGDN>(f.in(), gi(), g, o);
               },
               {"option 'eps'"});
}

TEST_CASE("validation: decode") {
  Fix f;
  // Two sequences, one token each; a pool of three states. hT / aT of the fixture serve as the
  // pool (pre-filled with the sentinel: nothing may be written on error).
  const dgps::Shape s{.batch = 2, .time = 1, .heads = 2, .v_heads = 4, .key_dim = 3, .value_dim = 2};
  auto tokens = [&] {
    return dgps::inputs<float>(s, f.q.data(), f.k.data(), f.v.data())
        .decay(f.g.data())
        .gain(f.beta.data())
        .precond(f.g_p.data(), f.beta_p.data(), f.center.data());
  };
  auto state = [&](int64_t pool, const std::vector<int64_t>* slots) {
    dgps::DecodeState<float> st;
    f.hT.resize(static_cast<size_t>(3 * 4 * 3 * 2), kSentinel);
    f.aT.resize(static_cast<size_t>(3 * 2 * 3 * 3), kSentinel);
    st.h = MView(f.hT.data(), {pool, 4, 3, 2});
    st.a = MView(f.aT.data(), {pool, 2, 3});
    if (slots) st.slots = dgps::TensorView<const int64_t>(slots->data(), {static_cast<int64_t>(slots->size())});
    return st;
  };
  auto o = [&] { return dgps::Out<float>(f.o.data()); };
  const std::vector<int64_t> out_of_range{0, 3}, dup{1, 1}, three{0, 1, 2};  // a negative slot is padding
  expect_error(f, "slot out of range",
               [&] { dgps::decode<dgps::PGDN>(state(3, &out_of_range), tokens(), o(), ref_opt()); },
               {"slots[1] = 3", "outside the state pool [0, 3)"});
  expect_error(f, "duplicated slot", [&] { dgps::decode<dgps::PGDN>(state(3, &dup), tokens(), o(), ref_opt()); },
               {"slots", "state 1", "two sequences"});
  expect_error(f, "slots of the wrong length",
               [&] { dgps::decode<dgps::PGDN>(state(3, &three), tokens(), o(), ref_opt()); },
               {"tensor 'slots'", "[3]", "expected [2]"});
  expect_error(f, "missing h",
               [&] {
                 auto st = state(2, nullptr);
                 st.h = {};
                 dgps::decode<dgps::PGDN>(st, tokens(), o(), ref_opt());
               },
               {"tensor 'h'", "required"});
  expect_error(f, "missing a",
               [&] {
                 auto st = state(2, nullptr);
                 st.a = {};
                 dgps::decode<dgps::PGDN>(st, tokens(), o(), ref_opt());
               },
               {"tensor 'a'", "required"});
  expect_error(f, "h for the wrong number of sequences",
               [&] {
                 auto st = state(2, nullptr);
                 st.h = MView(f.hT.data(), {3, 4, 3, 2});
                 dgps::decode<dgps::PGDN>(st, tokens(), o(), ref_opt());
               },
               {"tensor 'h'", "[3, 4, 3, 2]", "expected [2, 4, 3, 2]"});
  expect_error(f, "tokens carrying h0",
               [&] {
                 auto in = tokens();
                 in.initial_state(f.h0.data());
                 dgps::decode<dgps::PGDN>(state(2, nullptr), in, o(), ref_opt());
               },
               {"DecodeState", "h0"});
  expect_error(f, "tokens with cu_seqlens past T",  // packed decode (ragged drafts, prefill) is allowed
               [&] {
                 const std::vector<int64_t> cu{0, 2};
                 auto in = tokens();
                 in.shape.batch = 1;
                 in.varlen(cu.data(), 1);
                 dgps::decode<dgps::PGDN>(state(1, nullptr), in, o(), ref_opt());
               },
               {"cu_seqlens", "end at T"});
  expect_error(
      f, "o of the wrong size",
      [&] {
        dgps::decode<dgps::PGDN>(state(2, nullptr), tokens(), dgps::Out<float>(f.mbad({2, 2, 4, 2})), ref_opt());
      },
      {"tensor 'o'", "[2, 2, 4, 2]", "expected [2, 1, 4, 2]"});
  if (!dgps::cuda_available())
    expect_error(f, "decode on cuda",
                 [&] {
                   dgps::Options opt;
                   opt.backend = dgps::Backend::cuda;
                   dgps::decode<dgps::PGDN>(state(2, nullptr), tokens(), o(), opt);
                 },
                 {"backend 'cuda'"});
}

TEST_CASE("validation: sizes whose products overflow int64 are refused before any allocation") {
  Fix f;
  constexpr int64_t big = int64_t(1) << 61;
  auto with_shape = [&](auto mutate) {
    return [&f, mutate] {
      auto in = f.in();
      in.h0 = {};
      mutate(in.shape);
      dgps::forward<dgps::PGDN>(in, dgps::outputs<float>(f.o.data()), ref_opt());
    };
  };
  // B*T*H*K = 2^64 elements: the element count itself overflows.
  expect_error(f, "T = 2^61", with_shape([](dgps::Shape& s) { s.time = big; }),
               {"tensor", "too large", "overflows int64"});
  // No tokens, yet the state [N, HV, K, V] of 2^80 elements would be formed by the kernels.
  expect_error(f, "K = V = 2^40, T = 0", with_shape([](dgps::Shape& s) {
                 s.time = 0;
                 s.key_dim = s.value_dim = int64_t(1) << 40;
               }),
               {"tensor 'h0'", "too large"});
  // Element count fits (2^61), bytes (x 4) do not.
  expect_error(f, "bytes overflow", with_shape([](dgps::Shape& s) {
                 s.batch = 1, s.time = int64_t(1) << 59, s.heads = 1, s.v_heads = 1, s.key_dim = 4, s.value_dim = 1;
               }),
               {"too large", "bytes"});
  // Strides whose largest offset overflows, on an otherwise valid shape.
  expect_error(f, "q stride overflow",
               [&] {
                 auto in = f.in();
                 in.q = View(f.junk.data(), {2, 5, 2, 3}, {std::numeric_limits<int64_t>::max() / 2, 6, 3, 1});
                 dgps::forward<dgps::PGDN>(in, f.out(), ref_opt());
               },
               {"tensor 'q'", "strides", "int64"});
  expect_error(f, "o byte offset overflow",
               [&] {
                 dgps::forward<dgps::PGDN>(
                     f.in(), dgps::outputs<float>(MView(f.o.data(), {2, 5, 4, 2}, {int64_t(1) << 61, 8, 2, 1})),
                     ref_opt());
               },
               {"tensor 'o'", "bytes beyond int64"});
  // A decode pool whose size overflows is refused before the slot table is sized from it.
  std::vector<int64_t> slots{0, 1};
  expect_error(f, "decode pool overflow",
               [&] {
                 const dgps::Shape s{.batch = 2, .time = 1, .heads = 2, .v_heads = 4, .key_dim = 3, .value_dim = 2};
                 auto tokens = dgps::inputs<float>(s, f.q.data(), f.k.data(), f.v.data())
                                   .decay(f.g.data())
                                   .gain(f.beta.data())
                                   .precond(f.g_p.data(), f.beta_p.data(), f.center.data());
                 dgps::DecodeState<float> st;
                 st.h = MView(f.hT.data(), {std::numeric_limits<int64_t>::max() / 4, 4, 3, 2});
                 st.a = MView(f.aT.data(), {2, 2, 3});
                 st.slots = dgps::TensorView<const int64_t>(slots.data(), {2});
                 dgps::decode<dgps::PGDN>(st, tokens, dgps::Out<float>(f.o.data()), ref_opt());
               },
               {"tensor 'h'", "too large"});
}

TEST_CASE("validation: Error::message_of strips the prefix once, and only from a dgps::Error's message") {
  const dgps::Error e("tensor 'q' is required");
  CHECK(std::string(e.what()) == "dgps: tensor 'q' is required");
  CHECK(dgps::Error::message_of(e) == "tensor 'q' is required");
  CHECK(dgps::Error::message_of(std::runtime_error("dgps-like but not: x")) == "dgps-like but not: x");
  CHECK(dgps::Error::message_of(dgps::Error(dgps::Error::message_of(e))) == "tensor 'q' is required");
}
