/// @brief Strict parsing of the dgps tool's options (see args.hpp).
#include "args.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace dgps_tool {

Args::Args(const std::vector<OptionSpec>& specs, int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0)
      throw UsageError("unexpected argument '" + arg + "' (options start with --)");
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (name == "help" && !inline_value) {
      values_["help"] = "";
      continue;
    }
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const OptionSpec& s) { return s.name == name; });
    if (spec == specs.end()) throw UsageError("unknown option '--" + name + "'");
    if (values_.count(name)) throw UsageError("option '--" + name + "' given twice");
    if (spec->value.empty()) {
      if (inline_value) throw UsageError("option '--" + name + "' takes no value");
    } else if (!inline_value) {
      if (i + 1 >= argc) throw UsageError("option '--" + name + "' needs a value " + spec->value);
      value = argv[++i];
    }
    values_[name] = value;
  }
}

bool Args::has(std::string_view name) const { return values_.find(name) != values_.end(); }

std::string Args::text(std::string_view name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::string Args::required(std::string_view name) const {
  const auto it = values_.find(name);
  if (it == values_.end()) throw UsageError("option '--" + std::string(name) + "' is required");
  return it->second;
}

double Args::number(std::string_view name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string s = text(name);
  double v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v))
    throw UsageError("option '--" + std::string(name) + "': '" + s + "' is not a finite number");
  return v;
}

int64_t Args::integer(std::string_view name, int64_t fallback, int64_t min, int64_t max) const {
  if (!has(name)) return fallback;
  const std::string s = text(name);
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range)
    throw UsageError("option '--" + std::string(name) + "': '" + s + "' is out of range");
  if (ec != std::errc() || ptr != s.data() + s.size())
    throw UsageError("option '--" + std::string(name) + "': '" + s + "' is not an integer");
  if (v < min || v > max)
    throw UsageError("option '--" + std::string(name) + "' must be in [" + std::to_string(min) + ", " +
                     std::to_string(max) + "], got " + s);
  return v;
}

std::string options_help(const std::vector<OptionSpec>& specs) {
  size_t width = 0;
  for (const auto& s : specs) width = std::max(width, s.name.size() + s.value.size() + 3);
  std::string out;
  for (const auto& s : specs) {
    std::string left = "--" + s.name + (s.value.empty() ? "" : " " + s.value);
    left.resize(width, ' ');
    out += "  " + left + "  " + s.help + "\n";
  }
  return out;
}

}  // namespace dgps_tool
