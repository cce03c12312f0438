/// @brief dgps::Error, the one exception type the library throws for a bad call.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

#include "dgps/export.hpp"

namespace dgps {

/// Thrown for every malformed call (wrong shape, missing input, bad option, unavailable backend).
/// The message names the tensor or option and gives what was expected and what was received.
/// When a call throws, none of its outputs have been written.
class DGPS_API Error : public std::runtime_error {
 public:
  /// The prefix of every message.
  static constexpr const char* prefix = "dgps: ";
  explicit Error(const std::string& what) : std::runtime_error(prefix + what) {}
  /// The message of `e` without the prefix, to pass it on inside another Error (any other exception's
  /// message unchanged).
  static std::string message_of(const std::exception& e) {
    const std::string w = e.what(), pre = prefix;
    return w.compare(0, pre.size(), pre) == 0 ? w.substr(pre.size()) : w;
  }
};

}  // namespace dgps
