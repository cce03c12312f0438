/// @brief TensorView: a non-owning strided view (last dimension contiguous) used for every tensor.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace dgps {

/// Largest tensor rank used by the library ([B, T, H, K] and [N, HV, K, V]).
inline constexpr int kMaxRank = 4;

/// A non-owning view of a tensor of element type T with up to four dimensions.
///
/// Element (i0, i1, ..., i{r-1}) lives at `data[i0*stride[0] + ... + i{r-1}*stride[r-1]]`; strides
/// are in elements. The library requires the last dimension to be contiguous (`stride[rank-1] == 1`)
/// and checks it. A default-constructed view is "absent" (`data == nullptr`, `rank == 0`).
template <class T>
struct TensorView {
  T* data = nullptr;
  int rank = 0;
  std::array<int64_t, kMaxRank> size{};
  std::array<int64_t, kMaxRank> stride{};

  TensorView() = default;

  /// A contiguous row-major (C order) view of `data` with the given sizes.
  TensorView(T* ptr, std::initializer_list<int64_t> sizes) : data(ptr) {
    set_contiguous(sizes.begin(), static_cast<int>(sizes.size()));
  }

  /// A contiguous row-major (C order) view of `ptr` with the sizes `sizes[0..r)` (r <= kMaxRank).
  TensorView(T* ptr, const int64_t* sizes, int r) : data(ptr) { set_contiguous(sizes, r); }

  /// A strided view: `strides` in elements, one per dimension.
  TensorView(T* ptr, std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides)
      : data(ptr), rank(static_cast<int>(sizes.size())) {
    int i = 0;
    for (int64_t s : sizes) size[i++] = s;
    i = 0;
    for (int64_t s : strides) {
      if (i < kMaxRank) stride[i] = s;
      ++i;
    }
    if (i != rank) rank = -1;  // rejected by validation: sizes and strides disagree
  }

  /// Implicit conversion from a view of T to a view of const T.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  TensorView(const TensorView<U>& o) : data(o.data), rank(o.rank), size(o.size), stride(o.stride) {}

  /// Sets rank, sizes and C-order strides (the data pointer is unchanged). A stride whose product overflows int64
  /// saturates at INT64_MAX; validation refuses such a view (its size is checked separately).
  void set_contiguous(const int64_t* sizes, int r) {
    rank = r;
    int64_t st = 1;
    for (int d = r - 1; d >= 0; --d) {
      size[d] = sizes[d];
      stride[d] = st;
      if (__builtin_mul_overflow(st, sizes[d], &st)) st = std::numeric_limits<int64_t>::max();
    }
  }

  /// True when the view refers to data.
  bool present() const { return data != nullptr; }

  /// Number of elements (INT64_MAX when the product overflows int64 and no size is 0).
  int64_t numel() const {
    for (int d = 0; d < rank; ++d)
      if (size[d] == 0) return 0;
    int64_t n = 1;
    for (int d = 0; d < rank; ++d)
      if (__builtin_mul_overflow(n, size[d], &n)) return std::numeric_limits<int64_t>::max();
    return n;
  }

  /// True when the elements are laid out densely in C order.
  bool contiguous() const {
    int64_t st = 1;
    for (int d = rank - 1; d >= 0; --d) {
      if (size[d] != 1 && stride[d] != st) return false;
      if (__builtin_mul_overflow(st, size[d], &st)) st = std::numeric_limits<int64_t>::max();
    }
    return true;
  }

  /// Element access by full index (no bounds checks).
  T& operator()(int64_t i0) const { return data[i0 * stride[0]]; }
  T& operator()(int64_t i0, int64_t i1) const { return data[i0 * stride[0] + i1 * stride[1]]; }
  T& operator()(int64_t i0, int64_t i1, int64_t i2) const {
    return data[i0 * stride[0] + i1 * stride[1] + i2 * stride[2]];
  }
  T& operator()(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return data[i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]];
  }

  /// Pointer to the start of the innermost (contiguous) row selected by the leading indices.
  T* row(int64_t i0, int64_t i1, int64_t i2) const { return data + i0 * stride[0] + i1 * stride[1] + i2 * stride[2]; }
  T* row(int64_t i0, int64_t i1) const { return data + i0 * stride[0] + i1 * stride[1]; }

  /// "[2, 64, 4, 16]"
  std::string shape_string() const {
    std::string s = "[";
    for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(size[d]);
    return s + "]";
  }
};

/// A contiguous view of `ptr` with the given sizes (C order).
template <class T>
TensorView<T> view(T* ptr, std::initializer_list<int64_t> sizes) {
  return TensorView<T>(ptr, sizes);
}

/// A contiguous view of `ptr` with sizes known at run time (C order, at most kMaxRank of them).
template <class T>
TensorView<T> view(T* ptr, const std::vector<int64_t>& sizes) {
  return TensorView<T>(ptr, sizes.data(), static_cast<int>(sizes.size()));
}

}  // namespace dgps
