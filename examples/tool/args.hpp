/// @brief Command-line options of the dgps tool: declared per command, parsed strictly, documented in --help.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dgps_tool {

/// A malformed command line (unknown option, missing or bad value). The tool prints the message and
/// the command's usage line, and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One option a command accepts: `--name VALUE` (or `--name=VALUE`) when `value` is non-empty, else a flag.
struct OptionSpec {
  std::string name;   ///< without the leading dashes
  std::string value;  ///< placeholder shown in the help ("DIR", "N"); empty for a flag
  std::string help;   ///< one line
};

/// The options given to one command, checked against its OptionSpec list.
class Args {
 public:
  /// Parses `argv[first..argc)`. Throws UsageError for an unknown or repeated option, a missing value,
  /// or a positional argument. `--help` is recognised as a flag by every command.
  Args(const std::vector<OptionSpec>& specs, int argc, char** argv, int first);

  /// True when the option (or flag) was given.
  bool has(std::string_view name) const;
  /// The option's value, or `fallback` when absent.
  std::string text(std::string_view name, const std::string& fallback = {}) const;
  /// The option's value; throws UsageError when absent.
  std::string required(std::string_view name) const;
  /// The option's value as a finite number, or `fallback`; throws UsageError when it is not a number.
  double number(std::string_view name, double fallback) const;
  /// The option's value as an integer in [min, max], or `fallback`; throws UsageError for trailing text, a value
  /// out of range or one int64 cannot hold.
  int64_t integer(std::string_view name, int64_t fallback, int64_t min,
                  int64_t max = std::numeric_limits<int64_t>::max()) const;

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

/// The help text of an option list: one line per option, aligned.
std::string options_help(const std::vector<OptionSpec>& specs);

}  // namespace dgps_tool
