/// @brief DGPS_API: the symbols a shared dgps build (BUILD_SHARED_LIBS, hidden visibility) exports.
///
/// The compiled libraries (the CPU kernels, dgps::dynamic) are built with -fvisibility=hidden when shared; their entry
/// points and the types that cross the library boundary (dgps::Error) carry DGPS_API. In a static build it changes
/// nothing.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define DGPS_API __attribute__((visibility("default")))
#else
#define DGPS_API
#endif
