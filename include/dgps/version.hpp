/// @brief Library version.
#pragma once

#define DGPS_VERSION_MAJOR 0
#define DGPS_VERSION_MINOR 1
#define DGPS_VERSION_PATCH 0

namespace dgps {
/// "0.1.0"
inline constexpr const char* version_string = "0.1.0";
}  // namespace dgps
