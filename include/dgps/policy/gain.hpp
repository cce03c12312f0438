/// @brief Gain axis (SPEC §2): the write strength b of each token.
#pragma once

namespace dgps::gain {

/// Identifiers usable at run time.
enum class Kind { unit, scalar };

/// b = 1. Needs no `beta`.
struct Unit {
  static constexpr Kind kind = Kind::unit;
  static constexpr bool needs_beta = false;
  static constexpr const char* name = "unit";
};

/// b = beta_t, `beta` is [B, T, HV].
struct Scalar {
  static constexpr Kind kind = Kind::scalar;
  static constexpr bool needs_beta = true;
  static constexpr const char* name = "scalar";
};

/// The token's gain: 1 for Unit, `*beta` for Scalar.
template <class G, class Acc, class In>
inline Acc value(const In* beta) {
  if constexpr (G::kind == Kind::unit) {
    (void)beta;
    return Acc(1);
  } else {
    return Acc(*beta);
  }
}

}  // namespace dgps::gain
