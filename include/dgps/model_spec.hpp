/// @brief ModelSpec, a DGPS model chosen at run time (SPEC §2), and which models have chunkwise kernels (SPEC §4).
#pragma once

#include "dgps/policy/decay.hpp"
#include "dgps/policy/gain.hpp"
#include "dgps/policy/preconditioner.hpp"
#include "dgps/policy/solve.hpp"

namespace dgps {

/// A model chosen at run time: the four axes as enum values.
struct ModelSpec {
  decay::Kind decay = decay::Kind::scalar;
  gain::Kind gain = gain::Kind::scalar;
  precond::Kind precond = precond::Kind::identity;
  solve::Kind solve = solve::Kind::online;

  friend bool operator==(const ModelSpec&, const ModelSpec&) = default;
};

/// The spec of a compile-time recurrence (any type with decay_type, gain_type, precond_type, solve_type).
template <class R>
constexpr ModelSpec spec_of() {
  return {R::decay_type::kind, R::gain_type::kind, R::precond_type::kind, R::solve_type::kind};
}

/// True when the chunkwise algorithm covers `spec` (CPU and CUDA alike): every decay, gain and solve with the
/// Identity, DiagonalATK or DiagonalATQ preconditioner (SPEC §4); the exact preconditioners are recurrent only.
constexpr bool chunkwise_covers(const ModelSpec& spec) {
  return spec.precond == precond::Kind::identity || spec.precond == precond::Kind::diagonal_atk ||
         spec.precond == precond::Kind::diagonal_atq;
}

}  // namespace dgps
