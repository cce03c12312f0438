/// @brief The reference backend: SPEC §2 token by token with double accumulation (the oracle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dgps/detail/parallel.hpp"
#include "dgps/detail/problem.hpp"
#include "dgps/reference/recurrent.hpp"

namespace dgps::reference {

/// Runs the recurrence over every (sequence, key head) group with accumulator type Acc.
template <class R, class T, class Acc = double>
void forward(const dgps::detail::Problem<T>& p, int threads = 1) {
  dgps::detail::parallel_for(p.N * p.H, threads, [&](int64_t i) { GroupKernel<R, T, Acc>(p, i / p.H, i % p.H).forward(); });
}

/// Backward of `forward`: every requested gradient; dcenter is reduced over sequences in a fixed
/// order, so results are bitwise reproducible whatever the thread count.
template <class R, class T, class Acc = double>
void backward(const dgps::detail::Problem<T>& p, int threads = 1) {
  std::vector<Acc> dc(static_cast<size_t>(p.N * p.H), Acc(0));
  dgps::detail::parallel_for(p.N * p.H, threads,
                             [&](int64_t i) { GroupKernel<R, T, Acc>(p, i / p.H, i % p.H).backward(&dc[i]); });
  if (p.dcenter.data)
    for (int64_t h = 0; h < p.H; ++h) {
      Acc s = 0;
      for (int64_t n = 0; n < p.N; ++n) s += dc[n * p.H + h];
      p.dcenter(h) = static_cast<T>(s);
    }
}

}  // namespace dgps::reference
