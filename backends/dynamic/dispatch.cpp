/// @brief dgps::dynamic entry points: the run-time switch over (decay, solve) into the generated units.
#include "entry.hpp"

namespace dgps::dynamic {

namespace {
template <class F>
RunInfo by_decay_solve(const ModelSpec& s, F&& f) {
  using namespace dgps::decay;
  auto by_solve = [&]<class D>() {
    if (s.solve == solve::Kind::online) return f.template operator()<detail::Entry<D, solve::Online>>();
    return f.template operator()<detail::Entry<D, solve::Offline>>();
  };
  switch (s.decay) {
    case Kind::none: return by_solve.template operator()<None>();
    case Kind::scalar: return by_solve.template operator()<Scalar>();
    default: return by_solve.template operator()<Diagonal>();
  }
}
}  // namespace

template <class T>
RunInfo forward(const ModelSpec& s, const Inputs<T>& in, const Outputs<T>& out, const Options& o) {
  return by_decay_solve(s, [&]<class E>() {
    return E::template forward<T>(s, in, out, o);
  });
}
template <class T>
RunInfo backward(const ModelSpec& s, const Inputs<T>& in, const GradsIn<T>& gi, const Grads<T>& g, const Options& o) {
  return by_decay_solve(s, [&]<class E>() {
    return E::template backward<T>(s, in, gi, g, o);
  });
}
template <class T>
RunInfo decode(const ModelSpec& s, const DecodeState<T>& st, const Inputs<T>& in, std::type_identity_t<Out<T>> out,
               const Options& o) {
  return by_decay_solve(s, [&]<class E>() {
    return E::template decode<T>(s, st, in, out, o);
  });
}

template RunInfo forward<float>(const ModelSpec&, const Inputs<float>&, const Outputs<float>&, const Options&);
template RunInfo forward<double>(const ModelSpec&, const Inputs<double>&, const Outputs<double>&, const Options&);
template RunInfo backward<float>(const ModelSpec&, const Inputs<float>&, const GradsIn<float>&, const Grads<float>&,
                                 const Options&);
template RunInfo backward<double>(const ModelSpec&, const Inputs<double>&, const GradsIn<double>&, const Grads<double>&,
                                  const Options&);
template RunInfo decode<float>(const ModelSpec&, const DecodeState<float>&, const Inputs<float>&, Out<float>,
                               const Options&);
template RunInfo decode<double>(const ModelSpec&, const DecodeState<double>&, const Inputs<double>&, Out<double>,
                                const Options&);

}  // namespace dgps::dynamic
