/// @brief Model, backend and math options of the dgps tool (see common.hpp).
#include "common.hpp"

#include <limits>

#include <dgps/backend.hpp>
#include <dgps/error.hpp>

namespace dgps_tool {

std::vector<OptionSpec> model_options() {
  return {
      {"model", "NAME", "la mamba2 gla dn gdn kda pdn pgdn pkda pmamba2 mesa ridge (or the four axes below)"},
      {"decay", "D", "none | scalar | diagonal"},
      {"gain", "G", "unit | scalar"},
      {"precond", "P", "identity | diag-atk | diag-atq | exact-atk | exact-atq"},
      {"solve", "S", "online | offline"},
  };
}

std::vector<OptionSpec> backend_options() {
  return {
      {"backend", "B", "automatic (default) | reference | cpu | cuda (float32 on the GPU; float64 files are converted)"},
      {"algorithm", "A", "automatic (default) | recurrent | chunkwise"},
      {"threads", "N", "CPU threads, 0 = all (default)"},
  };
}

std::vector<OptionSpec> math_options() {
  return {
      {"no-l2norm", "", "do not L2-normalise q and k (default: normalise)"},
      {"scale", "S", "multiplies q (default 1/sqrt(K))"},
      {"x", "X", "squash bound of the diagonal preconditioners (default 1.5)"},
      {"eps", "E", "inside log(A + eps) (default 1e-6)"},
      {"lambda", "L", "ridge of the exact preconditioners, P0 = I/lambda (default 1)"},
  };
}

std::vector<OptionSpec> join(std::vector<std::vector<OptionSpec>> lists) {
  std::vector<OptionSpec> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

namespace {

/// The enum value of an axis option, accepting '-' or '_' spellings; UsageError for an unknown value.
template <class E, size_t N>
E pick(const Args& args, const char* option, const char* const (&names)[N], const E (&kinds)[N]) {
  const std::string v = args.text(option);
  std::string choices;
  for (size_t i = 0; i < N; ++i) {
    std::string n = names[i];
    if (v == n) return kinds[i];
    for (char& c : n) c = c == '-' ? '_' : c;
    if (v == n) return kinds[i];  // case.json spelling: diag_atk
    choices += (i ? " | " : "") + std::string(names[i]);
  }
  throw UsageError("option '--" + std::string(option) + "': unknown value '" + v + "' (expected " + choices + ")");
}

}  // namespace

dgps::ModelSpec model_from(const Args& args) {
  const char* axes[] = {"decay", "gain", "precond", "solve"};
  int given = 0;
  for (const char* a : axes) given += args.has(a) ? 1 : 0;
  if (args.has("model")) {
    if (given) throw UsageError("give either --model or the four axes (--decay --gain --precond --solve), not both");
    return dgps::model_by_name(args.text("model"));
  }
  if (given != 4) throw UsageError("choose a model: --model NAME, or all four of --decay --gain --precond --solve");
  using namespace dgps;
  ModelSpec s;
  s.decay = pick(args, "decay", {"none", "scalar", "diagonal"},
                 {decay::Kind::none, decay::Kind::scalar, decay::Kind::diagonal});
  s.gain = pick(args, "gain", {"unit", "scalar"}, {gain::Kind::unit, gain::Kind::scalar});
  s.precond = pick(args, "precond", {"identity", "diag-atk", "diag-atq", "exact-atk", "exact-atq"},
                   {precond::Kind::identity, precond::Kind::diagonal_atk, precond::Kind::diagonal_atq,
                    precond::Kind::exact_atk, precond::Kind::exact_atq});
  s.solve = pick(args, "solve", {"online", "offline"}, {solve::Kind::online, solve::Kind::offline});
  return s;
}

dgps::Options options_from(const Args& args) {
  dgps::Options o;
  o.backend = dgps::backend_from_string(args.text("backend", "automatic"));
  o.algorithm = dgps::algorithm_from_string(args.text("algorithm", "automatic"));
  o.threads = static_cast<int>(args.integer("threads", 0, 0, std::numeric_limits<int>::max()));
  o.l2norm_qk = !args.has("no-l2norm");
  if (args.has("scale")) o.scale = args.number("scale", 0);
  o.x = args.number("x", o.x);
  o.eps = args.number("eps", o.eps);
  o.lambda = args.number("lambda", o.lambda);
  return o;
}

std::string model_label(const dgps::ModelSpec& spec) {
  for (const auto& [name, s] : dgps::kNamedModels)
    if (s == spec) return std::string(name);
  return "custom";
}

}  // namespace dgps_tool
