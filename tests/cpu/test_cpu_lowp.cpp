/// @brief bf16 / f16 inputs and outputs on the CPU (float32 compute and states): conversions, forward, decode,
/// backward.
///
/// Tolerances against the float64 reference run on the same (rounded) inputs, max|diff| / max|ref|:
/// 2e-2 for bf16 and 5e-3 for f16 (the outputs themselves are rounded to 8 or 11 significant bits).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

// ---------------------------------------------------------------------------------------------
// Conversions against a reference built from the formats' definitions (in double).

/// Exact value of a bit pattern: bf16 (8 exponent, 7 mantissa bits) or f16 (5, 10); NaN for NaNs.
double value_of(uint16_t b, bool is_f16) {
  const int eb = is_f16 ? 5 : 8, mb = is_f16 ? 10 : 7, bias = (1 << (eb - 1)) - 1;
  const int e = (b >> mb) & ((1 << eb) - 1), m = b & ((1 << mb) - 1);
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << eb) - 1) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(double(m), 1 - bias - mb);
  return sign * std::ldexp(double((1 << mb) + m), e - bias - mb);
}

/// Largest finite positive bit pattern: 0x7f7f (bf16), 0x7bff (f16). Patterns 0..max increase in value.
uint16_t max_bits(bool is_f16) { return is_f16 ? 0x7bff : 0x7f7f; }

/// Round-to-nearest-even of x by search over the format's values (the reference rounding).
uint16_t ref_round(double x, bool is_f16) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0, inf = is_f16 ? 0x7c00 : 0x7f80, mx = max_bits(is_f16);
  const double a = std::fabs(x);
  const double vmax = value_of(mx, is_f16), half_ulp = (vmax - value_of(uint16_t(mx - 1), is_f16)) / 2;
  if (a >= vmax + half_ulp) return sign | inf;  // the tie goes to infinity: max has an odd mantissa
  uint16_t lo = 0, hi = mx;                     // value(lo) <= a < value(hi) after the search
  if (a >= vmax) return sign | mx;
  while (hi - lo > 1) {
    const uint16_t mid = uint16_t((lo + hi) / 2);
    (value_of(mid, is_f16) <= a ? lo : hi) = mid;
  }
  const double dl = a - value_of(lo, is_f16), dh = value_of(hi, is_f16) - a;
  const uint16_t r = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | r;
}

template <class H>
void check_conversions(bool is_f16) {
  const char* name = is_f16 ? "f16" : "bf16";
  // Every bit pattern: exact widening, and narrowing back gives the same pattern (NaN stays NaN).
  int bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const H h = H::from_bits(uint16_t(b));
    const double ref = value_of(uint16_t(b), is_f16);
    const float f = float(h);
    if (std::isnan(ref)) {
      bad += !std::isnan(f) || !std::isnan(double(h)) || !std::isnan(float(H(f)));
    } else {
      bad += double(f) != ref || double(h) != ref || H(f).bits != b || H(double(f)).bits != b;
    }
  }
  CHECK_MESSAGE(bad == 0, std::string(name), ": patterns that do not round-trip: ", bad);
  // Rounding: each value, each midpoint between neighbours and the floats and doubles just around it.
  bad = 0;
  const uint16_t mx = max_bits(is_f16);
  for (uint32_t b = 0; b < mx; ++b) {
    const double lo = value_of(uint16_t(b), is_f16), hi = value_of(uint16_t(b + 1), is_f16);
    const double mid = (lo + hi) / 2;  // exact in float (one more bit than the format)
    const float mf = float(mid);
    for (double s : {1.0, -1.0}) {
      for (float x : {float(lo), mf, std::nextafter(mf, 0.0f), std::nextafter(mf, INFINITY)})
        bad += H(float(s) * x).bits != ref_round(double(s * x), is_f16);
      // Just around the midpoint, closer than float resolution: a double must not round twice.
      for (double x : {mid, mid * (1 + 0x1p-40), mid * (1 - 0x1p-40)}) bad += H(s * x).bits != ref_round(s * x, is_f16);
    }
  }
  // Overflow: the midpoint above the largest finite value rounds to infinity, anything below to max.
  const double vmax = value_of(mx, is_f16), over = vmax + (vmax - value_of(uint16_t(mx - 1), is_f16)) / 2;
  const uint16_t inf = is_f16 ? 0x7c00 : 0x7f80;
  bad += H(float(over)).bits != inf || H(std::nextafter(float(over), 0.0f)).bits != mx;
  bad += H(-over).bits != (inf | 0x8000) || H(over * (1 - 0x1p-40)).bits != mx || H(1e300).bits != inf;
  bad += H(INFINITY).bits != inf || H(-INFINITY).bits != (inf | 0x8000) || !std::isnan(float(H(NAN)));
  bad += H(0.0f).bits != 0 || H(-0.0f).bits != 0x8000 || H(1e-300).bits != 0;
  CHECK_MESSAGE(bad == 0, std::string(name), ": wrongly rounded values: ", bad);
}

TEST_CASE("bf16 and f16 conversions: every bit pattern, every midpoint, overflow, NaN") {
  check_conversions<dgps::bf16>(false);
  check_conversions<dgps::f16>(true);
  static_assert(sizeof(dgps::bf16) == 2 && sizeof(dgps::f16) == 2);
  static_assert(std::is_trivial_v<dgps::bf16> && std::is_trivial_v<dgps::f16>);
  static_assert(dgps::bf16(1.0f).bits == 0x3f80 && dgps::f16(1.0f).bits == 0x3c00);
  static_assert(std::is_same_v<dgps::state_t<dgps::bf16>, float> && std::is_same_v<dgps::state_t<dgps::f16>, float>);
}

// ---------------------------------------------------------------------------------------------
// Kernels: the bf16/f16 path computes exactly what the float path computes on the converted
// inputs; its only extra step is the rounding of o at store, checked bit for bit here.

/// Linear attention with one-hot keys and queries, no L2 norm, decay exp(-1000) = 0: o_t = scale v_t
/// exactly in float, so the kernel's stored o must be exactly H(scale * v). v runs over every finite
/// pattern of the format.
template <class H, class R = dgps::Mamba2>
void check_store_rounding(bool is_f16, bool use_decode, float scale) {
  const int64_t T = 256, V = 256, K = 16;
  std::vector<H> q(T * K, H(0.0f)), k(T * K, H(0.0f)), v(T * V, H(0.0f)), g(T, H(-1000.0f)), beta(T, H(1.0f));
  for (int64_t t = 0; t < T; ++t) q[t * K] = k[t * K] = H(1.0f);
  int64_t n = 0;
  for (uint32_t b = 0; b < 65536 && n < T * V; ++b)
    if ((b & 0x7fff) <= max_bits(is_f16)) v[n++] = H::from_bits(uint16_t(b));
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  opt.l2norm_qk = false;
  opt.scale = scale;
  opt.threads = 2;
  std::vector<H> o(T * V, H::from_bits(0x7fff));
  if (!use_decode) {
    const dgps::Shape s{.batch = 1, .time = T, .heads = 1, .v_heads = 1, .key_dim = K, .value_dim = V};
    auto in = dgps::inputs<H>(s, q.data(), k.data(), v.data()).decay(g.data()).gain(beta.data());
    const auto info = dgps::forward<R>(in, dgps::outputs<H>(o.data()), opt);
    CHECK(info.impl.rfind("cpu/chunkwise", 0) == 0);
  } else {
    std::vector<float> h(K * V, 0.0f);
    dgps::DecodeState<H> st;
    st.h = dgps::TensorView<float>(h.data(), {1, 1, K, V});
    const int64_t step = 64;  // tokens per decode call
    for (int64_t t0 = 0; t0 < T; t0 += step) {
      const dgps::Shape s{.batch = 1, .time = step, .heads = 1, .v_heads = 1, .key_dim = K, .value_dim = V};
      auto in = dgps::inputs<H>(s, q.data() + t0 * K, k.data() + t0 * K, v.data() + t0 * V)
                    .decay(g.data() + t0)
                    .gain(beta.data() + t0);
      dgps::decode<R>(st, in, o.data() + t0 * V, opt);
    }
  }
  int bad = 0;
  for (int64_t i = 0; i < T * V; ++i) {
    const H want(scale * float(v[size_t(i)]));
    const bool zeros = (want.bits & 0x7fff) == 0 && (o[size_t(i)].bits & 0x7fff) == 0;
    bad += !zeros && want.bits != o[size_t(i)].bits;
  }
  const std::string label = std::string(is_f16 ? "f16" : "bf16") + (use_decode ? " decode" : " chunkwise");
  CHECK_MESSAGE(bad == 0, label, " scale ", scale, ": outputs not rounded exactly: ", bad);
}

TEST_CASE("bf16/f16 kernels round o exactly (every finite pattern, subnormals, overflow to infinity)") {
  for (bool dec : {false, true}) {
    check_store_rounding<dgps::bf16>(false, dec, 0.7f);
    check_store_rounding<dgps::bf16>(false, dec, 1.3f);
    check_store_rounding<dgps::f16>(true, dec, 0.7f);
    check_store_rounding<dgps::f16>(true, dec, 1.3f);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, decode and backward against the float64 reference on the same (rounded) inputs.

/// Rounds every input of `c` that has type H to H (states to float), in place: the reference then
/// runs on exactly the values the half-precision call sees.
template <class H>
void round_inputs(Case& c) {
  for (auto& [n, v] : c.arr) {
    const bool state = n == "h0" || n == "a0" || n == "dhT" || n == "daT";
    for (double& x : v) x = state ? double(float(x)) : double(H(x));
  }
}

/// Relative error of every array of `got` present in `ref` (max over arrays).
double worst(const Arrays& got, const Arrays& ref, std::string& which) {
  double w = 0;
  for (const auto& [n, r] : ref) {
    if (!got.count(n)) continue;
    const double e = rel_err(got.at(n), r);
    if (e > w || !std::isfinite(e)) w = e, which = n;
  }
  return w;
}

template <class R, class H>
void check_model(const std::string& label, bool is_f16, uint64_t seed, bool varlen) {
  const double tol = is_f16 ? 5e-3 : 2e-2;
  const int64_t H_ = 2, HV = 4, K = 24, V = 40;  // GVA, sizes that are not multiples of the vector length
  const std::vector<int64_t> cu = varlen ? std::vector<int64_t>{0, 7, 7, 80, 150} : std::vector<int64_t>{};
  const dgps::Shape shape{.batch = varlen ? 1 : 2,
                          .time = varlen ? cu.back() : 70,
                          .heads = H_,
                          .v_heads = HV,
                          .key_dim = K,
                          .value_dim = V};
  Case c = random_case(dgps::spec_of<R>(), shape, cu, seed);
  round_inputs<H>(c);
  const Arrays ref = run_forward<double, R>(c, on(dgps::Backend::reference));
  std::string which;
  for (auto alg : {dgps::Algorithm::automatic, dgps::Algorithm::recurrent}) {
    dgps::Options opt = on(dgps::Backend::cpu, 2);
    opt.algorithm = alg;
    const double e = worst(run_forward<H, R>(c, opt), ref, which);
    CHECK_MESSAGE(e < tol, label, " forward (", std::string(dgps::to_string(alg)), ") ", which, " rel err ", e);
  }
  const double er = worst(run_forward<H, R>(c, on(dgps::Backend::reference)), ref, which);
  CHECK_MESSAGE(er < tol, label, " reference backend ", which, " rel err ", er);

  // Gradients: half-precision gradients (computed in float) against the float64 reference.
  const Arrays gref = run_backward<double, R>(c, on(dgps::Backend::reference));
  for (auto alg : {dgps::Algorithm::automatic, dgps::Algorithm::recurrent}) {
    dgps::Options opt = on(dgps::Backend::cpu, 2);
    opt.algorithm = alg;
    const double eg = worst(run_backward<H, R>(c, opt), gref, which);
    CHECK_MESSAGE(eg < 2 * tol, label, " backward (", std::string(dgps::to_string(alg)), ") ", which, " rel err ", eg);
  }

  // Decode: prefill 5 tokens with the forward, then decode 1 and then 2 tokens at a time (fixed
  // length only: decode takes one row per sequence); outputs and final states vs the reference.
  if (varlen) return;
  CaseTensors<H> ct(c);
  const int64_t N = shape.batch, Tt = shape.time, T0 = 5;
  const auto adims = precond_state_dims(c.spec, N, H_, K);
  std::vector<float> h(size_t(N * HV * K * V)), a(size_t(adims.empty() ? 0 : product(adims)));
  std::vector<H> o(size_t(N * Tt * HV * V), H(0.0f));
  auto slice = [&](const char* n, int64_t t0, int64_t len) {
    dgps::TensorView<const H> t;
    if (!c.has(n)) return t;
    t = dgps::view<const H>(ct.p(n), c.shapes.at(n));
    t.size[1] = len;
    t.data += t0 * t.stride[1];
    return t;
  };
  {
    dgps::Shape s = shape;
    s.time = T0;
    auto in = dgps::inputs<H>(s, slice("q", 0, T0), slice("k", 0, T0), slice("v", 0, T0));
    in.decay(slice("g", 0, T0))
        .gain(slice("beta", 0, T0))
        .precond(slice("g_p", 0, T0), slice("beta_p", 0, T0), ct.p("center"));
    in.initial_state(ct.ps("h0"), ct.ps("a0"));
    dgps::TensorView<H> ov = dgps::view<H>(o.data(), {N, Tt, HV, V});
    ov.size[1] = T0;
    dgps::forward<R>(in, dgps::outputs<H>(ov).final_state(h.data(), a.empty() ? nullptr : a.data()),
                     on(dgps::Backend::cpu, 2));
  }
  dgps::DecodeState<H> st;
  st.h = dgps::view<float>(h.data(), {N, HV, K, V});
  if (!a.empty()) st.a = dgps::view<float>(a.data(), adims);
  for (int64_t t0 = T0, step = 1; t0 < Tt; t0 += step, step = 3 - step) {
    const int64_t len = std::min(step, Tt - t0);
    dgps::Shape s = shape;
    s.time = len;
    auto in = dgps::inputs<H>(s, slice("q", t0, len), slice("k", t0, len), slice("v", t0, len));
    in.decay(slice("g", t0, len))
        .gain(slice("beta", t0, len))
        .precond(slice("g_p", t0, len), slice("beta_p", t0, len), ct.p("center"));
    dgps::TensorView<H> ov = dgps::view<H>(o.data(), {N, Tt, HV, V});
    ov.size[1] = len;
    ov.data += t0 * ov.stride[1];
    dgps::decode<R>(st, in, ov, on(dgps::Backend::cpu, 2));
  }
  Arrays dec;
  dec["o"] = std::vector<double>(o.begin(), o.end());
  dec["hT"] = std::vector<double>(h.begin(), h.end());
  if (!a.empty()) dec["aT"] = std::vector<double>(a.begin(), a.end());
  const double ed = worst(dec, ref, which);
  CHECK_MESSAGE(ed < tol, label, " decode ", which, " rel err ", ed);
}

template <class H>
void check_models(bool is_f16) {
  for (bool varlen : {false, true}) {
    check_model<dgps::GDN, H>(varlen ? "gdn varlen" : "gdn", is_f16, 11, varlen);
    check_model<dgps::PGDN, H>(varlen ? "pgdn varlen" : "pgdn", is_f16, 12, varlen);
    check_model<dgps::KDA, H>(varlen ? "kda varlen" : "kda", is_f16, 13, varlen);
    check_model<dgps::Mamba2, H>(varlen ? "mamba2 varlen" : "mamba2", is_f16, 14, varlen);
  }
}

TEST_CASE("bf16 inputs: forward (chunkwise, recurrent, reference), decode, backward vs float64 (rel err < 2e-2)") {
  check_models<dgps::bf16>(false);
}

TEST_CASE("f16 inputs: forward (chunkwise, recurrent, reference), decode, backward vs float64 (rel err < 5e-3)") {
  check_models<dgps::f16>(true);
}

TEST_CASE("bf16 validation errors name the tensor") {
  const int64_t B = 1, T = 3, H = 2, K = 4, V = 4;
  std::vector<dgps::bf16> q(B * T * H * K, dgps::bf16(0.5f)), v(B * T * H * V, dgps::bf16(0.5f)),
      g(B * T * H, dgps::bf16(-0.1f)), beta(B * T * H, dgps::bf16(0.5f)), o(B * T * H * V);
  const dgps::Shape s{.batch = B, .time = T, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  auto in = dgps::inputs<dgps::bf16>(s, q.data(), q.data(), dgps::view<const dgps::bf16>(v.data(), {B, T, H, V - 1}))
                .decay(g.data())
                .gain(beta.data());
  CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(in, dgps::outputs<dgps::bf16>(o.data())),
                       doctest::Contains("tensor 'v'"), dgps::Error);
  in.v = dgps::In<dgps::bf16>(v.data()).view;
  std::vector<float> h(H * K * V);
  auto out = dgps::outputs<dgps::bf16>(o.data()).final_state(dgps::view<float>(h.data(), {1, H, K, V + 1}));
  CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(in, out), doctest::Contains("tensor 'hT'"), dgps::Error);
  in.beta = {};
  CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(in, dgps::outputs<dgps::bf16>(o.data())),
                       doctest::Contains("tensor 'beta'"), dgps::Error);
}

}  // namespace
