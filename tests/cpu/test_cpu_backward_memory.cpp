/// @brief The CPU backward's workspace without a training cache stays within its segment formula
/// (docs/performance-cpu.md).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <dgps/dgps.hpp>

namespace {

/// A field of /proc/self/status in KiB (VmHWM, VmRSS), -1 when unreadable.
int64_t status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::stoll(line.substr(n + 1));
  return -1;
}

/// Resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0); false where not allowed.
bool reset_peak() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

}  // namespace

// GDN and PGDN, T = 65,536, K = V = 128, one thread: the workspace is about 18 bytes a token of
// checkpoints plus 16-24 MB for one 4096-token segment (about 4-6 KB a token, 256-384 MB, before the
// segments). The inputs and gradients are touched before the peak is reset, so the peak's growth is
// the call's workspace.
TEST_CASE("cpu backward memory: T = 65536 without a cache needs under 48 MB of workspace") {
  const int64_t T = 65536, K = 128, V = 128;
  std::vector<float> q(T * K, 0.01f), k(T * K, 0.02f), v(T * V, 0.03f), d_o(T * V, 0.04f);
  std::vector<float> g(T, -0.05f), beta(T, 0.5f), gp(T, -0.05f), bp(T, 0.5f), center(1, -0.5f);
  std::vector<float> dq(T * K, 1), dk(T * K, 1), dv(T * V, 1), dg(T, 1), dbeta(T, 1), dgp(T, 1), dbp(T, 1), dc(1, 1);
  const dgps::Shape sh{.batch = 1, .time = T, .heads = 1, .v_heads = 1, .key_dim = K, .value_dim = V};
  dgps::Options opt;
  opt.backend = dgps::Backend::cpu;
  opt.algorithm = dgps::Algorithm::chunkwise;
  opt.threads = 1;
  for (const bool pre : {false, true}) {
    auto in = dgps::inputs<float>(sh, q.data(), k.data(), v.data());
    in.decay(g.data()).gain(beta.data());
    dgps::Grads<float> gr;
    gr.dq = dgps::view<float>(dq.data(), {1, T, 1, K});
    gr.dk = dgps::view<float>(dk.data(), {1, T, 1, K});
    gr.dv = dgps::view<float>(dv.data(), {1, T, 1, V});
    gr.dg = dgps::view<float>(dg.data(), {1, T, 1});
    gr.dbeta = dgps::view<float>(dbeta.data(), {1, T, 1});
    if (pre) {
      in.precond(gp.data(), bp.data(), center.data());
      gr.dg_p = dgps::view<float>(dgp.data(), {1, T, 1});
      gr.dbeta_p = dgps::view<float>(dbp.data(), {1, T, 1});
      gr.dcenter = dgps::view<float>(dc.data(), {1});
    }
    const int64_t before = status_kib("VmRSS");
    if (!reset_peak() || before < 0) {
      MESSAGE("peak RSS not resettable here (/proc/self/clear_refs): memory bound not checked");
      return;
    }
    if (pre)
      dgps::backward<dgps::PGDN>(in, dgps::grads_in<float>(d_o.data()), gr, opt);
    else
      dgps::backward<dgps::GDN>(in, dgps::grads_in<float>(d_o.data()), gr, opt);
    const int64_t grown = status_kib("VmHWM") - before;
    const std::string model = pre ? "pgdn" : "gdn";
    INFO(model << " workspace KiB " << grown);
    CHECK(grown < 48 * 1024);
    MESSAGE(model << " T = 65536 backward workspace (peak RSS growth) " << grown / 1024 << " MiB");
  }
}
