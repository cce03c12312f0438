/// @brief Decay axis (SPEC §2): how the previous state is decayed before the token's write.
#pragma once

#include <cmath>
#include <cstdint>

namespace dgps::decay {

/// Identifiers usable at run time (CLI, dispatch tables).
enum class Kind { none, scalar, diagonal };

/// No decay: Sbar = S_{t-1}. Needs no `g`.
struct None {
  static constexpr Kind kind = Kind::none;
  static constexpr bool needs_g = false;
  static constexpr bool per_channel = false;
  static constexpr const char* name = "none";
};

/// Scalar decay (GDN, Mamba-2): Sbar = exp(g_t) S_{t-1}; `g` is [B, T, HV].
struct Scalar {
  static constexpr Kind kind = Kind::scalar;
  static constexpr bool needs_g = true;
  static constexpr bool per_channel = false;
  static constexpr const char* name = "scalar";
};

/// Diagonal decay (KDA, GLA): row c of the K x V state is scaled by exp(g_t[c]); `g` is [B, T, HV, K].
struct Diagonal {
  static constexpr Kind kind = Kind::diagonal;
  static constexpr bool needs_g = true;
  static constexpr bool per_channel = true;
  static constexpr const char* name = "diagonal";
};

/// Fills `factor[c]` (c < K) with the per-row multiplier of the state for one token.
/// `g` points at the token's gate (one value for Scalar, K values for Diagonal).
template <class D, class Acc, class In>
inline void row_factors(const In* g, int64_t K, Acc* factor) {
  if constexpr (D::kind == Kind::none) {
    for (int64_t c = 0; c < K; ++c) factor[c] = Acc(1);
  } else if constexpr (D::kind == Kind::scalar) {
    const Acc f = std::exp(Acc(g[0]));
    for (int64_t c = 0; c < K; ++c) factor[c] = f;
  } else {
    for (int64_t c = 0; c < K; ++c) factor[c] = std::exp(Acc(g[c]));
  }
}

/// Backward of Sbar = Diag(factor) S_prev given dSbar and Sbar (K x V, row-major):
/// writes the gate gradient (1 value for Scalar, K for Diagonal) into `dg` (accumulating).
template <class D, class Acc>
inline void gate_grad(const Acc* dSbar, const Acc* Sbar, int64_t K, int64_t V, Acc* dg) {
  if constexpr (D::kind == Kind::none) {
    (void)dSbar, (void)Sbar, (void)K, (void)V, (void)dg;
  } else {
    for (int64_t c = 0; c < K; ++c) {
      Acc s = 0;
      for (int64_t j = 0; j < V; ++j) s += dSbar[c * V + j] * Sbar[c * V + j];
      if constexpr (D::kind == Kind::scalar)
        dg[0] += s;
      else
        dg[c] += s;
    }
  }
}

}  // namespace dgps::decay
