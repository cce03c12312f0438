/// @brief The `dgps` tool end to end: run/grad round trips on conformance cases, malformed inputs, info, bench.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <dgps/cuda.hpp>

#include "../support.hpp"

using namespace dgps_test;

namespace {

/// A fresh directory under the system temp dir, removed with its contents at the end of the scope.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("dgps_cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter.fetch_add(1)));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

/// The contents of a file (empty when it does not exist).
std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// The result of one tool invocation.
struct Run {
  int status = -1;
  std::string out, err;
};

/// Runs `dgps <args>` with stdout and stderr captured in `tmp`, under a 60 s `timeout` (status 124: it hung).
Run tool(const std::string& args, const TempDir& tmp) {
  const std::string out = tmp / "stdout.txt", err = tmp / "stderr.txt";
  const std::string cmd =
      std::string("timeout 60 '") + DGPS_TOOL + "' " + args + " >'" + out + "' 2>'" + err + "' </dev/null";
  const int rc = std::system(cmd.c_str());
  Run r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

/// A path quoted for the shell.
std::string quote(const std::string& s) { return "'" + s + "'"; }

/// Tool options that select the case's model and SPEC options (as case.json gives them).
std::string case_options(const Case& c) {
  static constexpr const char* dn[] = {"none", "scalar", "diagonal"};
  static constexpr const char* gn[] = {"unit", "scalar"};
  static constexpr const char* pn[] = {"identity", "diag-atk", "diag-atq", "exact-atk", "exact-atq"};
  static constexpr const char* sn[] = {"online", "offline"};
  char num[160];
  std::snprintf(num, sizeof num, " --scale %.17g --x %.17g --eps %.17g --lambda %.17g", *c.opt.scale, c.opt.x,
                c.opt.eps, c.opt.lambda);
  return std::string("--decay ") + dn[int(c.spec.decay)] + " --gain " + gn[int(c.spec.gain)] + " --precond " +
         pn[int(c.spec.precond)] + " --solve " + sn[int(c.spec.solve)] + num + (c.opt.l2norm_qk ? "" : " --no-l2norm");
}

/// True for the exact (inverse Gram) preconditioners.
bool exact(const Case& c) {
  return c.spec.precond == dgps::precond::Kind::exact_atk || c.spec.precond == dgps::precond::Kind::exact_atq;
}

/// Copies the inputs and cotangents of case `name` into `dir`, as float32 (cu_seqlens int32) when `f32`.
void copy_case(const std::string& name, const std::string& dir, bool f32) {
  for (const char* n :
       {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0", "cu_seqlens", "do", "dhT", "daT"}) {
    const fs::path src = fs::path(data_dir()) / name / (std::string(n) + ".npy");
    if (!fs::exists(src)) continue;
    const dgps::npy::Array a = dgps::npy::read(src.string());
    const fs::path dst = fs::path(dir) / src.filename();
    if (!f32) {
      fs::copy_file(src, dst);
    } else if (std::string(n) == "cu_seqlens") {
      dgps::npy::write(dst.string(), dgps::npy::Array::from(dgps::npy::DType::i32, a.shape, a.as<int64_t>().data()));
    } else {
      dgps::npy::write(dst.string(), dgps::npy::Array::from(dgps::npy::DType::f32, a.shape, a.as<double>().data()));
    }
  }
}

/// The names of the .npy files in `dir`.
std::vector<std::string> npy_files(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".npy") out.push_back(e.path().stem().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// max|x - gold| / denominator of case.json for output `name` written by the tool in `dir`.
double err_of(const Case& c, const std::string& dir, const std::string& name, dgps::npy::DType dtype) {
  const dgps::npy::Array a = dgps::npy::read((fs::path(dir) / (name + ".npy")).string());
  CHECK(a.dtype == dtype);
  CHECK(a.shape == c.shapes.at(name));
  std::vector<double> x = a.as<double>();
  if (name == "da0" && exact(c)) x = symmetrise(x, c.shape.key_dim);
  return rel_err(x, c.arr.at(name), c.denom.at(name));
}

/// `dgps run` and `dgps grad` on a copy of case `name`; every output and gradient against the gold values.
/// `extra` is appended to both commands' options (e.g. " --backend cuda").
void round_trip(const std::string& name, bool f32, double tol, const std::string& extra = "") {
  const Case c = load_case(name);
  TempDir tmp;
  const std::string in = tmp / "in", out = tmp / "out", grads = tmp / "grads";
  fs::create_directories(in);
  copy_case(name, in, f32);
  const auto dtype = f32 ? dgps::npy::DType::f32 : dgps::npy::DType::f64;

  const Run r = tool("run " + case_options(c) + extra + " --in " + quote(in) + " --out " + quote(out), tmp);
  INFO("case " << name << (f32 ? " (float32)" : " (float64)") << extra << ": " << r.err);
  REQUIRE(r.status == 0);
  std::vector<std::string> want = {"hT", "o"};
  if (c.has("aT")) want.insert(want.begin(), "aT");
  CHECK(npy_files(out) == want);
  for (const auto& n : want) {
    const double e = err_of(c, out, n, dtype);
    INFO("output " << n << " err " << e);
    CHECK(e < tol);
  }

  const Run g = tool("grad " + case_options(c) + extra + " --in " + quote(in) + " --out " + quote(grads), tmp);
  INFO("grad: " << g.err);
  REQUIRE(g.status == 0);
  std::vector<std::string> expect;
  for (const char* n : {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0"})
    if (c.has(n)) expect.push_back(std::string("d") + n);
  std::sort(expect.begin(), expect.end());
  CHECK(npy_files(grads) == expect);
  for (const auto& n : expect) {
    const double e = err_of(c, grads, n, dtype);
    INFO("gradient " << n << " err " << e);
    CHECK(e < tol);
  }
}

/// Writes a .npy file with an arbitrary header (for malformed inputs).
void write_raw(const std::string& path, const std::string& descr, bool fortran, const std::string& shape,
               size_t payload_bytes) {
  std::string h =
      "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") + ", 'shape': " + shape + ", }";
  h.append((64 - (10 + h.size() + 1) % 64) % 64, ' ');
  h.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  const char pre[10] = {
      '\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<char>(h.size() & 0xff), static_cast<char>(h.size() >> 8)};
  f.write(pre, 10);
  f << h << std::string(payload_bytes, '\0');
}

/// Copies case `name`, lets `corrupt` damage it, runs `dgps <cmd>` on it and checks the failure: exit
/// status 2, one stderr line naming `file`, and no output written. `options` replaces the case's options.
void expect_rejected(const std::string& name, const std::string& cmd, const std::string& file,
                     const std::function<void(const std::string& dir)>& corrupt, const std::string& options = "") {
  const Case c = load_case(name);
  TempDir tmp;
  const std::string in = tmp / "in", out = tmp / "out";
  fs::create_directories(in);
  copy_case(name, in, false);
  corrupt(in);
  const Run r = tool(
      cmd + " " + (options.empty() ? case_options(c) : options) + " --in " + quote(in) + " --out " + quote(out), tmp);
  INFO("case " << name << ", " << file << ": stderr '" << r.err << "'");
  CHECK(r.status == 2);
  if (!file.empty()) CHECK(r.err.find(file) != std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(!fs::exists(out));
}

}  // namespace

TEST_CASE("cli: run and grad reproduce every conformance case in float64") {
  // Metric (tests/data/README.md): max|x - gold| / denominator of case.json (max|gold|, floored for gradients);
  // exact preconditioners compare the symmetric part of da0.
  for (const auto& name : case_names()) round_trip(name, false, 1e-9);
}

TEST_CASE("cli: float32 inputs give float32 outputs within 1e-4") {
  round_trip("pkda_gva4_varlen", true, 1e-4);  // varlen with int32 cu_seqlens, GVA 4
  round_trip("mesa", true, 1e-4);              // --no-l2norm --scale 1, exact preconditioner
  round_trip("pgdn_gva2", true, 1e-4);
}

/// True when `dgps info` lists a GPU (the tool was built with the CUDA backend and the machine has one).
bool tool_has_gpu() {
  TempDir tmp;
  return tool("info", tmp).out.find("\ngpu 0: ") != std::string::npos;
}

TEST_CASE("cli: --backend cuda reproduces the conformance cases on the GPU") {
  if (!tool_has_gpu()) {  // then --backend cuda is a clear error that writes nothing
    TempDir tmp;
    const std::string in = tmp / "in", out = tmp / "out";
    fs::create_directories(in);
    copy_case("pgdn_gva2", in, false);
    const Run r = tool("run --model pgdn --backend cuda --in " + quote(in) + " --out " + quote(out), tmp);
    CHECK(r.status == 2);
    CHECK(r.err.find("backend 'cuda' is not available") != std::string::npos);
    CHECK(!fs::exists(out));
    MESSAGE("GPU round trip skipped: this dgps tool has no CUDA backend or sees no GPU");
    return;
  }
  // The float64 files are computed in float32 on the GPU and written back as float64: the float32 bound of
  // SPEC §5 (1e-4), as the float32 CPU round trip above and the GPU tests' conformance check.
  int ran = 0;
  for (const auto& name : case_names()) {
    const Case c = load_case(name);
    if (dgps::cuda::supports(c.spec)) {
      round_trip(name, false, 1e-4, " --backend cuda");
      ++ran;
      continue;
    }
    TempDir tmp;  // a model the CUDA backend does not run: a clear error, nothing written
    const std::string in = tmp / "in", out = tmp / "out";
    fs::create_directories(in);
    copy_case(name, in, false);
    const Run r = tool("run " + case_options(c) + " --backend cuda --in " + quote(in) + " --out " + quote(out), tmp);
    INFO("case " << name << ": " << r.err);
    CHECK(r.status == 2);
    CHECK(r.err.find("backend 'cuda' has no") != std::string::npos);
    CHECK(!fs::exists(out));
  }
  MESSAGE("conformance cases run on the GPU: " << ran);
  CHECK(ran >= 10);
  round_trip("pgdn_gva2", true, 1e-4, " --backend cuda");  // float32 files stay float32
}

TEST_CASE("cli: info and bench on the GPU") {
  if (!tool_has_gpu()) {
    MESSAGE("skipped: this dgps tool has no CUDA backend or sees no GPU");
    return;
  }
  TempDir tmp;
  const Run info = tool("info", tmp);
  CHECK(info.out.find("cuda: available") != std::string::npos);
  CHECK(info.out.find("backends: ") != std::string::npos);
  for (const char* mode : {"forward", "backward", "decode"}) {
    const Run r = tool(std::string("bench --model pgdn --batch 2 --time 64 --heads 2 --v-heads 4 --key-dim 64 "
                                   "--value-dim 64 --repeat 2 --backend cuda --mode ") +
                           mode,
                       tmp);
    INFO(mode << ": " << r.err);
    REQUIRE(r.status == 0);
    CHECK(r.out.find("impl: cuda/") != std::string::npos);
    const auto p = r.out.rfind("tokens/s: ");
    REQUIRE(p != std::string::npos);
    CHECK(std::stod(r.out.substr(p + 10)) > 0);
  }
  const Run f64 = tool("bench --model gdn --time 16 --heads 1 --key-dim 16 --value-dim 16 --dtype f64 --backend cuda",
                       tmp);
  CHECK(f64.status == 2);
  CHECK(f64.err.find("float64") != std::string::npos);
}

TEST_CASE("cli: malformed inputs exit 2, name the file and write nothing") {
  const std::string c = "pgdn_gva2";
  auto replace = [](const std::string& path, const std::function<void(std::string&)>& edit) {
    std::string bytes = slurp(path);
    edit(bytes);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  SUBCASE("bad magic") {
    expect_rejected(c, "run", "k.npy",
                    [&](const std::string& d) { replace(d + "/k.npy", [](std::string& b) { b[1] = 'X'; }); });
  }
  SUBCASE("truncated data") {
    expect_rejected(c, "run", "v.npy", [&](const std::string& d) {
      replace(d + "/v.npy", [](std::string& b) { b.resize(b.size() - 8); });
    });
  }
  SUBCASE("unsupported dtype float16") {
    expect_rejected(c, "run", "g.npy",
                    [](const std::string& d) { write_raw(d + "/g.npy", "<f2", false, "(1, 64, 4)", 512); });
  }
  SUBCASE("big-endian data") {
    expect_rejected(c, "grad", "beta.npy",
                    [](const std::string& d) { write_raw(d + "/beta.npy", ">f8", false, "(1, 64, 4)", 2048); });
  }
  SUBCASE("Fortran order") {
    expect_rejected(c, "run", "q.npy",
                    [](const std::string& d) { write_raw(d + "/q.npy", "<f8", true, "(1, 64, 2, 16)", 16384); });
  }
  SUBCASE("integer dtype for a float input") {
    expect_rejected(c, "run", "center.npy", [](const std::string& d) {
      const int64_t v[2] = {0, 0};
      dgps::npy::write(d + "/center.npy", dgps::npy::Array::from(dgps::npy::DType::i64, {2}, v));
    });
  }
  SUBCASE("shape contradicting q and v") {
    expect_rejected(c, "run", "beta.npy", [](const std::string& d) {
      std::vector<double> v(64 * 3, 0.5);
      dgps::npy::write(d + "/beta.npy", dgps::npy::Array::from(dgps::npy::DType::f64, {1, 64, 3}, v.data()));
    });
  }
  SUBCASE("initial state with the wrong number of sequences") {
    expect_rejected(c, "grad", "h0.npy", [](const std::string& d) {
      std::vector<double> v(2 * 4 * 16 * 16, 0.0);
      dgps::npy::write(d + "/h0.npy", dgps::npy::Array::from(dgps::npy::DType::f64, {2, 4, 16, 16}, v.data()));
    });
  }
  SUBCASE("mixed float dtypes") {
    expect_rejected(c, "run", "g_p.npy", [](const std::string& d) {
      const auto a = dgps::npy::read(d + "/g_p.npy");
      dgps::npy::write(d + "/g_p.npy", dgps::npy::Array::from(dgps::npy::DType::f32, a.shape, a.as<double>().data()));
    });
  }
  SUBCASE("cu_seqlens that does not end at T") {
    expect_rejected("pkda_gva4_varlen", "run", "cu_seqlens.npy", [](const std::string& d) {
      const int64_t cu[3] = {0, 20, 90};
      dgps::npy::write(d + "/cu_seqlens.npy", dgps::npy::Array::from(dgps::npy::DType::i64, {3}, cu));
    });
  }
  SUBCASE("float cu_seqlens") {
    expect_rejected("pkda_gva4_varlen", "run", "cu_seqlens.npy", [](const std::string& d) {
      const double cu[5] = {0, 20, 20, 21, 91};
      dgps::npy::write(d + "/cu_seqlens.npy", dgps::npy::Array::from(dgps::npy::DType::f64, {5}, cu));
    });
  }
  SUBCASE("missing g for gdn") {
    expect_rejected("gdn_b2", "run", "g.npy", [](const std::string& d) { fs::remove(d + "/g.npy"); });
  }
  SUBCASE("missing do for grad") {
    expect_rejected(c, "grad", "do.npy", [](const std::string& d) { fs::remove(d + "/do.npy"); });
  }
  SUBCASE("missing q") {
    expect_rejected(c, "run", "q.npy", [](const std::string& d) { fs::remove(d + "/q.npy"); });
  }
  SUBCASE("an input the model does not use") {
    expect_rejected("la_b2", "run", "g.npy", [](const std::string& d) {
      std::vector<double> v(2 * 64 * 2, -0.1);
      dgps::npy::write(d + "/g.npy", dgps::npy::Array::from(dgps::npy::DType::f64, {2, 64, 2}, v.data()));
    });
  }
  SUBCASE("an option the library rejects (x = 0)") {
    expect_rejected(
        c, "run", "'x'", [](const std::string&) {}, "--model pgdn --scale 0.25 --x 0");
  }
}

TEST_CASE("cli: usage errors and help") {
  TempDir tmp;
  const Run unknown = tool("run --model pgdn --in a --out b --bogus 1", tmp);
  CHECK(unknown.status == 2);
  CHECK(unknown.err.find("--bogus") != std::string::npos);
  CHECK(unknown.err.find("usage: dgps run") != std::string::npos);
  CHECK(tool("frobnicate", tmp).status == 2);
  CHECK(tool("run --in a --out b", tmp).status == 2);  // no model
  const Run bad_model = tool("run --model nope --in a --out b", tmp);
  CHECK(bad_model.status == 2);
  CHECK(bad_model.err.find("nope") != std::string::npos);
  CHECK(tool("run --model pgdn --decay scalar --in a --out b", tmp).status == 2);  // model and axes
  CHECK(tool("bench --model gdn --time x --heads 1 --key-dim 4 --value-dim 4", tmp).status == 2);
  CHECK(tool("bench --model gdn --heads 1 --key-dim 4 --value-dim 4", tmp).status == 2);  // no --time
  const Run help = tool("--help", tmp);
  CHECK(help.status == 0);
  for (const char* cmd : {"info", "run", "grad", "bench"}) CHECK(help.out.find(cmd) != std::string::npos);
  const Run run_help = tool("run --help", tmp);
  CHECK(run_help.status == 0);
  for (const char* opt : {"--model", "--in", "--out", "--backend", "--algorithm", "--no-l2norm", "--scale", "--x",
                          "--eps", "--lambda", "--threads", "--decay", "--gain", "--precond", "--solve"})
    CHECK(run_help.out.find(opt) != std::string::npos);
  const Run bench_help = tool("bench --help", tmp);
  for (const char* opt : {"--batch", "--time", "--heads", "--v-heads", "--key-dim", "--value-dim", "--mode", "--json",
                          "--dtype", "--repeat"})
    CHECK(bench_help.out.find(opt) != std::string::npos);
}

TEST_CASE("cli: info") {
  TempDir tmp;
  const Run r = tool("info", tmp);
  CHECK(r.status == 0);
  CHECK(r.out.find("dgps " + std::string(dgps::version_string)) != std::string::npos);
  CHECK(r.out.find("cpu") != std::string::npos);
  CHECK(r.out.find("cuda") != std::string::npos);
}

TEST_CASE("cli: bench") {
  TempDir tmp;
  auto last_line_rate = [](const std::string& out) {
    const auto p = out.rfind("tokens/s: ");
    REQUIRE(p != std::string::npos);
    CHECK(out.find('\n', p) == out.size() - 1);  // the last line
    return std::stod(out.substr(p + 10));
  };
  for (const char* mode : {"forward", "backward", "decode"}) {
    const Run r = tool(std::string("bench --model pgdn --batch 2 --time 32 --heads 2 --v-heads 4 --key-dim 16 "
                                   "--value-dim 16 --repeat 2 --mode ") +
                           mode,
                       tmp);
    INFO(mode << ": " << r.err);
    REQUIRE(r.status == 0);
    CHECK(r.out.find("impl: cpu") != std::string::npos);
    CHECK(last_line_rate(r.out) > 0);
  }
  const Run axes = tool(
      "bench --decay diagonal --gain scalar --precond exact-atq --solve online --time 16 --heads 1 "
      "--key-dim 8 --value-dim 8 --dtype f64 --mode decode --repeat 1",
      tmp);
  REQUIRE(axes.status == 0);
  CHECK(last_line_rate(axes.out) > 0);
  const Run json = tool("bench --model mesa --time 16 --heads 2 --key-dim 8 --value-dim 8 --json --repeat 1", tmp);
  REQUIRE(json.status == 0);
  CHECK(json.out.front() == '{');
  CHECK(json.out.find("}\n") == json.out.size() - 2);
  const auto p = json.out.find("\"tokens_per_s\": ");
  REQUIRE(p != std::string::npos);
  CHECK(std::stod(json.out.substr(p + 16)) > 0);
  CHECK(json.out.find("\"impl\": \"cpu") != std::string::npos);
}

namespace {

/// Writes a .npy file whose header dictionary is `dict` verbatim (padded as numpy pads), then `payload` zero bytes.
void write_header(const std::string& path, std::string dict, size_t payload_bytes) {
  dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
  dict.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  const char pre[10] = {'\x93',
                        'N',
                        'U',
                        'M',
                        'P',
                        'Y',
                        1,
                        0,
                        static_cast<char>(dict.size() & 0xff),
                        static_cast<char>(dict.size() >> 8)};
  f.write(pre, 10);
  f << dict << std::string(payload_bytes, '\0');
}

/// No byte of `s` is a control character other than the final newline.
bool sanitised(const std::string& s) {
  for (size_t i = 0; i + 1 < s.size(); ++i)
    if (static_cast<unsigned char>(s[i]) < 0x20 || s[i] == 0x7f) return false;
  return true;
}

}  // namespace

TEST_CASE("cli: hostile .npy files exit 2 with one sanitised line and write nothing") {
  const std::string f8 = "{'descr': '<f8', 'fortran_order': False, 'shape': ";
  SUBCASE("shape whose element count overflows int64, no data (la, gla)") {
    // Every tensor present declares the same overflowing shape, so that only the size check can refuse them.
    for (const char* name : {"la_b2", "gla_T63"})
      expect_rejected(name, "run", "q.npy", [&](const std::string& d) {
        fs::remove(d + "/h0.npy");
        for (const char* t : {"q", "k", "v", "g"})
          if (fs::exists(d + "/" + t + ".npy"))
            write_header(d + "/" + t + ".npy", f8 + "(1, 2305843009213693952, 1, 8), }", 0);
      });
  }
  SUBCASE("shape whose byte count overflows int64, no data") {
    expect_rejected("gdn_b2", "run", "g.npy", [&](const std::string& d) {
      write_header(d + "/g.npy", f8 + "(2, 1152921504606846976, 8), }", 0);
    });
  }
  SUBCASE("empty tensors with huge sizes (T = 0, K = V = 2^40)") {
    expect_rejected(
        "la_b2", "run", "",
        [&](const std::string& d) {
          for (const char* t : {"q", "k", "v"})
            write_header(d + "/" + t + ".npy", f8 + "(2, 0, 2, 1099511627776), }", 0);
        },
        "--model la");
  }
  SUBCASE("shape field too large for int64") {
    expect_rejected("la_b2", "run", "q.npy",
                    [&](const std::string& d) { write_header(d + "/q.npy", f8 + "(99999999999999999999, 1), }", 0); });
  }
  SUBCASE("headers numpy rejects") {
    const std::vector<std::string> bad = {
        f8 + "(2 64 2 16), }",                                                   // no commas
        f8 + "(2), }",                                                           // an int, not a tuple
        f8 + "(2, 64, 2, 16), 'extra': 1, }",                                    // extra key
        "{'descr': '<f8', 'shape': (2, 64, 2, 16), }",                           // missing key
        f8 + "(2, 64, 2, 16), 'shape': (2, 64, 2, 16), }",                       // duplicated key
        "{'descr': '<f8x', 'fortran_order': False, 'shape': (2, 64, 2, 16), }",  // bad descr
        f8 + "(2, -64, 2, 16), }",                                               // negative field
        f8 + "(2, 64, 2, 16), } trailing",                                       // text after the dictionary
    };
    for (const auto& h : bad)
      expect_rejected("la_b2", "run", "q.npy", [&](const std::string& d) { write_header(d + "/q.npy", h, 16384); });
  }
  SUBCASE("control bytes in a header are escaped") {
    TempDir tmp;
    const std::string in = tmp / "in";
    fs::create_directories(in);
    copy_case("la_b2", in, false);
    write_header(in + "/k.npy", "{'descr': '<f8\x1b[2J\x07', 'fortran_order': False, 'shape': (2, 64, 2, 16), }",
                 16384);
    const Run r = tool("run --model la --in " + quote(in) + " --out " + quote(tmp / "out"), tmp);
    INFO(r.err);
    CHECK(r.status == 2);
    CHECK(sanitised(r.err));
    CHECK(r.err.find("\\x1b") != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  SUBCASE("a directory named q.npy") {
    expect_rejected("la_b2", "run", "q.npy", [](const std::string& d) {
      fs::remove(d + "/q.npy");
      fs::create_directory(d + "/q.npy");
    });
  }
  SUBCASE("a FIFO named k.npy (no hang)") {
    expect_rejected("la_b2", "run", "k.npy", [](const std::string& d) {
      fs::remove(d + "/k.npy");
      REQUIRE(::mkfifo((d + "/k.npy").c_str(), 0600) == 0);
    });
  }
}

TEST_CASE("cli: numeric options out of range or with trailing text are usage errors") {
  TempDir tmp;
  for (const char* bad :
       {"--threads 4294967297", "--threads 2147483648", "--threads -1", "--threads 4x",
        "--threads 99999999999999999999999", "--threads ''", "--x 1.5junk", "--x ' 1.5'", "--scale nan", "--eps inf"}) {
    const Run r = tool(std::string("run --model la --in a --out b ") + bad, tmp);
    INFO(bad << ": " << r.err);
    CHECK(r.status == 2);
    CHECK(r.err.find("usage: dgps run") != std::string::npos);
  }
  const std::string bench = "bench --model gdn --heads 1 --key-dim 4 --value-dim 4 --repeat 1 ";
  for (const std::string bad : {"--time 4 --batch 99999999999999999999", "--time 4 --seed -3",
                                "--time 4611686018427387904", "--time 1 --key-dim 4294967296 --value-dim 4294967296"}) {
    const Run r = tool(bench + bad, tmp);
    INFO(bad << ": " << r.err);
    CHECK(r.status == 2);
  }
}

TEST_CASE("cli: outputs are written all or nothing") {
  TempDir tmp;
  const std::string in = tmp / "in", out = tmp / "out";
  fs::create_directories(in);
  copy_case("la_b2", in, false);
  const std::string run = "run --model la --in " + quote(in) + " --out " + quote(out);
  auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  SUBCASE("hT.npy is a directory: nothing is written, old files stay") {
    fs::create_directories(out + "/hT.npy");
    std::ofstream(out + "/o.npy") << "old";
    const Run r = tool(run, tmp);
    INFO(r.err);
    CHECK(r.status == 2);
    CHECK(r.err.find("hT.npy") != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(listing() == std::vector<std::string>{"hT.npy", "o.npy"});
    CHECK(slurp(out + "/o.npy") == "old");
  }
  SUBCASE("--out is a regular file") {
    std::ofstream(out) << "x";
    const Run r = tool(run, tmp);
    CHECK(r.status == 2);
    CHECK(slurp(out) == "x");
  }
  SUBCASE("success replaces old outputs and leaves no temporary files") {
    fs::create_directories(out);
    std::ofstream(out + "/o.npy") << "old";
    const Run r = tool(run, tmp);
    INFO(r.err);
    REQUIRE(r.status == 0);
    CHECK(listing() == std::vector<std::string>{"hT.npy", "o.npy"});
    CHECK(dgps::npy::read(out + "/o.npy").shape == std::vector<int64_t>{2, 64, 2, 16});
  }
}
