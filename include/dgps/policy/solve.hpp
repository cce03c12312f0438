/// @brief Solve axis (SPEC §2): residual (delta-rule) or accumulating write.
#pragma once

namespace dgps::solve {

/// Identifiers usable at run time.
enum class Kind { online, offline };

/// Delta rule: S_t = Sbar + b kw (v - Sbar^T k)^T.
struct Online {
  static constexpr Kind kind = Kind::online;
  static constexpr const char* name = "online";
};

/// Linear attention: S_t = Sbar + b kw v^T.
struct Offline {
  static constexpr Kind kind = Kind::offline;
  static constexpr const char* name = "offline";
};

}  // namespace dgps::solve
