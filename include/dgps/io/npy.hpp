/// @brief Minimal, strict .npy reader and writer (NumPy format 1.0-3.0; little-endian f4/f8/i4/i8, C order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "dgps/error.hpp"

namespace dgps::npy {

/// Element types the library reads and writes.
enum class DType { f32, f64, i32, i64 };

/// Bytes per element.
inline size_t item_size(DType d) { return (d == DType::f32 || d == DType::i32) ? 4 : 8; }
/// NumPy descr string ("<f4", "<f8", "<i4", "<i8").
inline const char* descr(DType d) {
  static constexpr const char* n[] = {"<f4", "<f8", "<i4", "<i8"};
  return n[int(d)];
}

/// An array read from or to be written to a .npy file: raw little-endian bytes plus shape and type.
struct Array {
  DType dtype = DType::f64;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  /// Number of elements.
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  /// The elements converted to T (any of float, double, int32_t, int64_t).
  template <class T>
  std::vector<T> as() const {
    std::vector<T> out(static_cast<size_t>(numel()));
    for (size_t i = 0; i < out.size(); ++i) {
      const unsigned char* p = bytes.data() + i * item_size(dtype);
      switch (dtype) {
        case DType::f32: { float v; std::memcpy(&v, p, 4); out[i] = static_cast<T>(v); break; }
        case DType::f64: { double v; std::memcpy(&v, p, 8); out[i] = static_cast<T>(v); break; }
        case DType::i32: { int32_t v; std::memcpy(&v, p, 4); out[i] = static_cast<T>(v); break; }
        case DType::i64: { int64_t v; std::memcpy(&v, p, 8); out[i] = static_cast<T>(v); break; }
      }
    }
    return out;
  }
  /// Makes an array of the given type and shape from values of type T.
  template <class T>
  static Array from(DType dt, std::vector<int64_t> shape, const T* values) {
    Array a;
    a.dtype = dt;
    a.shape = std::move(shape);
    const int64_t n = a.numel();
    a.bytes.resize(static_cast<size_t>(n) * item_size(dt));
    for (int64_t i = 0; i < n; ++i) {
      unsigned char* p = a.bytes.data() + i * item_size(dt);
      switch (dt) {
        case DType::f32: { float v = static_cast<float>(values[i]); std::memcpy(p, &v, 4); break; }
        case DType::f64: { double v = static_cast<double>(values[i]); std::memcpy(p, &v, 8); break; }
        case DType::i32: { int32_t v = static_cast<int32_t>(values[i]); std::memcpy(p, &v, 4); break; }
        case DType::i64: { int64_t v = static_cast<int64_t>(values[i]); std::memcpy(p, &v, 8); break; }
      }
    }
    return a;
  }
};

namespace detail {
inline std::string value_of(const std::string& h, const std::string& key, const std::string& path) {
  const auto k = h.find("'" + key + "'");
  if (k == std::string::npos) throw Error(path + ": malformed .npy header (no '" + key + "')");
  auto c = h.find(':', k);
  if (c == std::string::npos) throw Error(path + ": malformed .npy header");
  ++c;
  while (c < h.size() && h[c] == ' ') ++c;
  if (c < h.size() && (h[c] == '\'' || h[c] == '(')) {
    const char close = h[c] == '\'' ? '\'' : ')';
    const auto e = h.find(close, c + 1);
    if (e == std::string::npos) throw Error(path + ": malformed .npy header");
    return h.substr(c + 1, e - c - 1);
  }
  auto e = h.find_first_of(",}", c);
  return h.substr(c, e - c);
}
}  // namespace detail

/// Reads a .npy file. Throws dgps::Error naming the file for: a missing file, bad magic, an
/// unsupported version or dtype (only little-endian f4, f8, i4, i8), Fortran order, a malformed
/// header, or data shorter (or longer) than the shape says.
inline Array read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open file");
  std::vector<unsigned char> all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (all.size() < 10 || std::memcmp(all.data(), magic, 6) != 0) throw Error(path + ": not a .npy file (bad magic)");
  const int major = all[6];
  size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = all[8] | (size_t(all[9]) << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (all.size() < 12) throw Error(path + ": truncated .npy header");
    hlen = all[8] | (size_t(all[9]) << 8) | (size_t(all[10]) << 16) | (size_t(all[11]) << 24);
    hstart = 12;
  } else {
    throw Error(path + ": unsupported .npy version " + std::to_string(major));
  }
  if (all.size() < hstart + hlen) throw Error(path + ": truncated .npy header");
  const std::string h(all.begin() + hstart, all.begin() + hstart + hlen);
  Array a;
  const std::string d = detail::value_of(h, "descr", path);
  if (d == "<f4") a.dtype = DType::f32;
  else if (d == "<f8") a.dtype = DType::f64;
  else if (d == "<i4") a.dtype = DType::i32;
  else if (d == "<i8") a.dtype = DType::i64;
  else throw Error(path + ": unsupported dtype '" + d + "' (expected <f4, <f8, <i4 or <i8)");
  const std::string fo = detail::value_of(h, "fortran_order", path);
  if (fo.find("True") != std::string::npos) throw Error(path + ": Fortran-order arrays are not supported");
  if (fo.find("False") == std::string::npos) throw Error(path + ": malformed .npy header (fortran_order)");
  const std::string sh = detail::value_of(h, "shape", path);
  size_t i = 0;
  while (i < sh.size()) {
    while (i < sh.size() && (sh[i] == ' ' || sh[i] == ',')) ++i;
    if (i >= sh.size()) break;
    size_t j = i;
    while (j < sh.size() && sh[j] >= '0' && sh[j] <= '9') ++j;
    if (j == i) throw Error(path + ": malformed .npy shape '(" + sh + ")'");
    a.shape.push_back(std::stoll(sh.substr(i, j - i)));
    i = j;
  }
  const size_t want = static_cast<size_t>(a.numel()) * item_size(a.dtype);
  const size_t have = all.size() - hstart - hlen;
  if (have < want)
    throw Error(path + ": truncated data (" + std::to_string(have) + " bytes, shape needs " + std::to_string(want) + ")");
  if (have > want)
    throw Error(path + ": " + std::to_string(have - want) + " bytes of trailing data after the array");
  a.bytes.assign(all.begin() + hstart + hlen, all.end());
  return a;
}

/// Writes `a` as a version 1.0 .npy file; throws dgps::Error if the file cannot be written.
inline void write(const std::string& path, const Array& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i) shape += std::to_string(a.shape[i]) + (a.shape.size() == 1 ? "," : i + 1 < a.shape.size() ? ", " : "");
  shape += ")";
  std::string h = std::string("{'descr': '") + descr(a.dtype) + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot write file");
  const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<unsigned char>(h.size() & 0xff),
                                 static_cast<unsigned char>(h.size() >> 8)};
  f.write(reinterpret_cast<const char*>(pre), 10);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  f.write(reinterpret_cast<const char*>(a.bytes.data()), static_cast<std::streamsize>(a.bytes.size()));
  if (!f) throw Error(path + ": write failed");
}

}  // namespace dgps::npy
