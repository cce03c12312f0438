/// @brief decode == forward: prefill + decode 1, 2 and 4 tokens at a time, GVA, a slot-indexed state pool.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

/// A view of the time range [t0, t0 + n) of a contiguous array with dims [B, T, ...] (strided in B).
template <class U>
dgps::TensorView<U> time_slice(U* base, const std::vector<int64_t>& dims, int64_t t0, int64_t n) {
  dgps::TensorView<U> t = dgps::view<U>(base, dims);
  t.size[1] = n;
  t.data = base ? base + t0 * t.stride[1] : nullptr;
  if (!base) t.rank = 0;
  return t;
}

/// Inputs of the token range [t0, t0 + n) of case `c`, as strided views into its arrays.
template <class T>
dgps::Inputs<T> token_inputs(const Case& c, const CaseTensors<T>& ct, int64_t t0, int64_t n) {
  dgps::Shape s = c.shape;
  s.time = n;
  auto dims = [&](const char* name) { return c.has(name) ? c.shapes.at(name) : std::vector<int64_t>{}; };
  auto sl = [&](const char* name) { return time_slice<const T>(ct.p(name), dims(name), t0, n); };
  auto in = dgps::inputs<T>(s, sl("q"), sl("k"), sl("v"));
  in.decay(sl("g")).gain(sl("beta")).precond(sl("g_p"), sl("beta_p"), ct.p("center"));
  return in;
}

/// Prefill (forward over the first T0 tokens), then decode the rest in steps of 1, 2, 4, ... tokens;
/// compare every output and the final states with one forward over all tokens.
template <class R, class T>
void check_decode(const char* label, dgps::Backend backend, bool use_slots, uint64_t seed, double tol) {
  using S = dgps::state_t<T>;
  const int64_t N = 3, Tt = 16, T0 = 5, H = 2, HV = 4, K = 6, V = 5;
  const dgps::Shape shape{.batch = N, .time = Tt, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  const Case c = random_case(dgps::spec_of<R>(), shape, {}, seed);
  const dgps::Options opt = on(backend);
  const Arrays full = run_forward<T, R>(c, opt);

  CaseTensors<T> ct(c);
  const auto adims = precond_state_dims(c.spec, N, H, K);
  const bool has_a = !adims.empty();
  const int64_t a_per = has_a ? product(adims) / N : 0, h_per = HV * K * V;
  // State pool: with slots, P = 5 states and sequence n lives in slot slots[n]; others untouched.
  const std::vector<int64_t> slots{3, 0, 4};
  const int64_t P = use_slots ? 5 : N;
  auto slot = [&](int64_t n) { return use_slots ? slots[n] : n; };
  const S sentinel = S(7.25);
  std::vector<S> hpool(static_cast<size_t>(P * h_per), sentinel), apool(static_cast<size_t>(P * a_per), sentinel);

  // Prefill.
  std::vector<T> o(static_cast<size_t>(N * Tt * HV * V), T(NAN));
  std::vector<S> hT(static_cast<size_t>(N * h_per)), aT(static_cast<size_t>(N * a_per));
  {
    auto in = token_inputs<T>(c, ct, 0, T0);
    in.initial_state(ct.ps("h0"), ct.ps("a0"));
    auto out = dgps::outputs<T>(time_slice<T>(o.data(), {N, Tt, HV, V}, 0, T0))
                   .final_state(hT.data(), has_a ? aT.data() : nullptr);
    dgps::forward<R>(in, out, opt);
  }
  for (int64_t n = 0; n < N; ++n) {
    std::copy(hT.begin() + n * h_per, hT.begin() + (n + 1) * h_per, hpool.begin() + slot(n) * h_per);
    std::copy(aT.begin() + n * a_per, aT.begin() + (n + 1) * a_per, apool.begin() + slot(n) * a_per);
  }
  dgps::DecodeState<T> st;
  st.h = tv<S>(hpool, {P, HV, K, V});
  if (has_a) {
    auto pd = adims;
    pd[0] = P;
    st.a = tv<S>(apool, pd);
  }
  if (use_slots) st.slots = dgps::TensorView<const int64_t>(slots.data(), {N});

  // Decode in steps of 1, 2, 4 tokens (then again), ending exactly at Tt.
  int64_t t = T0;
  for (int64_t step : {1, 2, 4, 1, 2, 1}) {
    const auto info =
        dgps::decode<R>(st, token_inputs<T>(c, ct, t, step), time_slice<T>(o.data(), {N, Tt, HV, V}, t, step), opt);
    CHECK(info.backend == backend);
    t += step;
  }
  REQUIRE(t == Tt);

  const std::vector<double> od(o.begin(), o.end());
  std::vector<double> hd(static_cast<size_t>(N * h_per)), ad(static_cast<size_t>(N * a_per));
  for (int64_t n = 0; n < N; ++n) {
    std::copy(hpool.begin() + slot(n) * h_per, hpool.begin() + (slot(n) + 1) * h_per, hd.begin() + n * h_per);
    std::copy(apool.begin() + slot(n) * a_per, apool.begin() + (slot(n) + 1) * a_per, ad.begin() + n * a_per);
  }
  INFO(label << (use_slots ? " (slots)" : "") << ": o err " << rel_err(od, full.at("o")) << ", h err "
             << rel_err(hd, full.at("hT")) << (has_a ? ", a err " : "") << (has_a ? rel_err(ad, full.at("aT")) : 0.0));
  CHECK(rel_err(od, full.at("o")) < tol);
  CHECK(rel_err(hd, full.at("hT")) < tol);
  if (has_a) CHECK(rel_err(ad, full.at("aT")) < tol);
  if (use_slots) {
    bool untouched = true;
    for (int64_t p : {1, 2}) {
      for (int64_t i = 0; i < h_per; ++i) untouched = untouched && hpool[p * h_per + i] == sentinel;
      for (int64_t i = 0; i < a_per; ++i) untouched = untouched && apool[p * a_per + i] == sentinel;
    }
    CHECK(untouched);
  }
}

template <class R>
void check_model(const char* label, uint64_t seed) {
  // Metric max|decode - forward| / max|forward|; float64 1e-12, float32 1e-5.
  for (bool slots : {false, true}) {
    check_decode<R, double>(label, dgps::Backend::reference, slots, seed, 1e-12);
    check_decode<R, double>(label, dgps::Backend::cpu, slots, seed, 1e-12);
    check_decode<R, float>(label, dgps::Backend::cpu, slots, seed, 1e-5);
  }
}

}  // namespace

TEST_CASE("decode == forward: GDN") { check_model<dgps::GDN>("gdn", 501); }
TEST_CASE("decode == forward: PGDN") { check_model<dgps::PGDN>("pgdn", 502); }
TEST_CASE("decode == forward: PKDA") { check_model<dgps::PKDA>("pkda", 503); }
TEST_CASE("decode == forward: Mamba-2") { check_model<dgps::Mamba2>("mamba2", 504); }
TEST_CASE("decode == forward: Mesa layer") { check_model<dgps::MesaLayer>("mesa", 505); }
TEST_CASE("decode == forward: ridge readout") { check_model<dgps::RidgeReadout>("ridge", 506); }
