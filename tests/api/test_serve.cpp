/// @brief Serving contract (issue 37, CPU): decode through an indexed state pool, packed prefill, padding,
/// separate output slots, has-initial flags and speculative verification, each against the float64
/// reference run sequence by sequence (token by token).
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// A view of tokens [t0, t0 + n) of a packed array with dims [1, T, ...].
template <class U>
dgps::TensorView<U> tokens_of(U* base, const std::vector<int64_t>& dims, int64_t t0, int64_t n) {
  if (!base) return {};
  dgps::TensorView<U> t = dgps::view<U>(base, dims);
  t.size[1] = n;
  t.data = base + t0 * t.stride[1];
  return t;
}

/// The states of one sequence as float64: h [HV, K, V], a [H, K] / [H, K, K] (empty without one).
struct SeqState {
  std::vector<double> h, a;
};

/// The float64 reference (backend reference) over tokens [t0, t0 + len) of case `c`, starting from `s0`
/// (zeros / the default preconditioner state when null); o rows and the final states.
template <class R>
std::pair<std::vector<double>, SeqState> oracle(const Case& c, int64_t t0, int64_t len, const SeqState* s0) {
  CaseTensors<double> ct(c);
  const int64_t Tt = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim;
  dgps::Shape s = c.shape;
  s.time = len;
  auto sl = [&](const char* n) {
    return c.has(n) ? tokens_of<const double>(ct.p(n), c.shapes.at(n), t0, len) : dgps::TensorView<const double>{};
  };
  auto in = dgps::inputs<double>(s, sl("q"), sl("k"), sl("v"));
  in.decay(sl("g")).gain(sl("beta")).precond(sl("g_p"), sl("beta_p"), ct.p("center"));
  const auto adims = precond_state_dims(c.spec, 1, H, K);
  if (s0) in.initial_state(s0->h.data(), adims.empty() ? nullptr : s0->a.data());
  std::vector<double> o(static_cast<size_t>(std::max<int64_t>(1, len * HV * V)));
  SeqState fin{std::vector<double>(static_cast<size_t>(HV * K * V)),
               std::vector<double>(static_cast<size_t>(adims.empty() ? 0 : product(adims)))};
  dgps::forward<R>(in,
                   dgps::outputs<double>(o.data()).final_state(fin.h.data(), fin.a.empty() ? nullptr : fin.a.data()),
                   on(dgps::Backend::reference));
  o.resize(static_cast<size_t>(len * HV * V));
  (void)Tt;
  return {o, fin};
}

/// A pool of P random states (h and, with a preconditioner, a) of model `spec`, as type S.
template <class S>
struct Pool {
  int64_t P, hs, as;
  std::vector<S> h, a;
  std::vector<int64_t> hdims, adims;
  Pool(const dgps::ModelSpec& spec, int64_t P_, const dgps::Shape& shape, uint64_t seed) : P(P_) {
    dgps::Shape ps = shape;
    ps.batch = P;
    ps.time = 0;
    const Case pc = random_case(spec, ps, {}, seed);
    h = cast<S>(pc.arr.at("h0"));
    hdims = {P, shape.v_heads, shape.key_dim, shape.value_dim};
    hs = product(hdims) / P;
    adims = precond_state_dims(spec, P, shape.heads, shape.key_dim);
    if (!adims.empty()) a = cast<S>(pc.arr.at("a0"));
    as = adims.empty() ? 0 : product(adims) / P;
  }
  SeqState slot(int64_t i) const {
    SeqState s;
    s.h.assign(h.begin() + i * hs, h.begin() + (i + 1) * hs);
    if (as) s.a.assign(a.begin() + i * as, a.begin() + (i + 1) * as);
    return s;
  }
  template <class T>
  dgps::DecodeState<T> state() {
    dgps::DecodeState<T> st;
    st.h = tv<S>(h, hdims);
    if (as) st.a = tv<S>(a, adims);
    return st;
  }
};

double err(const std::vector<double>& x, const std::vector<double>& ref) { return ref.empty() ? 0.0 : rel_err(x, ref); }

template <class S>
std::vector<double> as_double(const std::vector<S>& v, int64_t begin, int64_t n) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + n);
}

/// The set-up both checks share: a packed batch of sequences of lengths `lens` (H = 2, HV value heads, K = 8,
/// V = 6) without initial states, a pool of P random slots and its copy before the call, the inputs, and o
/// filled with NaN.
template <class R, class T>
struct PoolCall {
  using S = dgps::state_t<T>;
  const int64_t N, HV, V = 6;
  const std::vector<int64_t> cu;
  const dgps::Shape shape;
  const Case c;
  Pool<S> pool;
  const Pool<S> before;
  const CaseTensors<T> ct;
  const dgps::Inputs<T> in;
  std::vector<T> o;
  PoolCall(const std::vector<int64_t>& lens, int64_t HV_, int64_t P, uint64_t seed)
      : N(static_cast<int64_t>(lens.size())),
        HV(HV_),
        cu(offsets(lens)),
        shape{.batch = 1, .time = cu.back(), .heads = 2, .v_heads = HV, .key_dim = 8, .value_dim = V},
        c(random_case(dgps::spec_of<R>(), shape, cu, seed, no_initial())),
        pool(c.spec, P, shape, seed + 1),
        before(pool),
        ct(c),
        in(inputs_of(ct, shape, N)),
        o(static_cast<size_t>(shape.time * HV * V), T(NAN)) {}
  static std::vector<int64_t> offsets(const std::vector<int64_t>& lens) {
    std::vector<int64_t> cu{0};
    for (int64_t l : lens) cu.push_back(cu.back() + l);
    return cu;
  }
  static Gen no_initial() {
    Gen gen;
    gen.h0 = gen.a0 = false;
    return gen;
  }
  static dgps::Inputs<T> inputs_of(const CaseTensors<T>& ct, const dgps::Shape& shape, int64_t N) {
    auto in = dgps::inputs<T>(shape, ct.p("q"), ct.p("k"), ct.p("v"));
    in.decay(ct.p("g")).gain(ct.p("beta")).precond(ct.p("g_p"), ct.p("beta_p"), ct.p("center"));
    in.varlen(ct.cu.data(), N);
    return in;
  }
  PoolCall(const PoolCall&) = delete;  // `in` points into ct
  /// Sequence n's rows of o, as doubles.
  std::vector<double> rows(int64_t n) const { return as_double(o, cu[n] * HV * V, (cu[n + 1] - cu[n]) * HV * V); }
  /// Every slot not marked in `written` holds what it held before the call.
  void check_untouched(const std::vector<char>& written) const {
    for (int64_t i = 0; i < pool.P; ++i)
      if (!written[i]) {
        INFO("slot " << i << " must be untouched");
        CHECK(std::equal(pool.h.begin() + i * pool.hs, pool.h.begin() + (i + 1) * pool.hs,
                         before.h.begin() + i * pool.hs));
        CHECK(std::equal(pool.a.begin() + i * pool.as, pool.a.begin() + (i + 1) * pool.as,
                         before.a.begin() + i * pool.as));
      }
  }
};

/// Packed prefill / decode through the pool: sequences of lengths `lens`, start slots `slots` (negative:
/// padding), optional `out_slots` and `has_initial`. Checks o, the written slots and that every other
/// slot is untouched, against the reference run per sequence. Metric max|x - ref| / max|ref|.
template <class R, class T>
void check_pool(const std::vector<int64_t>& lens, const std::vector<int64_t>& slots, const std::vector<int64_t>& outs,
                const std::vector<uint8_t>& init, int64_t P, dgps::Options opt, double tol, uint64_t seed) {
  PoolCall<R, T> x(lens, 4, P, seed);
  const int64_t N = x.N;
  auto& pool = x.pool;
  auto st = pool.template state<T>();
  st.slots = dgps::view(slots.data(), {N});
  if (!outs.empty()) st.out_slots = dgps::view(outs.data(), {N});
  if (!init.empty()) st.has_initial = dgps::view(init.data(), {N});
  dgps::decode<R>(st, x.in, x.o.data(), opt);

  std::vector<char> written(static_cast<size_t>(P), 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t si = slots[n], so = outs.empty() ? si : outs[n];
    const auto got = x.rows(n);
    INFO("sequence " << n << " slot " << si << " -> " << so << ", " << lens[n] << " tokens");
    if (si < 0 || so < 0) {
      CHECK(max_abs(got) == 0.0);
      continue;
    }
    const SeqState s0 = x.before.slot(si);
    const bool start = init.empty() || init[n];
    const auto [ro, rs] = oracle<R>(x.c, x.cu[n], lens[n], start ? &s0 : nullptr);
    CHECK(err(got, ro) < tol);
    CHECK(err(as_double(pool.h, so * pool.hs, pool.hs), rs.h) < tol);
    if (pool.as) CHECK(err(as_double(pool.a, so * pool.as, pool.as), rs.a) < tol);
    written[so] = 1;
  }
  x.check_untouched(written);
}

/// Speculative verification: sequence n has lens[n] tokens, the slot table `ts` [N, D], `acc` [N].
/// Expected: the start state is the slot of token acc[n] - 1 (before the call), o and the state after
/// every token t equal the reference over tokens [0, t], written to ts[n, t] (skipped when negative).
template <class R, class T>
void check_verify(const std::vector<int64_t>& lens, const std::vector<int64_t>& ts, int64_t D,
                  const std::vector<int64_t>& acc, int64_t P, dgps::Options opt, double tol, uint64_t seed) {
  PoolCall<R, T> x(lens, 2, P, seed);
  const int64_t N = x.N;
  auto& pool = x.pool;
  auto st = pool.template state<T>();
  st.token_slots = dgps::view(ts.data(), {N, D});
  st.num_accepted = dgps::view(acc.data(), {N});
  dgps::decode<R>(st, x.in, x.o.data(), opt);

  std::vector<char> written(static_cast<size_t>(P), 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t start = ts[n * D + acc[n] - 1];
    INFO("sequence " << n << " start slot " << start << ", " << lens[n] << " tokens");
    const auto got = x.rows(n);
    if (start < 0) {
      CHECK(max_abs(got) == 0.0);
      continue;
    }
    const SeqState s0 = x.before.slot(start);
    const auto [ro, rs] = oracle<R>(x.c, x.cu[n], lens[n], &s0);
    CHECK(err(got, ro) < tol);
    for (int64_t t = 0; t < lens[n]; ++t) {
      const int64_t slot = ts[n * D + t];
      if (slot < 0) continue;
      const auto [po, ps] = oracle<R>(x.c, x.cu[n], t + 1, &s0);  // the accepted prefix, token by token
      INFO("token " << t << " -> slot " << slot);
      CHECK(err(as_double(pool.h, slot * pool.hs, pool.hs), ps.h) < tol);
      if (pool.as) CHECK(err(as_double(pool.a, slot * pool.as, pool.as), ps.a) < tol);
      written[slot] = 1;
    }
  }
  x.check_untouched(written);
}

dgps::Options with(dgps::Backend b, dgps::Algorithm a, int threads = 1) {
  dgps::Options o = on(b, threads);
  o.algorithm = a;
  return o;
}

/// Every path of one model: the reference, the CPU decode kernel, the CPU chunkwise kernels (where the
/// model has them), float64 (tolerance 1e-10) and float32 (1e-4, SPEC §5), 1 and 2 threads.
template <class R>
void pool_cases(uint64_t seed) {
  using A = dgps::Algorithm;
  using B = dgps::Backend;
  const std::vector<int64_t> lens{5, 3, 23, 0, 9, 1};
  const std::vector<int64_t> slots{4, -1, 1, 2, 6, 3};  // sequence 1 is padding
  const std::vector<uint8_t> init{1, 1, 0, 1, 1, 1};    // sequence 2 starts from zero
  const std::vector<int64_t> outs{0, 5, 1, 7, 8, -1};   // separate slots; 2 in place; 5 padding by its out slot
  std::vector<dgps::Options> opts{with(B::reference, A::automatic), with(B::cpu, A::recurrent),
                                  with(B::cpu, A::automatic, 2)};
  if (dgps::supports<R>(B::cpu, A::chunkwise)) opts.push_back(with(B::cpu, A::chunkwise, 2));
  for (const auto& opt : opts) {
    INFO("backend " << dgps::to_string(opt.backend) << ", algorithm " << dgps::to_string(opt.algorithm));
    check_pool<R, double>(lens, slots, {}, {}, 8, opt, 1e-10, seed);
    check_pool<R, double>(lens, slots, outs, init, 9, opt, 1e-10, seed + 2);
    check_pool<R, float>(lens, slots, {}, init, 8, opt, 1e-4, seed + 4);
    check_pool<R, float>(lens, slots, outs, {}, 9, opt, 1e-4, seed + 6);
  }
  // Ragged verification, D = 4 columns: drafts of 4, 2, 3 and 1 tokens; sequence 3 is padding
  // (its start slot is negative); token 1 of sequence 2 keeps no state (slot -1). The start slot of
  // sequences 0 and 2 is overwritten by the state after their token acc - 1 (aliasing).
  const std::vector<int64_t> vlens{4, 2, 3, 1};
  const std::vector<int64_t> ts{0, 1, 2, 3, /**/ 4, 5, -1, -1, /**/ 6, -1, 7, -1, /**/ -1, 8, -1, -1};
  const std::vector<int64_t> acc{2, 2, 3, 1};
  for (const auto& opt :
       {with(B::reference, A::automatic), with(B::cpu, A::automatic), with(B::cpu, A::recurrent, 2)}) {
    INFO("verification, backend " << dgps::to_string(opt.backend));
    check_verify<R, double>(vlens, ts, 4, acc, 10, opt, 1e-10, seed + 8);
    check_verify<R, float>(vlens, ts, 4, acc, 10, opt, 1e-4, seed + 9);
  }
}

/// The states [P, HV, K, V] of `h` as [P, HV, V, K] (K-last), or back with K and V exchanged.
template <class S>
std::vector<S> swap_last(const std::vector<S>& h, int64_t P, int64_t HV, int64_t K, int64_t V) {
  std::vector<S> t(h.size());
  for (int64_t i = 0; i < P * HV; ++i)
    for (int64_t c = 0; c < K; ++c)
      for (int64_t e = 0; e < V; ++e) t[size_t((i * V + e) * K + c)] = h[size_t((i * K + c) * V + e)];
  return t;
}

/// The same pooled call with the pool K-major and K-last (DecodeState::layout). The reference (which reads the
/// strided view) and the CPU chunkwise kernels (which copy the states in and out once) give the K-major results
/// bit for bit; the CPU decode kernel's K-last row sweep sums the same products in another order: within
/// max|x - y| / max|y| < 1e-13 (float64), 2e-6 (float32; SPEC §5's float accumulation) and 8e-3 (bfloat16 o,
/// two roundings apart at most). `verify`: speculative verification (token_slots) instead of slots / out_slots.
template <class R, class T>
void check_k_last(const std::vector<int64_t>& lens, bool verify, dgps::Options opt, uint64_t seed) {
  const int64_t P = 10, D = 4;
  const std::vector<int64_t> slots{7, -1, 2, 5}, outs{7, 4, 3, 5};
  const std::vector<int64_t> ts{0, 1, 2, -1, /**/ 6, 8, -1, -1, /**/ -1, 3, 9, -1, /**/ 4, -1, -1, -1};
  const std::vector<int64_t> acc{1, 2, 2, 1};  // sequence 2 starts from slot 3
  std::vector<std::vector<T>> o(2);
  std::vector<std::vector<dgps::state_t<T>>> h(2), a(2);
  dgps::RunInfo info;
  for (int k_last = 0; k_last < 2; ++k_last) {
    PoolCall<R, T> x(lens, 4, P, seed);
    auto& pool = x.pool;
    const int64_t HV = x.HV, K = x.shape.key_dim, V = x.V, N = x.N;
    auto st = pool.template state<T>();
    if (k_last) {
      pool.h = swap_last(pool.h, P, HV, K, V);
      st.h = dgps::view(pool.h.data(), {P, HV, V, K});
      st.layout = dgps::StateLayout::k_last;
    }
    if (verify) {
      st.token_slots = dgps::view(ts.data(), {N, D});
      st.num_accepted = dgps::view(acc.data(), {N});
    } else {
      st.slots = dgps::view(slots.data(), {N});
      st.out_slots = dgps::view(outs.data(), {N});
    }
    info = dgps::decode<R>(st, x.in, x.o.data(), opt);
    o[k_last] = x.o;
    h[k_last] = k_last ? swap_last(pool.h, P, HV, V, K) : pool.h;
    a[k_last] = pool.a;
    if (!k_last) CHECK(pool.h != x.before.h);  // the call wrote states
  }
  INFO("ran " << info.impl);
  if (info.backend == dgps::Backend::reference || info.algorithm == dgps::Algorithm::chunkwise) {
    CHECK(std::memcmp(o[0].data(), o[1].data(), o[0].size() * sizeof(T)) == 0);  // NaN-free: o is all written
    CHECK(h[0] == h[1]);
  } else {
    auto dbl = [](const auto& v) {
      std::vector<double> d;
      for (const auto& x : v) d.push_back(double(x));
      return d;
    };
    const double tol = std::is_same_v<T, double> ? 1e-13 : std::is_same_v<T, float> ? 2e-6 : 8e-3;
    CHECK(err(dbl(o[1]), dbl(o[0])) < tol);
    CHECK(err(dbl(h[1]), dbl(h[0])) < (std::is_same_v<T, double> ? 1e-13 : 2e-6));
  }
  CHECK(a[0] == a[1]);
}

template <class R>
void k_last_cases(uint64_t seed) {
  using A = dgps::Algorithm;
  using B = dgps::Backend;
  const std::vector<int64_t> lens{3, 1, 21, 2};  // 21 > kDecodeMaxTokens: automatic runs it chunkwise
  std::vector<dgps::Options> opts{with(B::reference, A::automatic), with(B::cpu, A::recurrent),
                                  with(B::cpu, A::automatic, 2)};
  if (dgps::supports<R>(B::cpu, A::chunkwise)) opts.push_back(with(B::cpu, A::chunkwise, 2));
  for (const auto& opt : opts) {
    INFO("backend " << dgps::to_string(opt.backend) << ", algorithm " << dgps::to_string(opt.algorithm));
    check_k_last<R, double>(lens, false, opt, seed);
    check_k_last<R, float>(lens, false, opt, seed + 1);
    check_k_last<R, dgps::bf16>(lens, false, opt, seed + 2);
    if (opt.algorithm != A::chunkwise) check_k_last<R, float>({3, 2, 2, 1}, true, opt, seed + 3);
  }
}

}  // namespace

TEST_CASE("serve: K-last state pools (DecodeState::layout) give the K-major results bit for bit") {
  k_last_cases<dgps::GDN>(3771);
  k_last_cases<dgps::KDA>(3772);
  k_last_cases<dgps::PGDN>(3773);
  k_last_cases<dgps::MesaLayer>(3774);
}

TEST_CASE("serve: a K-last pool of the wrong shape is refused naming the layout, nothing written") {
  using R = dgps::GDN;
  PoolCall<R, float> x({2, 1}, 4, 3, 3775);
  auto st = x.pool.template state<float>();
  st.layout = dgps::StateLayout::k_last;  // h is still [P, HV, K, V] with K = 8 != V = 6
  const std::vector<int64_t> slots{0, 2};
  st.slots = dgps::view(slots.data(), {2});
  CHECK_THROWS_WITH_AS(dgps::decode<R>(st, x.in, x.o.data(), on(dgps::Backend::cpu)),
                       doctest::Contains("K-last: [P, HV, V, K]"), dgps::Error);
  CHECK(x.pool.h == x.before.h);
}

TEST_CASE("serve: the K-last refusal carries the shape message once, with one prefix") {
  using R = dgps::GDN;
  PoolCall<R, float> x({2, 1}, 4, 3, 3776);
  auto st = x.pool.template state<float>();
  st.layout = dgps::StateLayout::k_last;
  try {
    dgps::decode<R>(st, x.in, x.o.data(), on(dgps::Backend::cpu));
    FAIL("a K-last pool of K-major shape was accepted");
  } catch (const dgps::Error& e) {
    const std::string w = e.what();
    CHECK(w.rfind("dgps: tensor 'h' has shape ", 0) == 0);
    CHECK(w.find("dgps: ", 1) == std::string::npos);
  }
}

TEST_CASE("serve: state pool and verification, GDN") { pool_cases<dgps::GDN>(3701); }
TEST_CASE("serve: state pool and verification, KDA") { pool_cases<dgps::KDA>(3711); }
TEST_CASE("serve: state pool and verification, PGDN") { pool_cases<dgps::PGDN>(3721); }
TEST_CASE("serve: state pool and verification, Mesa layer (exact preconditioner)") {
  pool_cases<dgps::MesaLayer>(3731);
}

TEST_CASE("serve: fixed-length decode with slots, out_slots aliasing and bfloat16") {
  // B = 3 sequences of 2 tokens; sequence 0 in place, 1 to a new slot, 2 padding.
  using R = dgps::PGDN;
  const int64_t N = 3, Tn = 2, H = 2, HV = 2, K = 8, V = 6, P = 4;
  const dgps::Shape shape{.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  Gen gen;
  gen.h0 = gen.a0 = false;
  const Case c = random_case(dgps::spec_of<R>(), shape, {}, 3741, gen);
  Pool<float> pool(c.spec, P, shape, 3742);
  const Pool<float> before = pool;
  CaseTensors<dgps::bf16> ct(c);
  auto in = dgps::inputs<dgps::bf16>(shape, ct.p("q"), ct.p("k"), ct.p("v"));
  in.decay(ct.p("g")).gain(ct.p("beta")).precond(ct.p("g_p"), ct.p("beta_p"), ct.p("center"));
  const std::vector<int64_t> slots{2, 0, -1}, outs{2, 3, 1};
  std::vector<dgps::bf16> o(static_cast<size_t>(N * Tn * HV * V), dgps::bf16(1.0f));
  auto st = pool.state<dgps::bf16>();
  st.slots = dgps::view(slots.data(), {N});
  st.out_slots = dgps::view(outs.data(), {N});
  dgps::decode<R>(st, in, o.data(), on(dgps::Backend::cpu));
  // The oracle reads the bf16-rounded inputs in float64; bf16 outputs: tolerance 2e-2 (SPEC §5).
  Case cr = c;
  cr.cu.clear();
  for (auto& [name, v] : cr.arr)
    for (double& x : v) x = double(float(dgps::bf16(x)));
  for (int64_t n = 0; n < 2; ++n) {
    Case one = cr;
    one.shape.batch = 1;
    for (const char* name : {"q", "k", "v", "g", "beta", "g_p", "beta_p"}) {
      auto& v = one.arr.at(name);
      const int64_t per = static_cast<int64_t>(v.size()) / N;
      v = std::vector<double>(v.begin() + n * per, v.begin() + (n + 1) * per);
      one.shapes.at(name)[0] = 1;
    }
    const SeqState s0 = before.slot(slots[n]);
    const auto [ro, rs] = oracle<R>(one, 0, Tn, &s0);
    std::vector<double> got;
    for (int64_t i = 0; i < Tn * HV * V; ++i) got.push_back(double(float(o[n * Tn * HV * V + i])));
    CHECK(err(got, ro) < 2e-2);
    CHECK(err(as_double(pool.h, outs[n] * pool.hs, pool.hs), rs.h) < 1e-4);
    CHECK(err(as_double(pool.a, outs[n] * pool.as, pool.as), rs.a) < 1e-4);
  }
  for (int64_t i = 2 * Tn * HV * V; i < N * Tn * HV * V; ++i) CHECK(float(o[i]) == 0.0f);
  CHECK(std::equal(pool.h.begin() + pool.hs, pool.h.begin() + 2 * pool.hs, before.h.begin() + pool.hs));  // slot 1
}

TEST_CASE("serve: scattered slots on two threads give the one-thread results bit for bit") {
  // The decode runs the sequences in the order of their slots (dispatch.cpp); large enough (K = V = 64)
  // to run on two threads. Slots descending and scattered, one padding sequence, one writing elsewhere.
  using R = dgps::PGDN;
  const int64_t N = 6, H = 2, HV = 4, K = 64, V = 64, P = 9;
  const dgps::Shape shape{.batch = N, .time = 1, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  Gen gen;
  gen.h0 = gen.a0 = false;
  const Case c = random_case(dgps::spec_of<R>(), shape, {}, 3761, gen);
  CaseTensors<float> ct(c);
  auto in = dgps::inputs<float>(shape, ct.p("q"), ct.p("k"), ct.p("v"));
  in.decay(ct.p("g")).gain(ct.p("beta")).precond(ct.p("g_p"), ct.p("beta_p"), ct.p("center"));
  const std::vector<int64_t> slots{8, 2, 7, -1, 0, 5}, outs{8, 2, 1, -1, 0, 5};
  std::vector<std::vector<float>> o(2), h(2), a(2);
  for (int threads : {1, 2}) {
    Pool<float> pool(c.spec, P, shape, 3762);
    std::vector<float> out(static_cast<size_t>(N * HV * V), 1.0f);
    auto st = pool.state<float>();
    st.slots = dgps::view(slots.data(), {N});
    st.out_slots = dgps::view(outs.data(), {N});
    dgps::decode<R>(st, in, out.data(), on(dgps::Backend::cpu, threads));
    o[threads - 1] = out, h[threads - 1] = pool.h, a[threads - 1] = pool.a;
  }
  CHECK(o[0] == o[1]);
  CHECK(h[0] == h[1]);
  CHECK(a[0] == a[1]);
  const Pool<float> before(c.spec, P, shape, 3762);
  CHECK(h[0] != before.h);
}

TEST_CASE("serve: validation names the tensor and writes nothing") {
  using R = dgps::PGDN;
  const int64_t N = 2, H = 1, K = 4, V = 3, P = 3;
  const dgps::Shape shape{.batch = N, .time = 1, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  const Case c = random_case(dgps::spec_of<R>(), shape, {}, 3751);
  Pool<float> pool(c.spec, P, shape, 3752);
  const Pool<float> before = pool;
  CaseTensors<float> ct(c);
  auto in = dgps::inputs<float>(shape, ct.p("q"), ct.p("k"), ct.p("v"));
  in.decay(ct.p("g")).gain(ct.p("beta")).precond(ct.p("g_p"), ct.p("beta_p"), ct.p("center"));
  std::vector<float> o(static_cast<size_t>(N * V), 5.0f);
  auto fails = [&](const char* what, auto&& setup, std::vector<std::string> parts) {
    auto st = pool.state<float>();
    std::vector<int64_t> keep[4];
    setup(st, keep);
    INFO(what);
    std::string msg;
    try {
      dgps::decode<R>(st, in, o.data(), on(dgps::Backend::cpu));
    } catch (const dgps::Error& e) {
      msg = e.what();
    }
    INFO("message: " << msg);
    CHECK(!msg.empty());
    for (const auto& s : parts) CHECK(msg.find(s) != std::string::npos);
    CHECK(pool.h == before.h);
    CHECK(pool.a == before.a);
    CHECK(std::all_of(o.begin(), o.end(), [](float x) { return x == 5.0f; }));
  };
  using St = dgps::DecodeState<float>;
  using Keep = std::vector<int64_t>*;
  fails("slot out of range",
        [](St& st, Keep k) {
          k[0] = {0, 3};
          st.slots = dgps::view(k[0].data(), {2});
        },
        {"slots[1] = 3", "outside the state pool [0, 3)"});
  fails("out slot out of range",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {7, 2};
          st.slots = dgps::view(k[0].data(), {2});
          st.out_slots = dgps::view(k[1].data(), {2});
        },
        {"out_slots[0] = 7", "[0, 3)"});
  fails("two writers",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {2, 2};
          st.slots = dgps::view(k[0].data(), {2});
          st.out_slots = dgps::view(k[1].data(), {2});
        },
        {"state 2", "written by two sequences"});
  fails("read while another writes",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {1, 2};
          st.slots = dgps::view(k[0].data(), {2});
          st.out_slots = dgps::view(k[1].data(), {2});
        },
        {"state 1", "read by sequence 1", "written by sequence 0"});
  fails("wrong shape",
        [](St& st, Keep k) {
          k[0] = {0, 1, 2};
          st.slots = dgps::view(k[0].data(), {3});
        },
        {"tensor 'slots'", "[3]", "expected [2]"});
  fails("out_slots wrong shape",
        [](St& st, Keep k) {
          k[0] = {0};
          st.out_slots = dgps::view(k[0].data(), {1});
        },
        {"tensor 'out_slots'", "[1]", "expected [2]"});
  fails("num_accepted without token_slots",
        [](St& st, Keep k) {
          k[0] = {1, 1};
          st.num_accepted = dgps::view(k[0].data(), {2});
        },
        {"num_accepted", "token_slots"});
  fails("num_accepted out of range",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {1, 2};
          st.token_slots = dgps::view(k[0].data(), {2, 1});
          st.num_accepted = dgps::view(k[1].data(), {2});
        },
        {"num_accepted[1] = 2", "[1, 1]"});
  fails("token_slots wrong rank",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {1, 1};
          st.token_slots = dgps::view(k[0].data(), {2});
          st.num_accepted = dgps::view(k[1].data(), {2});
        },
        {"tensor 'token_slots'", "expected [2, D]"});
  fails("token_slots with slots",
        [](St& st, Keep k) {
          k[0] = {0, 1}, k[1] = {1, 1};
          st.token_slots = dgps::view(k[0].data(), {2, 1});
          st.num_accepted = dgps::view(k[1].data(), {2});
          st.slots = dgps::view(k[0].data(), {2});
        },
        {"token_slots", "must not be given"});
  fails("h of the wrong state shape",
        [](St& st, Keep k) {
          k[0] = {0, 1};
          st.slots = dgps::view(k[0].data(), {2});
          st.h.size[2] = 5;
        },
        {"tensor 'h'", "expected [3, 1, 4, 3]"});
}
