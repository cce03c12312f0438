/// @brief Recurrence<Decay, Gain, Preconditioner, Solve>, the named models of SPEC §2, and run-time model specs.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "dgps/error.hpp"
#include "dgps/model_spec.hpp"
#include "dgps/policy/decay.hpp"
#include "dgps/policy/gain.hpp"
#include "dgps/policy/preconditioner.hpp"
#include "dgps/policy/solve.hpp"

namespace dgps {

/// One member of the DGPS family: the four policy axes of SPEC §2, fixed at compile time.
template <class Decay, class Gain, class Preconditioner, class Solve>
struct Recurrence {
  using decay_type = Decay;
  using gain_type = Gain;
  using precond_type = Preconditioner;
  using solve_type = Solve;
};

// The named members of SPEC §2.
using LinearAttention = Recurrence<decay::None, gain::Unit, precond::Identity, solve::Offline>;
using Mamba2 = Recurrence<decay::Scalar, gain::Scalar, precond::Identity, solve::Offline>;
using GLA = Recurrence<decay::Diagonal, gain::Unit, precond::Identity, solve::Offline>;
using DeltaNet = Recurrence<decay::None, gain::Scalar, precond::Identity, solve::Online>;
using GDN = Recurrence<decay::Scalar, gain::Scalar, precond::Identity, solve::Online>;
using KDA = Recurrence<decay::Diagonal, gain::Scalar, precond::Identity, solve::Online>;
using PDN = Recurrence<decay::None, gain::Scalar, precond::DiagonalATK, solve::Online>;
using PGDN = Recurrence<decay::Scalar, gain::Scalar, precond::DiagonalATK, solve::Online>;
using PKDA = Recurrence<decay::Diagonal, gain::Scalar, precond::DiagonalATK, solve::Online>;
using PMamba2 = Recurrence<decay::Scalar, gain::Scalar, precond::DiagonalATQ, solve::Offline>;
using MesaLayer = Recurrence<decay::None, gain::Unit, precond::ExactATK, solve::Online>;
using RidgeReadout = Recurrence<decay::None, gain::Unit, precond::ExactATQ, solve::Offline>;

/// The short names of the named models ("la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn",
/// "pkda", "pmamba2", "mesa", "ridge") and their specs.
inline constexpr std::pair<std::string_view, ModelSpec> kNamedModels[] = {
    {"la", spec_of<LinearAttention>()}, {"mamba2", spec_of<Mamba2>()}, {"gla", spec_of<GLA>()},
    {"dn", spec_of<DeltaNet>()},        {"gdn", spec_of<GDN>()},       {"kda", spec_of<KDA>()},
    {"pdn", spec_of<PDN>()},            {"pgdn", spec_of<PGDN>()},     {"pkda", spec_of<PKDA>()},
    {"pmamba2", spec_of<PMamba2>()},    {"mesa", spec_of<MesaLayer>()}, {"ridge", spec_of<RidgeReadout>()},
};

/// Looks up a named model; throws dgps::Error listing the known names.
inline ModelSpec model_by_name(std::string_view name) {
  std::string known;
  for (const auto& [n, s] : kNamedModels) {
    if (n == name) return s;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw Error("unknown model '" + std::string(name) + "' (expected one of: " + known + ")");
}

/// "decay=scalar gain=scalar precond=diag-atk solve=online", and the model name when it has one.
inline std::string to_string(const ModelSpec& s) {
  static constexpr const char* dn[] = {"none", "scalar", "diagonal"};
  static constexpr const char* gn[] = {"unit", "scalar"};
  static constexpr const char* pn[] = {"identity", "diag-atk", "diag-atq", "exact-atk", "exact-atq"};
  static constexpr const char* sn[] = {"online", "offline"};
  std::string out = std::string("decay=") + dn[int(s.decay)] + " gain=" + gn[int(s.gain)] +
                    " precond=" + pn[int(s.precond)] + " solve=" + sn[int(s.solve)];
  for (const auto& [n, m] : kNamedModels)
    if (m == s) return std::string(n) + " (" + out + ")";
  return out;
}

namespace detail {
template <class F, class D, class G, class P>
decltype(auto) dispatch_solve(const ModelSpec& s, F&& f) {
  if (s.solve == solve::Kind::online) return f.template operator()<Recurrence<D, G, P, solve::Online>>();
  return f.template operator()<Recurrence<D, G, P, solve::Offline>>();
}
template <class F, class D, class G>
decltype(auto) dispatch_precond(const ModelSpec& s, F&& f) {
  switch (s.precond) {
    case precond::Kind::identity: return dispatch_solve<F, D, G, precond::Identity>(s, std::forward<F>(f));
    case precond::Kind::diagonal_atk: return dispatch_solve<F, D, G, precond::DiagonalATK>(s, std::forward<F>(f));
    case precond::Kind::diagonal_atq: return dispatch_solve<F, D, G, precond::DiagonalATQ>(s, std::forward<F>(f));
    case precond::Kind::exact_atk: return dispatch_solve<F, D, G, precond::ExactATK>(s, std::forward<F>(f));
    default: return dispatch_solve<F, D, G, precond::ExactATQ>(s, std::forward<F>(f));
  }
}
template <class F, class D>
decltype(auto) dispatch_gain(const ModelSpec& s, F&& f) {
  if (s.gain == gain::Kind::unit) return dispatch_precond<F, D, gain::Unit>(s, std::forward<F>(f));
  return dispatch_precond<F, D, gain::Scalar>(s, std::forward<F>(f));
}
}  // namespace detail

/// The run-time to compile-time switch, in one place: calls `f.template operator()<R>()` with the
/// Recurrence that `spec` names. Every one of the 60 combinations is instantiated.
template <class F>
decltype(auto) dispatch(const ModelSpec& spec, F&& f) {
  switch (spec.decay) {
    case decay::Kind::none: return detail::dispatch_gain<F, decay::None>(spec, std::forward<F>(f));
    case decay::Kind::scalar: return detail::dispatch_gain<F, decay::Scalar>(spec, std::forward<F>(f));
    default: return detail::dispatch_gain<F, decay::Diagonal>(spec, std::forward<F>(f));
  }
}

}  // namespace dgps
