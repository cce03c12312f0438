/// @brief The compiled entry points of dgps::dynamic, one explicit instantiation per (decay, solve) pair.
#pragma once

#include <dgps/dgps.hpp>
#include <dgps/dynamic.hpp>

#include "dgps_combinations.hpp"  // generated: DGPS_FOR_EACH_DECAY_SOLVE(X)

namespace dgps::dynamic::detail {

/// The models with decay D and solve Sv; gain and preconditioner are chosen inside.
template <class D, class Sv>
struct Entry {
  template <class F>
  static RunInfo with(const ModelSpec& s, F&& f) {
    auto by_precond = [&]<class G>() {
      switch (s.precond) {
        case precond::Kind::identity: return f.template operator()<Recurrence<D, G, precond::Identity, Sv>>();
        case precond::Kind::diagonal_atk: return f.template operator()<Recurrence<D, G, precond::DiagonalATK, Sv>>();
        case precond::Kind::diagonal_atq: return f.template operator()<Recurrence<D, G, precond::DiagonalATQ, Sv>>();
        case precond::Kind::exact_atk: return f.template operator()<Recurrence<D, G, precond::ExactATK, Sv>>();
        default: return f.template operator()<Recurrence<D, G, precond::ExactATQ, Sv>>();
      }
    };
    if (s.gain == gain::Kind::unit) return by_precond.template operator()<gain::Unit>();
    return by_precond.template operator()<gain::Scalar>();
  }
  template <class T>
  static RunInfo forward(const ModelSpec& s, const Inputs<T>& in, const Outputs<T>& out, const Options& o) {
    return with(s, [&]<class R>() { return dgps::forward<R>(in, out, o); });
  }
  template <class T>
  static RunInfo backward(const ModelSpec& s, const Inputs<T>& in, const GradsIn<T>& gi, const Grads<T>& g,
                          const Options& o) {
    return with(s, [&]<class R>() { return dgps::backward<R>(in, gi, g, o); });
  }
  template <class T>
  static RunInfo decode(const ModelSpec& s, const DecodeState<T>& st, const Inputs<T>& in, Out<T> out,
                        const Options& o) {
    return with(s, [&]<class R>() { return dgps::decode<R>(st, in, out, o); });
  }
};

/// Explicit instantiation (DEF = nothing) or declaration (DEF = extern) of one pair's entry points.
#define DGPS_DYNAMIC_ENTRY(DEF, D, Sv)                                                                               \
  DEF template RunInfo Entry<decay::D, solve::Sv>::forward<float>(const ModelSpec&, const Inputs<float>&,           \
                                                                  const Outputs<float>&, const Options&);           \
  DEF template RunInfo Entry<decay::D, solve::Sv>::forward<double>(const ModelSpec&, const Inputs<double>&,         \
                                                                   const Outputs<double>&, const Options&);         \
  DEF template RunInfo Entry<decay::D, solve::Sv>::backward<float>(                                                 \
      const ModelSpec&, const Inputs<float>&, const GradsIn<float>&, const Grads<float>&, const Options&);         \
  DEF template RunInfo Entry<decay::D, solve::Sv>::backward<double>(                                                \
      const ModelSpec&, const Inputs<double>&, const GradsIn<double>&, const Grads<double>&, const Options&);      \
  DEF template RunInfo Entry<decay::D, solve::Sv>::decode<float>(const ModelSpec&, const DecodeState<float>&,       \
                                                                 const Inputs<float>&, Out<float>, const Options&); \
  DEF template RunInfo Entry<decay::D, solve::Sv>::decode<double>(                                                  \
      const ModelSpec&, const DecodeState<double>&, const Inputs<double>&, Out<double>, const Options&);

#define DGPS_DYNAMIC_EXTERN(D, Sv) DGPS_DYNAMIC_ENTRY(extern, D, Sv)
DGPS_FOR_EACH_DECAY_SOLVE(DGPS_DYNAMIC_EXTERN)
#undef DGPS_DYNAMIC_EXTERN

}  // namespace dgps::dynamic::detail
