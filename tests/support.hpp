/// @brief Test support: conformance-case loading, tensors in std::vector, error metrics.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
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
