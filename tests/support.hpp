/// @brief Test support: conformance-case loading, tensors in std::vector, error metrics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <dgps/dgps.hpp>
#include <dgps/io/npy.hpp>

namespace dgps_test {

namespace fs = std::filesystem;

inline std::string data_dir() { return DGPS_TEST_DATA; }

/// Value of a key in a flat-enough JSON text (first occurrence after `after`, if given).
inline std::string json_value(const std::string& j, const std::string& key, const std::string& after = "") {
  size_t from = after.empty() ? 0 : j.find("\"" + after + "\"");
  if (from == std::string::npos) return {};
  const auto k = j.find("\"" + key + "\"", from);
  if (k == std::string::npos) return {};
  auto c = j.find(':', k) + 1;
  while (j[c] == ' ') ++c;
  if (j[c] == '"') return j.substr(c + 1, j.find('"', c + 1) - c - 1);
  return j.substr(c, j.find_first_of(",}\n", c) - c);
}

/// One conformance case: model spec, options, shapes, and every array by name (as double).
struct Case {
  std::string name;
  dgps::ModelSpec spec;
  dgps::Options opt;
  dgps::Shape shape;
  int64_t N = 0;
  std::map<std::string, std::vector<double>> arr;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, double> denom;
  std::vector<int64_t> cu;

  bool has(const std::string& n) const { return arr.count(n) > 0; }
};

/// Sets DGPS_MAX_CPU_ISA for the lifetime of the object (restores "unset" afterwards).
struct IsaCap {
  explicit IsaCap(const char* isa) { setenv("DGPS_MAX_CPU_ISA", isa, 1); }
  ~IsaCap() { unsetenv("DGPS_MAX_CPU_ISA"); }
  IsaCap(const IsaCap&) = delete;
  IsaCap& operator=(const IsaCap&) = delete;
};

/// The DGPS_MAX_CPU_ISA caps that select each CPU kernel unit of this architecture, lowest first (a cap above what
/// the CPU runs selects its best unit).
#if defined(__aarch64__)
inline constexpr const char* kCpuIsas[] = {"generic", "neon64"};
#else
inline constexpr const char* kCpuIsas[] = {"generic", "avx2", "avx512"};
#endif
/// The lowest and the highest of them.
inline constexpr const char* kCpuIsaEnds[] = {kCpuIsas[0], kCpuIsas[std::size(kCpuIsas) - 1]};

/// Every combination the CPU chunkwise kernels cover (3 decays x 2 gains x 3 preconditioners x 2 solves).
inline std::vector<dgps::ModelSpec> covered_specs() {
  std::vector<dgps::ModelSpec> out;
  for (auto d : {dgps::decay::Kind::none, dgps::decay::Kind::scalar, dgps::decay::Kind::diagonal})
    for (auto g : {dgps::gain::Kind::unit, dgps::gain::Kind::scalar})
      for (auto p : {dgps::precond::Kind::identity, dgps::precond::Kind::diagonal_atk, dgps::precond::Kind::diagonal_atq})
        for (auto s : {dgps::solve::Kind::online, dgps::solve::Kind::offline}) out.push_back({d, g, p, s});
  return out;
}

inline dgps::ModelSpec spec_from(const std::string& d, const std::string& g, const std::string& p, const std::string& s) {
  dgps::ModelSpec m;
  m.decay = d == "none" ? dgps::decay::Kind::none : d == "scalar" ? dgps::decay::Kind::scalar : dgps::decay::Kind::diagonal;
  m.gain = g == "unit" ? dgps::gain::Kind::unit : dgps::gain::Kind::scalar;
  m.precond = p == "identity"    ? dgps::precond::Kind::identity
              : p == "diag_atk"  ? dgps::precond::Kind::diagonal_atk
              : p == "diag_atq"  ? dgps::precond::Kind::diagonal_atq
              : p == "exact_atk" ? dgps::precond::Kind::exact_atk
                                 : dgps::precond::Kind::exact_atq;
  m.solve = s == "online" ? dgps::solve::Kind::online : dgps::solve::Kind::offline;
  return m;
}

inline Case load_case(const std::string& name) {
  Case c;
  c.name = name;
  const fs::path dir = fs::path(data_dir()) / name;
  std::ifstream f(dir / "case.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string j = ss.str();
  c.spec = spec_from(json_value(j, "decay"), json_value(j, "gain"), json_value(j, "precond"), json_value(j, "solve"));
  c.opt.scale = std::stod(json_value(j, "scale"));
  c.opt.l2norm_qk = json_value(j, "l2norm_qk").find("true") != std::string::npos;
  c.opt.x = std::stod(json_value(j, "x", "options"));
  c.opt.eps = std::stod(json_value(j, "eps", "options"));
  c.opt.lambda = std::stod(json_value(j, "lambda", "options"));
  c.shape.batch = std::stoll(json_value(j, "B", "shapes"));
  c.shape.time = std::stoll(json_value(j, "T", "shapes"));
  c.shape.heads = std::stoll(json_value(j, "H", "shapes"));
  c.shape.v_heads = std::stoll(json_value(j, "HV", "shapes"));
  c.shape.key_dim = std::stoll(json_value(j, "K", "shapes"));
  c.shape.value_dim = std::stoll(json_value(j, "V", "shapes"));
  c.N = std::stoll(json_value(j, "N", "shapes"));
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".npy") continue;
    const std::string n = e.path().stem().string();
    auto a = dgps::npy::read(e.path().string());
    c.shapes[n] = a.shape;
    if (n == "cu_seqlens")
      c.cu = a.as<int64_t>();
    else
      c.arr[n] = a.as<double>();
  }
  for (const auto& [n, v] : c.arr) {
    const std::string d = json_value(j, n, "denominator");
    if (!d.empty()) c.denom[n] = std::stod(d);
  }
  return c;
}

/// Names of all conformance cases.
inline std::vector<std::string> case_names() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(data_dir()))
    if (e.is_directory()) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// max|x - ref| / denom (denom = max|ref| when not given); infinity if any x is not finite.
template <class T>
double rel_err(const std::vector<T>& x, const std::vector<double>& ref, double denom = -1) {
  double m = 0, mr = 0;
  if (x.size() != ref.size()) return INFINITY;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(double(x[i]))) return INFINITY;
    m = std::max(m, std::fabs(double(x[i]) - ref[i]));
    mr = std::max(mr, std::fabs(ref[i]));
  }
  const double d = denom > 0 ? denom : mr;
  return d > 0 ? m / d : m;
}

/// Symmetric part of a stack of K x K matrices (for exact-preconditioner da0).
template <class T>
std::vector<T> symmetrise(const std::vector<T>& a, int64_t K) {
  std::vector<T> o(a.size());
  for (size_t base = 0; base < a.size(); base += K * K)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) o[base + i * K + j] = (a[base + i * K + j] + a[base + j * K + i]) / T(2);
  return o;
}

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

/// Inputs of a case cast to T, owned here so the views stay valid.
template <class T>
struct CaseTensors {
  using S = dgps::state_t<T>;
  std::map<std::string, std::vector<T>> t;
  std::map<std::string, std::vector<S>> s;
  std::vector<int64_t> cu;

  explicit CaseTensors(const Case& c) : cu(c.cu) {
    for (const auto& [n, v] : c.arr) {
      if (n == "h0" || n == "a0" || n == "dhT" || n == "daT" || n == "hT" || n == "aT")
        s[n] = cast<S>(v);
      else
        t[n] = cast<T>(v);
    }
  }
  const T* p(const std::string& n) const { auto it = t.find(n); return it == t.end() ? nullptr : it->second.data(); }
  const S* ps(const std::string& n) const { auto it = s.find(n); return it == s.end() ? nullptr : it->second.data(); }

  dgps::Inputs<T> inputs(const Case& c) const {
    auto in = dgps::inputs<T>(c.shape, p("q"), p("k"), p("v"));
    in.decay(p("g")).gain(p("beta")).precond(p("g_p"), p("beta_p"), p("center")).initial_state(ps("h0"), ps("a0"));
    if (!cu.empty()) in.varlen(cu.data(), static_cast<int64_t>(cu.size()) - 1);
    return in;
  }
};

}  // namespace dgps_test

// ---------------------------------------------------------------------------------------------
// Random problems and runners shared by the identity, gradient, decode, varlen and random tests.
// ---------------------------------------------------------------------------------------------

#include <cstdint>
#include <random>
#include <type_traits>

#include <dgps/dynamic.hpp>

namespace dgps_test {

/// Deterministic pseudo-random numbers (seeded per test so failures reproduce).
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  /// Standard normal.
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
};

/// Ranges of the random inputs of `random_case`.
struct Gen {
  bool h0 = true;                        ///< give an initial state h0
  bool a0 = true;                        ///< give an initial preconditioner state a0 (models with one)
  bool final_grads = true;               ///< give dhT (and daT) cotangents
  double g_lo = -0.6, g_hi = -0.02;      ///< log-decay g
  double beta_lo = 0.1, beta_hi = 0.9;   ///< gain beta
  double gp_lo = -0.4, gp_hi = -0.02;    ///< preconditioner log-decay g_p
  double bp_lo = 0.3, bp_hi = 1.0;       ///< preconditioner gain beta_p
  std::vector<int64_t> zero_key_tokens;  ///< tokens (packed index b*T + t) whose keys are all zero
};

/// True when the spec has a preconditioner state (A or P).
inline bool has_precond_state(const dgps::ModelSpec& s) { return s.precond != dgps::precond::Kind::identity; }
/// True for the exact (inverse Gram) preconditioners.
inline bool is_exact(const dgps::ModelSpec& s) {
  return s.precond == dgps::precond::Kind::exact_atk || s.precond == dgps::precond::Kind::exact_atq;
}
/// True for the diagonal (squashed) preconditioners.
inline bool is_diagonal_precond(const dgps::ModelSpec& s) {
  return s.precond == dgps::precond::Kind::diagonal_atk || s.precond == dgps::precond::Kind::diagonal_atq;
}

/// Sizes of the preconditioner state [N, H, K] or [N, H, K, K] (empty for Identity).
inline std::vector<int64_t> precond_state_dims(const dgps::ModelSpec& s, int64_t N, int64_t H, int64_t K) {
  if (!has_precond_state(s)) return {};
  if (is_exact(s)) return {N, H, K, K};
  return {N, H, K};
}

/// Product of the sizes (number of elements).
inline int64_t product(const std::vector<int64_t>& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

/// A random problem of model `spec`: every input the model needs, `do`, and (optionally) h0, a0,
/// dhT, daT; `cu` non-empty makes it a packed varlen batch (shape.batch must be 1). `shape.v_heads`
/// must be set. Exact-preconditioner a0 is symmetric positive definite.
inline Case random_case(const dgps::ModelSpec& spec, const dgps::Shape& shape, const std::vector<int64_t>& cu,
                        uint64_t seed, const Gen& gen = {}) {
  Case c;
  c.name = "random";
  c.spec = spec;
  c.shape = shape;
  c.cu = cu;
  c.N = cu.empty() ? shape.batch : static_cast<int64_t>(cu.size()) - 1;
  const int64_t B = shape.batch, T = shape.time, H = shape.heads, HV = shape.v_heads, K = shape.key_dim,
                V = shape.value_dim, N = c.N;
  Rng rng(seed);
  auto fill = [&](const std::string& n, std::vector<int64_t> dims, auto f) {
    std::vector<double> v(static_cast<size_t>(product(dims)));
    for (auto& x : v) x = f();
    c.arr[n] = std::move(v);
    c.shapes[n] = std::move(dims);
  };
  auto normal = [&] { return rng.normal(); };
  fill("q", {B, T, H, K}, normal);
  fill("k", {B, T, H, K}, normal);
  for (int64_t tok : gen.zero_key_tokens)
    for (int64_t i = 0; i < H * K; ++i) c.arr["k"][static_cast<size_t>(tok * H * K + i)] = 0.0;
  fill("v", {B, T, HV, V}, normal);
  if (spec.decay == dgps::decay::Kind::scalar) fill("g", {B, T, HV}, [&] { return rng.uniform(gen.g_lo, gen.g_hi); });
  if (spec.decay == dgps::decay::Kind::diagonal)
    fill("g", {B, T, HV, K}, [&] { return rng.uniform(gen.g_lo, gen.g_hi); });
  if (spec.gain == dgps::gain::Kind::scalar)
    fill("beta", {B, T, HV}, [&] { return rng.uniform(gen.beta_lo, gen.beta_hi); });
  if (has_precond_state(spec)) {
    fill("g_p", {B, T, H}, [&] { return rng.uniform(gen.gp_lo, gen.gp_hi); });
    fill("beta_p", {B, T, H}, [&] { return rng.uniform(gen.bp_lo, gen.bp_hi); });
  }
  if (is_diagonal_precond(spec)) fill("center", {H}, [&] { return rng.uniform(-1.0, 0.5); });
  if (gen.h0) fill("h0", {N, HV, K, V}, [&] { return 0.5 * rng.normal(); });
  if (gen.a0 && has_precond_state(spec)) {
    if (is_exact(spec)) {
      // P0 = (L L^T / K + I) / lambda-ish: symmetric positive definite, moderately conditioned.
      std::vector<double> a(static_cast<size_t>(N * H * K * K));
      for (int64_t m = 0; m < N * H; ++m) {
        std::vector<double> L(static_cast<size_t>(K * K));
        for (auto& x : L) x = rng.normal();
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < K; ++j) {
            double s = 0;
            for (int64_t l = 0; l < K; ++l) s += L[i * K + l] * L[j * K + l];
            a[m * K * K + i * K + j] = 0.5 * s / double(K) + (i == j ? 0.5 : 0.0);
          }
      }
      c.arr["a0"] = std::move(a);
      c.shapes["a0"] = {N, H, K, K};
    } else {
      fill("a0", {N, H, K}, [&] { return rng.uniform(0.0, 2.0); });
    }
  }
  fill("do", {B, T, HV, V}, normal);
  if (gen.final_grads) {
    fill("dhT", {N, HV, K, V}, normal);
    if (has_precond_state(spec)) {
      fill("daT", precond_state_dims(spec, N, H, K), normal);
      if (is_exact(spec)) c.arr["daT"] = symmetrise(c.arr["daT"], K);
    }
  }
  return c;
}

/// Results of a call as float64 arrays by name ("o", "hT", "aT"; "dq", ..., "dh0", "da0").
using Arrays = std::map<std::string, std::vector<double>>;

/// max over every array of `ref` (outputs or gradients) of max|x - ref| / max|ref|, with the worst
/// array's name in `which`.
inline double worst(const Arrays& x, const Arrays& ref, std::string* which = nullptr) {
  double e = 0;
  for (const auto& [n, v] : ref) {
    const double en = rel_err(x.at(n), v);
    if (en > e && which) *which = n;
    e = std::max(e, en);
  }
  return e;
}

/// A view of `v` with the given sizes (contiguous).
template <class U>
dgps::TensorView<U> tv(std::vector<std::remove_const_t<U>>& v, std::vector<int64_t> dims) {
  return dgps::view<U>(v.data(), dims);
}

/// Forward of case `c` with input type T: model R at compile time, or dgps::dynamic when R is void.
/// Requests hT always and aT when the model has a preconditioner state.
template <class T, class R = void>
Arrays run_forward(const Case& c, dgps::Options opt) {
  using S = dgps::state_t<T>;
  CaseTensors<T> ct(c);
  const int64_t B = c.shape.batch, Tn = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim,
                V = c.shape.value_dim;
  const size_t no = static_cast<size_t>(B * Tn * HV * V);
  std::vector<T> o(std::max<size_t>(no, 1), T(NAN));  // never null, also for T = 0
  std::vector<S> hT(static_cast<size_t>(c.N * HV * K * V), S(NAN));
  const auto adims = precond_state_dims(c.spec, c.N, H, K);
  std::vector<S> aT(static_cast<size_t>(adims.empty() ? 0 : product(adims)), S(NAN));
  auto in = ct.inputs(c);
  auto out = dgps::outputs<T>(o.data()).final_state(hT.data(), aT.empty() ? nullptr : aT.data());
  if constexpr (std::is_void_v<R>)
    dgps::dynamic::forward(c.spec, in, out, opt);
  else
    dgps::forward<R>(in, out, opt);
  Arrays r;
  r["o"] = std::vector<double>(o.begin(), o.begin() + static_cast<std::ptrdiff_t>(no));
  r["hT"] = std::vector<double>(hT.begin(), hT.end());
  if (!aT.empty()) r["aT"] = std::vector<double>(aT.begin(), aT.end());
  return r;
}

/// Gradient buffers of case `c`, NaN-filled (a gradient left unwritten shows): a view in `g` for every input
/// present, dh0 and, with a preconditioner state, da0. The views point into the maps: not copyable.
template <class T>
struct GradBuffers {
  using S = dgps::state_t<T>;
  std::map<std::string, std::vector<T>> gt;  ///< "dq", "dk", ... (the inputs' types)
  std::map<std::string, std::vector<S>> gs;  ///< "dh0", "da0" (the state type)
  dgps::Grads<T> g;

  explicit GradBuffers(const Case& c) {
    auto want = [&](const std::string& name, dgps::TensorView<T>& dst) {
      if (!c.has(name)) return;
      auto& buf = gt["d" + name];
      buf.assign(c.arr.at(name).size(), T(NAN));
      dst = tv<T>(buf, c.shapes.at(name));
    };
    want("q", g.dq), want("k", g.dk), want("v", g.dv), want("g", g.dg), want("beta", g.dbeta);
    want("g_p", g.dg_p), want("beta_p", g.dbeta_p), want("center", g.dcenter);
    const int64_t HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim, H = c.shape.heads;
    gs["dh0"].assign(static_cast<size_t>(c.N * HV * K * V), S(NAN));
    g.dh0 = tv<S>(gs["dh0"], {c.N, HV, K, V});
    if (has_precond_state(c.spec)) {
      const auto ad = precond_state_dims(c.spec, c.N, H, K);
      gs["da0"].assign(static_cast<size_t>(product(ad)), S(NAN));
      g.da0 = tv<S>(gs["da0"], ad);
    }
  }
  GradBuffers(const GradBuffers&) = delete;
  GradBuffers& operator=(const GradBuffers&) = delete;

  /// Every gradient as a double array, by name.
  Arrays arrays() const {
    Arrays r;
    for (const auto& [n, v] : gt) r[n] = std::vector<double>(v.begin(), v.end());
    for (const auto& [n, v] : gs) r[n] = std::vector<double>(v.begin(), v.end());
    return r;
  }
};

/// Backward of case `c` (cotangents `do` and, when present, `dhT`, `daT`): every gradient of the
/// inputs present, plus dh0 and (with a preconditioner) da0. Model R, or dgps::dynamic when void.
template <class T, class R = void>
Arrays run_backward(const Case& c, dgps::Options opt) {
  CaseTensors<T> ct(c);
  GradBuffers<T> gb(c);
  auto in = ct.inputs(c);
  auto gi = dgps::grads_in<T>(ct.p("do"), ct.ps("dhT"), ct.ps("daT"));
  if constexpr (std::is_void_v<R>)
    dgps::dynamic::backward(c.spec, in, gi, gb.g, opt);
  else
    dgps::backward<R>(in, gi, gb.g, opt);
  return gb.arrays();
}

/// The scalar loss of SPEC §3.8 for forward results `f`: sum(o*do) + sum(hT*dhT) + sum(aT*daT).
inline double loss_of(const Case& c, const Arrays& f) {
  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  double l = dot(f.at("o"), c.arr.at("do"));
  if (c.has("dhT")) l += dot(f.at("hT"), c.arr.at("dhT"));
  if (c.has("daT")) l += dot(f.at("aT"), c.arr.at("daT"));
  return l;
}

/// Largest |x|.
inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::fabs(v));
  return m;
}

/// True when every value is finite.
inline bool all_finite(const std::vector<double>& x) {
  for (double v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

/// The case's scalar options (scale, L2 norm, squash bound, eps, lambda) copied into `o`.
inline void with_case_options(const Case& c, dgps::Options& o) {
  o.scale = c.opt.scale;
  o.l2norm_qk = c.opt.l2norm_qk;
  o.x = c.opt.x;
  o.eps = c.opt.eps;
  o.lambda = c.opt.lambda;
}

/// Options for a backend with the SPEC defaults otherwise (single thread unless `threads`).
inline dgps::Options on(dgps::Backend b, int threads = 1) {
  dgps::Options o;
  o.backend = b;
  o.threads = threads;
  return o;
}

/// An exact model with a scalar gain.
template <class D, class P, class S>
using ExactWithGain = dgps::Recurrence<D, dgps::gain::Scalar, P, S>;

/// Calls f.template operator()<R>() for the 14 exact models (compile-time: no run-time registry): the Mesa layer,
/// the ridge readout, and with a scalar gain every decay x target x solve.
template <class F>
void for_each_exact(F&& f) {
  f.template operator()<dgps::MesaLayer>();
  f.template operator()<dgps::RidgeReadout>();
  auto solves = [&]<class D, class P>() {
    f.template operator()<ExactWithGain<D, P, dgps::solve::Online>>();
    f.template operator()<ExactWithGain<D, P, dgps::solve::Offline>>();
  };
  auto targets = [&]<class D>() {
    solves.template operator()<D, dgps::precond::ExactATK>();
    solves.template operator()<D, dgps::precond::ExactATQ>();
  };
  targets.template operator()<dgps::decay::None>();
  targets.template operator()<dgps::decay::Scalar>();
  targets.template operator()<dgps::decay::Diagonal>();
}

/// Solves G y = b (dense, K x K, row-major) by Gaussian elimination with partial pivoting.
inline std::vector<double> solve(std::vector<double> G, std::vector<double> b) {
  const size_t K = b.size();
  for (size_t c = 0; c < K; ++c) {
    size_t piv = c;
    for (size_t r = c + 1; r < K; ++r)
      if (std::fabs(G[r * K + c]) > std::fabs(G[piv * K + c])) piv = r;
    for (size_t j = 0; j < K; ++j) std::swap(G[c * K + j], G[piv * K + j]);
    std::swap(b[c], b[piv]);
    for (size_t r = c + 1; r < K; ++r) {
      const double f = G[r * K + c] / G[c * K + c];
      for (size_t j = c; j < K; ++j) G[r * K + j] -= f * G[c * K + j];
      b[r] -= f * b[c];
    }
  }
  std::vector<double> y(K);
  for (size_t c = K; c-- > 0;) {
    double s = b[c];
    for (size_t j = c + 1; j < K; ++j) s -= G[c * K + j] * y[j];
    y[c] = s / G[c * K + c];
  }
  return y;
}

/// The explicit ridge readout of SPEC §3.1: o_t = C_t (lambda I + sum k k^T)^{-1} q_t, per (b, h).
inline std::vector<double> ridge_direct(const Case& c, double lambda) {
  const int64_t B = c.shape.batch, T = c.shape.time, H = c.shape.heads, K = c.shape.key_dim, V = c.shape.value_dim;
  const auto &q = c.arr.at("q"), &k = c.arr.at("k"), &v = c.arr.at("v");
  std::vector<double> o(static_cast<size_t>(B * T * H * V));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> G(static_cast<size_t>(K * K), 0.0), C(static_cast<size_t>(V * K), 0.0);
      for (int64_t i = 0; i < K; ++i) G[i * K + i] = lambda;
      for (int64_t t = 0; t < T; ++t) {
        const double* kt = &k[((b * T + t) * H + h) * K];
        const double* vt = &v[((b * T + t) * H + h) * V];
        const double* qt = &q[((b * T + t) * H + h) * K];
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < K; ++j) G[i * K + j] += kt[i] * kt[j];
        for (int64_t e = 0; e < V; ++e)
          for (int64_t j = 0; j < K; ++j) C[e * K + j] += vt[e] * kt[j];
        const auto y = solve(G, std::vector<double>(qt, qt + K));
        for (int64_t e = 0; e < V; ++e) {
          double s = 0;
          for (int64_t j = 0; j < K; ++j) s += C[e * K + j] * y[j];
          o[((b * T + t) * H + h) * V + e] = s;
        }
      }
    }
  return o;
}

}  // namespace dgps_test
