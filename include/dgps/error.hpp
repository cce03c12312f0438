/// @brief dgps::Error, the one exception type the library throws for a bad call.
#pragma once

#include <stdexcept>
#include <string>

#include "dgps/export.hpp"

namespace dgps {

/// Thrown for every malformed call (wrong shape, missing input, bad option, unavailable backend).
/// The message names the tensor or option and gives what was expected and what was received.
/// When a call throws, none of its outputs have been written.
class DGPS_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error("dgps: " + what) {}
};

}  // namespace dgps
