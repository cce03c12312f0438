/// @brief Options::check_finite: rejects NaN and infinite values in a validated problem's float inputs.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

#include "dgps/detail/problem.hpp"
#include "dgps/error.hpp"
#include "dgps/tensor.hpp"
#include "dgps/types.hpp"

namespace dgps::detail {

/// Throws dgps::Error naming `name` and the multi-index of its first non-finite element (row-major
/// order); absent views (null data) pass.
template <class T>
void check_finite_view(const char* name, const TensorView<const T>& t) {
  if (!t.data || t.rank <= 0) return;
  for (int d = 0; d < t.rank; ++d)
    if (t.size[d] == 0) return;
  std::array<int64_t, kMaxRank> idx{};
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < t.rank; ++d) off += idx[d] * t.stride[d];
    if (!std::isfinite(static_cast<double>(static_cast<float>(t.data[off])))) {
      std::string at;
      for (int d = 0; d < t.rank; ++d) at += (d ? ", " : "") + std::to_string(idx[d]);
      throw Error("tensor '" + std::string(name) + "' has a non-finite value at [" + at + "] (Options::check_finite)");
    }
    int d = t.rank - 1;
    while (d >= 0 && ++idx[d] == t.size[d]) idx[d--] = 0;
    if (d < 0) return;
  }
}

/// The float inputs of a validated forward, backward or decode problem (decode: its state is h0/a0),
/// checked when `opt.check_finite` is set.
template <class T>
void check_finite(const Problem<T>& p, const Options& opt) {
  if (!opt.check_finite) return;
  check_finite_view("q", p.q);
  check_finite_view("k", p.k);
  check_finite_view("v", p.v);
  check_finite_view("g", p.g);
  check_finite_view("beta", p.beta);
  check_finite_view("g_p", p.g_p);
  check_finite_view("beta_p", p.beta_p);
  check_finite_view("center", p.center);
  check_finite_view("h0", p.h0);
  check_finite_view("a0", p.a0);
  check_finite_view("do", p.d_o);
  check_finite_view("dhT", p.dhT);
  check_finite_view("daT", p.daT);
}

}  // namespace dgps::detail
