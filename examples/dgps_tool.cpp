/// @brief The `dgps` command-line tool: info, run, grad and bench on top of dgps::dynamic.
///
/// Exit status: 0 on success; 2 for a usage error, a bad input file or a call the library rejects
/// (one line on stderr, and no output files written); 1 for an unexpected internal failure.
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <dgps/error.hpp>

#include "tool/args.hpp"
#include "tool/commands.hpp"
#include "tool/input_dir.hpp"

namespace {

using dgps_tool::Args;
using dgps_tool::OptionSpec;

/// One subcommand: its name, help texts, options and entry point.
struct Command {
  const char* name;
  const char* summary;
  const char* usage;
  std::vector<OptionSpec> options;
  int (*run)(const Args&);
};

/// Every subcommand, in the order `dgps --help` lists them.
std::vector<Command> commands() {
  return {
      {"info", "version, backends, CPU ISA, threads and CUDA devices", "dgps info", {}, dgps_tool::cmd_info},
      {"run", "forward pass on .npy inputs, writes o.npy, hT.npy (and aT.npy)",
       "dgps run --model NAME --in DIR --out DIR [options]", dgps_tool::run_options(),
       [](const Args& a) { return dgps_tool::cmd_run(a, false); }},
      {"grad", "backward pass on .npy inputs and cotangents, writes d<input>.npy",
       "dgps grad --model NAME --in DIR --out DIR [options]", dgps_tool::run_options(),
       [](const Args& a) { return dgps_tool::cmd_run(a, true); }},
      {"bench", "times forward, backward or decode on synthetic inputs, ends with 'tokens/s: N'",
       "dgps bench --model NAME --time T --heads H --key-dim K --value-dim V [options]", dgps_tool::bench_options(),
       dgps_tool::cmd_bench},
  };
}

/// `dgps --help`.
void print_help() {
  std::printf(
      "usage: dgps <command> [options]\n\nDGPS linear recurrences (linear attention, Mamba-2, GLA, DeltaNet, "
      "GDN, KDA, PDN, PGDN, PKDA, P-Mamba-2, Mesa, ridge) on .npy files.\n\ncommands:\n");
  for (const auto& c : commands()) std::printf("  %-6s %s\n", c.name, c.summary);
  std::printf(
      "\nRun 'dgps <command> --help' for the options of a command.\n"
      "Exit status: 0 success, 2 usage error or bad input (nothing written), 1 internal error.\n");
}

/// `dgps <command> --help`: usage, notes and every option.
void print_command_help(const Command& c) {
  std::printf("usage: %s\n\n%s.\n", c.usage, c.summary);
  if (std::strcmp(c.name, "run") == 0 || std::strcmp(c.name, "grad") == 0)
    std::printf(
        "\nInputs are the .npy files of SPEC section 1 present in --in (float32 or float64, one dtype for "
        "all;\ncu_seqlens int32 or int64); the shape is taken from q, v and cu_seqlens. Outputs are written "
        "in the\ninput dtype, only after the whole computation succeeded.\n");
  if (std::strcmp(c.name, "grad") == 0)
    std::printf(
        "The gradients are those of loss = sum(o*do) + sum(hT*dhT) + sum(aT*daT), one d<name>.npy per input "
        "present\n(q k v g beta g_p beta_p center h0 a0). With an exact preconditioner da0 is the raw gradient; "
        "its\nsymmetric part is the gradient with respect to a symmetric P0.\n");
  if (std::strcmp(c.name, "bench") == 0)
    std::printf(
        "\nTokens are B*T per run; in decode mode a run is T steps of one token for each of the B "
        "sequences.\n");
  std::vector<OptionSpec> options = c.options;
  options.push_back({"help", "", "print this text"});
  std::printf("\noptions:\n%s", dgps_tool::options_help(options).c_str());
}

/// The message without the library's "dgps: " prefix, on one line: line breaks become spaces, other control bytes
/// (from file names or file contents) are written as \xNN.
std::string one_line(const char* what) {
  std::string m = what, out;
  if (m.rfind("dgps: ", 0) == 0) m.erase(0, 6);
  static constexpr char hex[] = "0123456789abcdef";
  for (char ch : m) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n' || c == '\r') {
      out.push_back(' ');
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    } else {
      out.push_back(ch);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_help();
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_help();
    return 0;
  }
  const auto all = commands();
  const Command* cmd = nullptr;
  for (const auto& c : all)
    if (name == c.name) cmd = &c;
  if (!cmd) {
    std::fprintf(stderr,
                 "dgps: error: unknown command '%s'\nusage: dgps <command> [options] (commands: info run grad "
                 "bench; see dgps --help)\n",
                 one_line(name.c_str()).c_str());
    return 2;
  }
  try {
    const Args args(cmd->options, argc, argv, 2);
    if (args.has("help")) {
      print_command_help(*cmd);
      return 0;
    }
    return cmd->run(args);
  } catch (const dgps_tool::UsageError& e) {
    std::fprintf(stderr, "dgps %s: error: %s\nusage: %s (see dgps %s --help)\n", cmd->name, one_line(e.what()).c_str(),
                 cmd->usage, cmd->name);
  } catch (const dgps_tool::InputError& e) {
    std::fprintf(stderr, "dgps: error: %s\n", one_line(e.what()).c_str());
  } catch (const dgps::Error& e) {
    std::fprintf(stderr, "dgps: error: %s\n", one_line(e.what()).c_str());
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "dgps: error: %s\n", one_line(e.what()).c_str());
  } catch (const std::bad_alloc&) {  // a resource limit, not a bug: sizes the machine cannot hold
    std::fprintf(stderr, "dgps: error: out of memory for the requested sizes\n");
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "dgps: error: requested sizes too large (%s)\n", one_line(e.what()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dgps: internal error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
  return 2;
}
