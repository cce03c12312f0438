/// @brief libFuzzer target: validation and forward of small problems built from fuzzed bytes (shapes, strides,
/// cu_seqlens, options, one of a few models; reference and cpu backends). Any outcome but success or dgps::Error
/// is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <dgps/dgps.hpp>

namespace {

/// Consumes the fuzzed bytes front to back; zeros once they run out.
struct Bytes {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  int64_t pick(int64_t lo, int64_t hi) { return lo + u8() % (hi - lo + 1); }
  bool flag() { return u8() & 1; }
  /// A value in [lo, hi], or now and then a special one (NaN, infinity, a huge or tiny number).
  double value(double lo, double hi) {
    const uint8_t b = u8();
    if (b == 255) {
      static constexpr double special[] = {std::numeric_limits<double>::quiet_NaN(),
                                           std::numeric_limits<double>::infinity(), -1e300, 1e-300};
      return special[u8() % 4];
    }
    return lo + (hi - lo) * b / 254.0;
  }
};

template <class R>
void run(Bytes& b) {
  using T = float;
  using View = dgps::TensorView<const T>;
  using MView = dgps::TensorView<T>;
  dgps::Shape s;
  s.batch = b.pick(1, 2);
  s.time = b.pick(0, 9);
  s.heads = b.pick(1, 2);
  s.v_heads = s.heads * b.pick(1, 2);
  s.key_dim = b.pick(1, 6);
  s.value_dim = b.pick(1, 6);
  if (b.u8() == 7) s.v_heads = b.pick(0, 3);  // possibly not a multiple of heads, or 0
  if (b.u8() == 7) s.time = -1;
  const int64_t B = s.batch, Tn = std::max<int64_t>(s.time, 0), H = s.heads, HV = s.v_heads == 0 ? H : s.v_heads;  // SPEC: 0 means heads
  const int64_t K = s.key_dim, V = s.value_dim;

  std::vector<int64_t> cu;
  int64_t N = B;
  if (B == 1 && b.flag()) {
    N = b.pick(1, 3);
    cu.push_back(0);
    for (int64_t i = 1; i < N; ++i) cu.push_back(b.pick(0, Tn));
    cu.push_back(Tn);
    if (b.u8() == 3) cu[static_cast<size_t>(b.pick(0, N))] += b.pick(-2, 2);  // possibly invalid
  }

  // Every buffer is large enough for its SPEC shape, with room for one padded outer stride.
  auto buf = [&](int64_t n, double lo, double hi) {
    std::vector<T> v(static_cast<size_t>(std::max<int64_t>(2 * n, 1)));
    for (auto& x : v) x = static_cast<T>(b.value(lo, hi));
    return v;
  };
  std::vector<T> q = buf(B * Tn * H * K, -2, 2), k = buf(B * Tn * H * K, -2, 2), v = buf(B * Tn * HV * V, -2, 2);
  std::vector<T> g = buf(B * Tn * HV * K, -4, 0), beta = buf(B * Tn * HV, 0, 1);
  std::vector<T> g_p = buf(B * Tn * H, -4, 0), beta_p = buf(B * Tn * H, 0, 1), center = buf(H, -1, 1);
  std::vector<T> h0 = buf(N * HV * K * V, -1, 1), a0 = buf(N * H * K * K, 0, 2);
  std::vector<T> o(static_cast<size_t>(std::max<int64_t>(2 * B * Tn * HV * V, 1)));
  std::vector<T> hT(static_cast<size_t>(N * HV * K * V)), aT(static_cast<size_t>(std::max<int64_t>(N * H * K * K, 1)));

  auto in = dgps::inputs<T>(s, q.data(), k.data(), v.data());
  // q: a bare pointer, a padded strided view, or a view with a wrong shape or stride.
  switch (b.pick(0, 3)) {
    case 1:
      in.q = View(q.data(), {B, Tn, H, K}, {Tn * H * K, H * K, K, 1});
      break;
    case 2:
      in.q = View(q.data(), {B, Tn, H, K}, {2 * Tn * H * K, H * K, K, 1});
      break;
    case 3:
      in.q = View(q.data(), {B, Tn, H, b.pick(0, K + 1)}, {Tn * H * K, H * K, K, b.pick(-1, 2)});
      break;
    default:
      break;
  }
  if (b.flag()) in.decay(g.data());
  if (b.flag()) in.gain(beta.data());
  if (b.flag()) in.precond(g_p.data(), beta_p.data(), b.flag() ? center.data() : nullptr);
  if (b.flag()) in.initial_state(h0.data(), b.flag() ? a0.data() : nullptr);
  if (!cu.empty()) in.varlen(dgps::TensorView<const int64_t>(cu.data(), {static_cast<int64_t>(cu.size())}));

  auto out = dgps::outputs<T>(o.data());
  if (b.flag()) out.final_state(hT.data(), b.flag() ? aT.data() : nullptr);
  if (b.u8() == 5) out.o = MView(o.data(), {B, Tn, HV, V}, {2 * Tn * HV * V, HV * V, V, 1});

  dgps::Options opt;
  static constexpr dgps::Backend backends[] = {dgps::Backend::reference, dgps::Backend::cpu};
  static constexpr dgps::Algorithm algorithms[] = {dgps::Algorithm::automatic, dgps::Algorithm::recurrent,
                                                   dgps::Algorithm::chunkwise};
  opt.backend = backends[b.pick(0, 1)];
  opt.algorithm = algorithms[b.pick(0, 2)];
  opt.chunk_size = b.pick(0, 8);
  opt.threads = static_cast<int>(b.pick(0, 2));
  opt.l2norm_qk = b.flag();
  if (b.flag()) opt.scale = b.value(-2, 2);
  if (b.flag()) opt.x = b.value(-1, 3);
  if (b.flag()) opt.eps = b.value(-1e-3, 1e-3);
  if (b.flag()) opt.lambda = b.value(-1, 4);
  try {
    dgps::forward<R>(in, out, opt);
  } catch (const dgps::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes b{data, size};
  switch (b.pick(0, 5)) {
    case 0:
      run<dgps::LinearAttention>(b);
      break;
    case 1:
      run<dgps::GDN>(b);
      break;
    case 2:
      run<dgps::KDA>(b);
      break;
    case 3:
      run<dgps::PGDN>(b);
      break;
    case 4:
      run<dgps::MesaLayer>(b);
      break;
    default:
      run<dgps::PMamba2>(b);
      break;
  }
  return 0;
}
