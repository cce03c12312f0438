/// @brief Minimal, strict .npy reader and writer (NumPy format 1.0-3.0; little-endian f4/f8/i4/i8, C order; POSIX).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
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

  /// Number of elements; throws dgps::Error when a field is negative or the count overflows int64.
  int64_t numel() const {
    for (int64_t s : shape)
      if (s == 0) return 0;
    int64_t n = 1;
    for (int64_t s : shape)
      if (s < 0 || __builtin_mul_overflow(n, s, &n)) throw Error("npy: shape has no valid element count");
    return n;
  }
  /// The elements converted to T (any of float, double, int32_t, int64_t).
  template <class T>
  std::vector<T> as() const {
    std::vector<T> out(static_cast<size_t>(numel()));
    for (size_t i = 0; i < out.size(); ++i) {
      const unsigned char* p = bytes.data() + i * item_size(dtype);
      switch (dtype) {
        case DType::f32: {
          float v;
          std::memcpy(&v, p, 4);
          out[i] = static_cast<T>(v);
          break;
        }
        case DType::f64: {
          double v;
          std::memcpy(&v, p, 8);
          out[i] = static_cast<T>(v);
          break;
        }
        case DType::i32: {
          int32_t v;
          std::memcpy(&v, p, 4);
          out[i] = static_cast<T>(v);
          break;
        }
        case DType::i64: {
          int64_t v;
          std::memcpy(&v, p, 8);
          out[i] = static_cast<T>(v);
          break;
        }
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
        case DType::f32: {
          float v = static_cast<float>(values[i]);
          std::memcpy(p, &v, 4);
          break;
        }
        case DType::f64: {
          double v = static_cast<double>(values[i]);
          std::memcpy(p, &v, 8);
          break;
        }
        case DType::i32: {
          int32_t v = static_cast<int32_t>(values[i]);
          std::memcpy(p, &v, 4);
          break;
        }
        case DType::i64: {
          int64_t v = static_cast<int64_t>(values[i]);
          std::memcpy(p, &v, 8);
          break;
        }
      }
    }
    return a;
  }
};

namespace detail {

/// `s` with every byte outside printable ASCII written as \xNN, so that a hostile header cannot inject control
/// sequences into a message.
inline std::string printable(std::string_view s, size_t max_len = 80) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_len; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  if (s.size() > max_len) out += "...";
  return out;
}

/// `a * b` for non-negative values; false when it exceeds INT64_MAX.
inline bool mul_fits(int64_t a, int64_t b, int64_t& r) { return !__builtin_mul_overflow(a, b, &r); }

/// A strict parser of the header dictionary, the subset of Python literals numpy writes:
/// {'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), } with exactly these three keys.
class HeaderParser {
 public:
  HeaderParser(std::string_view h, const std::string& path) : h_(h), path_(path) {}

  void parse(std::string& descr, bool& fortran, std::vector<int64_t>& shape) {
    bool seen[3] = {false, false, false};
    expect('{');
    for (;;) {
      skip();
      if (peek() == '}') break;
      const std::string key = string_literal();
      expect(':');
      int k = key == "descr" ? 0 : key == "fortran_order" ? 1 : key == "shape" ? 2 : -1;
      if (k < 0) fail("unexpected key '" + printable(key) + "'");
      if (seen[k]) fail("key '" + key + "' given twice");
      seen[k] = true;
      if (k == 0) descr = string_literal();
      if (k == 1) fortran = boolean();
      if (k == 2) shape = tuple();
      skip();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      if (peek() != '}') fail("expected ',' or '}'");
    }
    ++i_;
    skip();
    if (i_ != h_.size()) fail("unexpected text after the dictionary");
    if (!seen[0] || !seen[1] || !seen[2])
      fail(std::string("missing key '") + (!seen[0] ? "descr" : !seen[1] ? "fortran_order" : "shape") + "'");
  }

 private:
  std::string_view h_;
  const std::string& path_;
  size_t i_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path_ + ": malformed .npy header (" + what + ")");
  }
  char peek() const { return i_ < h_.size() ? h_[i_] : '\0'; }
  void skip() {
    while (i_ < h_.size() && (h_[i_] == ' ' || h_[i_] == '\t' || h_[i_] == '\n' || h_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    skip();
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string_literal() {
    skip();
    const char q = peek();
    if (q != '\'' && q != '"') fail("expected a quoted string");
    const size_t e = h_.find(q, i_ + 1);
    if (e == std::string_view::npos) fail("unterminated string");
    std::string s(h_.substr(i_ + 1, e - i_ - 1));
    if (s.find('\\') != std::string::npos) fail("escape sequence in a string");
    i_ = e + 1;
    return s;
  }
  bool boolean() {
    skip();
    if (h_.substr(i_, 4) == "True") {
      i_ += 4;
      return true;
    }
    if (h_.substr(i_, 5) == "False") {
      i_ += 5;
      return false;
    }
    fail("fortran_order must be True or False");
  }
  /// A tuple of non-negative integers: (), (n,), (a, b) or (a, b,).
  std::vector<int64_t> tuple() {
    std::vector<int64_t> out;
    expect('(');
    bool comma_after_last = false;
    for (;;) {
      skip();
      if (peek() == ')') break;
      if (!out.empty() && !comma_after_last) fail("shape fields must be separated by commas");
      if (peek() < '0' || peek() > '9') fail("shape fields must be non-negative integers");
      int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (!mul_fits(v, 10, v) || __builtin_add_overflow(v, peek() - '0', &v)) fail("shape field too large for int64");
        ++i_;
      }
      out.push_back(v);
      skip();
      comma_after_last = peek() == ',';
      if (comma_after_last) ++i_;
    }
    ++i_;
    if (out.size() == 1 && !comma_after_last) fail("a one-field shape needs a trailing comma: (n,)");
    return out;
  }
};

}  // namespace detail

/// Bytes of an array of type `dtype` and shape `shape`; throws dgps::Error (prefixed with `what`) when the element
/// count or the byte count exceeds INT64_MAX, or a field is negative.
inline int64_t byte_size(DType dtype, const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  bool zero = false;
  for (int64_t s : shape) {
    if (s < 0) throw Error(what + ": negative shape field " + std::to_string(s));
    if (s == 0) zero = true;
    if (!zero && !detail::mul_fits(n, s, n)) throw Error(what + ": shape " + "has more elements than int64 can count");
  }
  if (zero) return 0;
  int64_t bytes = 0;
  if (!detail::mul_fits(n, static_cast<int64_t>(item_size(dtype)), bytes))
    throw Error(what + ": shape needs more bytes than int64 can count");
  return bytes;
}

/// Reads a .npy file. Throws dgps::Error naming the file for: a missing or non-regular file (a directory, a FIFO,
/// a device), bad magic, an unsupported version or dtype (only little-endian f4, f8, i4, i8), Fortran order, a
/// header numpy would reject, a shape whose size overflows int64, or data shorter (or longer) than the shape says.
/// Header text quoted in a message has its control bytes escaped.
inline Array read(const std::string& path) {
  const std::string name = detail::printable(path, 4096);
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses anything but a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error(name + ": cannot open file (" + std::strerror(errno) + ")");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(name + ": cannot stat file");
  if (!S_ISREG(st.st_mode))
    throw Error(name + (S_ISDIR(st.st_mode) ? ": is a directory, not a .npy file" : ": not a regular file"));
  const int64_t file_size = static_cast<int64_t>(st.st_size);
  auto read_exact = [&](unsigned char* dst, int64_t n) {
    while (n > 0) {
      const ssize_t got = ::read(fd, dst, static_cast<size_t>(std::min<int64_t>(n, int64_t(1) << 30)));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw Error(name + ": read failed or file shrank while reading");
      dst += got;
      n -= got;
    }
  };
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  unsigned char pre[12];
  if (file_size < 10) throw Error(name + ": not a .npy file (bad magic)");
  read_exact(pre, 10);
  if (std::memcmp(pre, magic, 6) != 0) throw Error(name + ": not a .npy file (bad magic)");
  const int major = pre[6];
  int64_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = pre[8] | (int64_t(pre[9]) << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (file_size < 12) throw Error(name + ": truncated .npy header");
    read_exact(pre + 10, 2);
    hlen = pre[8] | (int64_t(pre[9]) << 8) | (int64_t(pre[10]) << 16) | (int64_t(pre[11]) << 24);
    hstart = 12;
  } else {
    throw Error(name + ": unsupported .npy version " + std::to_string(major));
  }
  if (file_size - hstart < hlen) throw Error(name + ": truncated .npy header");
  std::string h(static_cast<size_t>(hlen), '\0');
  read_exact(reinterpret_cast<unsigned char*>(h.data()), hlen);
  if (hlen == 0 || h.back() != '\n') throw Error(name + ": malformed .npy header (no terminating newline)");
  Array a;
  std::string d;
  bool fortran = false;
  detail::HeaderParser(h, name).parse(d, fortran, a.shape);
  if (d == "<f4")
    a.dtype = DType::f32;
  else if (d == "<f8")
    a.dtype = DType::f64;
  else if (d == "<i4")
    a.dtype = DType::i32;
  else if (d == "<i8")
    a.dtype = DType::i64;
  else
    throw Error(name + ": unsupported dtype '" + detail::printable(d) + "' (expected <f4, <f8, <i4 or <i8)");
  if (fortran) throw Error(name + ": Fortran-order arrays are not supported");
  const int64_t want = byte_size(a.dtype, a.shape, name);
  const int64_t have = file_size - hstart - hlen;
  if (have < want)
    throw Error(name + ": truncated data (" + std::to_string(have) + " bytes, shape needs " + std::to_string(want) +
                ")");
  if (have > want) throw Error(name + ": " + std::to_string(have - want) + " bytes of trailing data after the array");
  a.bytes.resize(static_cast<size_t>(want));
  read_exact(a.bytes.data(), want);
  return a;
}

/// Writes `a` as a version 1.0 .npy file; throws dgps::Error if the file cannot be written.
inline void write(const std::string& path, const Array& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i)
    shape += std::to_string(a.shape[i]) + (a.shape.size() == 1 ? "," : i + 1 < a.shape.size() ? ", " : "");
  shape += ")";
  std::string h = std::string("{'descr': '") + descr(a.dtype) + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot write file");
  const unsigned char pre[10] = {0x93,
                                 'N',
                                 'U',
                                 'M',
                                 'P',
                                 'Y',
                                 1,
                                 0,
                                 static_cast<unsigned char>(h.size() & 0xff),
                                 static_cast<unsigned char>(h.size() >> 8)};
  f.write(reinterpret_cast<const char*>(pre), 10);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  f.write(reinterpret_cast<const char*>(a.bytes.data()), static_cast<std::streamsize>(a.bytes.size()));
  if (!f) throw Error(path + ": write failed");
}

}  // namespace dgps::npy
