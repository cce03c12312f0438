/// @brief Optional Eigen interop: dgps::TensorView of Eigen matrices, maps, refs, blocks and tensors, without copies.
///
/// Include this header (it needs Eigen 3.4, including unsupported/Eigen/CXX11/Tensor) to pass
/// Eigen-owned memory straight to dgps::forward / backward / decode:
///
/// ```cpp
/// Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> q(B * T * H, K);  // rows = vectors
/// auto in = dgps::inputs<float>(shape, dgps::eigen::view(q, {B, T, H, K}), ...);
/// ```
///
/// The rule for matrices: the vectors of the last dimension are the matrix's contiguous direction,
/// i.e. rows of a row-major matrix and columns of a column-major one; the remaining sizes enumerate
/// those vectors in order, and the outer stride of the matrix (e.g. a block of a larger matrix) is
/// honoured. Tensors are contiguous: a row-major `Eigen::Tensor<T, 4, Eigen::RowMajor>` of dims
/// (B, T, H, K) maps one to one, a column-major `Eigen::Tensor<T, 4>` is read with its dims reversed,
/// (K, H, T, B) -> [B, T, H, K]. The view is writable when the Eigen object is (`Out` arguments).
/// dgps/dgps.hpp does not include this header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include "dgps/error.hpp"
#include "dgps/tensor.hpp"

namespace dgps::eigen {

namespace detail {

/// A dense Eigen object with direct memory access (Matrix, Array, Map, Ref, Block of those).
template <class M>
concept DirectDense = std::is_base_of_v<Eigen::DenseBase<std::remove_cvref_t<M>>, std::remove_cvref_t<M>> &&
    requires(M& m) {
  m.data();
  m.innerStride();
  m.outerStride();
};

/// An Eigen Tensor or TensorMap (contiguous storage with a static rank and layout).
template <class M>
concept DirectTensor = requires(M& m) {
  std::remove_cvref_t<M>::NumIndices;
  std::remove_cvref_t<M>::Layout;
  m.dimensions();
  m.data();
};

/// The element type of the view: const when the Eigen object only gives read access.
template <class M>
using element_t = std::remove_pointer_t<decltype(std::declval<M&>().data())>;

/// "[2, 5, 4]"
inline std::string sizes_string(std::initializer_list<int64_t> sizes) {
  std::string s = "[";
  int i = 0;
  for (int64_t x : sizes) s += (i++ ? ", " : "") + std::to_string(x);
  return s + "]";
}

/// Rejects shapes of rank outside 1..4 or with negative sizes.
inline void check_rank(std::initializer_list<int64_t> sizes) {
  if (sizes.size() < 1 || sizes.size() > static_cast<size_t>(kMaxRank))
    throw Error("eigen view: shape " + sizes_string(sizes) + " must have 1 to " + std::to_string(kMaxRank) +
                " dimensions");
  for (int64_t s : sizes)
    if (s < 0) throw Error("eigen view: shape " + sizes_string(sizes) + " has a negative size");
}

/// Fills rank, sizes and strides: innermost stride 1, next `vec_stride`, then dense above it.
template <class E>
TensorView<E> make(E* data, std::initializer_list<int64_t> sizes, int64_t vec_stride) {
  TensorView<E> t;
  t.data = data;
  t.rank = static_cast<int>(sizes.size());
  int d = 0;
  for (int64_t s : sizes) t.size[d++] = s;
  t.stride[t.rank - 1] = 1;
  if (t.rank >= 2) t.stride[t.rank - 2] = vec_stride;
  for (int i = t.rank - 3; i >= 0; --i) t.stride[i] = t.stride[i + 1] * t.size[i + 1];
  return t;
}

}  // namespace detail

/// A view of a dense Eigen matrix (Matrix, Array, Map, Ref, Block) with the given 1 to 4 sizes.
///
/// The last size is the length of the contiguous vectors (the number of columns of a row-major
/// matrix, of rows of a column-major one) and the product of the others their number; consecutive
/// vectors are `outerStride()` elements apart. Throws dgps::Error when the inner stride is not 1
/// or the sizes do not match the matrix. No data is copied: the matrix must outlive the view.
template <class M>
requires detail::DirectDense<M> TensorView<detail::element_t<M>> view(M&& m, std::initializer_list<int64_t> sizes) {
  using Mat = std::remove_cvref_t<M>;
  detail::check_rank(sizes);
  const bool row_major = Mat::IsRowMajor;
  const int64_t rows = m.rows(), cols = m.cols();
  const int64_t len = row_major ? cols : rows, count = row_major ? rows : cols;
  const std::string what =
      std::to_string(rows) + " x " + std::to_string(cols) + (row_major ? " row-major" : " column-major") + " matrix";
  if (m.innerStride() != 1 && len > 1)
    throw Error("eigen view: the " + what + " has inner stride " + std::to_string(m.innerStride()) +
                ", expected 1 (the vectors of the last dimension must be contiguous)");
  int64_t lead = 1, last = 0;
  size_t i = 0;
  for (int64_t s : sizes) {
    if (++i < sizes.size())
      lead *= s;
    else
      last = s;
  }
  if (last != len || lead != count)
    throw Error("eigen view: shape " + detail::sizes_string(sizes) + " needs " + std::to_string(lead) +
                " vectors of length " + std::to_string(last) + ", but the " + what + " holds " + std::to_string(count) +
                " vectors of length " + std::to_string(len) + (row_major ? " (its rows)" : " (its columns)"));
  return detail::make(m.data(), sizes, count > 1 ? static_cast<int64_t>(m.outerStride()) : len);
}

/// A view of an Eigen Tensor or TensorMap of rank 1 to 4 with its own dims: in order for a
/// row-major tensor, reversed for a column-major one (dims (K, H, T, B) give [B, T, H, K]).
template <class M>
requires detail::DirectTensor<M> TensorView<detail::element_t<M>> view(M&& t) {
  using Ten = std::remove_cvref_t<M>;
  constexpr int r = static_cast<int>(Ten::NumIndices);
  static_assert(r >= 1 && r <= kMaxRank, "dgps::eigen::view: tensors of rank 1 to 4 only");
  constexpr bool row_major = static_cast<int>(Ten::Layout) == static_cast<int>(Eigen::RowMajor);
  const auto& dims = t.dimensions();
  int64_t sizes[kMaxRank] = {};
  for (int d = 0; d < r; ++d) sizes[d] = static_cast<int64_t>(dims[row_major ? d : r - 1 - d]);
  return TensorView<detail::element_t<M>>(t.data(), sizes, r);
}

/// A view of an Eigen Tensor or TensorMap with explicit sizes (a reshape of its contiguous storage):
/// the number of elements and the innermost (contiguous) dimension must match, else dgps::Error.
template <class M>
requires detail::DirectTensor<M> TensorView<detail::element_t<M>> view(M&& t, std::initializer_list<int64_t> sizes) {
  detail::check_rank(sizes);
  const auto own = view(t);
  const int64_t inner = own.size[own.rank - 1];
  int64_t n = 1, last = 0;
  for (int64_t s : sizes) {
    n *= s;
    last = s;
  }
  if (n != own.numel() || (n > 0 && last != inner))
    throw Error("eigen view: shape " + detail::sizes_string(sizes) + " does not match a tensor of dims " +
                own.shape_string() + " (C order): the element count and the innermost dimension must agree");
  return detail::make(own.data, sizes, last);
}

}  // namespace dgps::eigen
