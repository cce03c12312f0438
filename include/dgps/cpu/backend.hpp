/// @brief The CPU backend: float32 (or float64) compute, parallel over (sequence, key head).
#pragma once

#include <string>

#include "dgps/detail/problem.hpp"
#include "dgps/reference/backend.hpp"
#include "dgps/types.hpp"

namespace dgps::cpu {

/// True when the CPU backend has `alg` for model R (the recurrent algorithm covers every combination).
template <class R>
constexpr bool supports(Algorithm alg) {
  return alg == Algorithm::automatic || alg == Algorithm::recurrent;
}

/// Forward on the CPU; returns the implementation name.
template <class R, class T>
std::string forward(const dgps::detail::Problem<T>& p, Algorithm) {
  reference::forward<R, T, T>(p, p.threads);
  return "cpu/recurrent";
}

/// Backward on the CPU; returns the implementation name.
template <class R, class T>
std::string backward(const dgps::detail::Problem<T>& p, Algorithm) {
  reference::backward<R, T, T>(p, p.threads);
  return "cpu/recurrent";
}

}  // namespace dgps::cpu
