/// @brief Run-time model choice: forward/backward/decode for a ModelSpec (link dgps::dynamic).
///
/// `dgps::forward<Model>` needs the model at compile time. Tools, bindings and configuration-driven
/// code pick it at run time instead; the compiled library dgps::dynamic holds every one of the 60
/// policy combinations (generated from cmake/dgps_combinations.cmake) for float and double only:
/// bf16 / f16 inputs need the compile-time `dgps::forward<Model>` (instantiating them here too would
/// double a long build).
#pragma once

#include <type_traits>

#include "dgps/export.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/types.hpp"

namespace dgps::dynamic {

/// dgps::forward for the model that `spec` names.
template <class T>
DGPS_API RunInfo forward(const ModelSpec& spec, const Inputs<T>& in, const Outputs<T>& out, const Options& opt = {});
/// dgps::backward for the model that `spec` names.
template <class T>
DGPS_API RunInfo backward(const ModelSpec& spec, const Inputs<T>& in, const GradsIn<T>& gin, const Grads<T>& grads,
                 const Options& opt = {});
/// dgps::decode for the model that `spec` names.
template <class T>
DGPS_API RunInfo decode(const ModelSpec& spec, const DecodeState<T>& state, const Inputs<T>& tokens,
               std::type_identity_t<Out<T>> o, const Options& opt = {});

extern template RunInfo forward<float>(const ModelSpec&, const Inputs<float>&, const Outputs<float>&, const Options&);
extern template RunInfo forward<double>(const ModelSpec&, const Inputs<double>&, const Outputs<double>&, const Options&);
extern template RunInfo backward<float>(const ModelSpec&, const Inputs<float>&, const GradsIn<float>&,
                                        const Grads<float>&, const Options&);
extern template RunInfo backward<double>(const ModelSpec&, const Inputs<double>&, const GradsIn<double>&,
                                         const Grads<double>&, const Options&);
extern template RunInfo decode<float>(const ModelSpec&, const DecodeState<float>&, const Inputs<float>&, Out<float>,
                                      const Options&);
extern template RunInfo decode<double>(const ModelSpec&, const DecodeState<double>&, const Inputs<double>&,
                                       Out<double>, const Options&);

}  // namespace dgps::dynamic
