/// @brief The CUDA branch of dgps::forward / backward / decode without a GPU: a stand-in dgps::cuda records the
/// Params each dtype is routed with, and host tensors or a missing GPU fall back to the CPU.
///
/// This unit compiles dgps.hpp as a program linked with dgps::cuda does (DGPS_HAS_CUDA), and defines the few
/// dgps::cuda functions that branch calls. dgps_tests links no real dgps::cuda (keep it so: the definitions
/// below would clash with it); the GPU test tests/cuda/test_cuda_unified.cpp runs the real kernels.
#define DGPS_HAS_CUDA 1

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "support.hpp"

namespace fake_cuda {

bool gpu = false;              ///< what dgps::cuda::available() answers
std::set<const void*> device;  ///< pointers dgps::cuda::is_device_pointer() calls device memory
dgps::cuda::Params params;     ///< the last call's params
dgps::cuda::GradParams grads;  ///< the last backward's gradient params
std::string called;            ///< "forward", "backward" or "decode"; empty when none ran

/// Forgets the last call and sets what the stand-in reports.
void reset(bool has_gpu) {
  gpu = has_gpu;
  device.clear();
  called.clear();
  params = {};
  grads = {};
}

}  // namespace fake_cuda

namespace dgps::cuda {

Workspace::~Workspace() = default;
bool available() { return fake_cuda::gpu; }
bool is_device_pointer(const void* p) { return fake_cuda::device.count(p) > 0; }
const char* forward(const Params& p, Workspace&, void*) {
  fake_cuda::params = p, fake_cuda::called = "forward";
  return p.dtype != DType::f32 ? "cuda/chunkwise/fake" : "cuda/recurrent/fake";
}
const char* backward(const Params& p, const GradParams& g, Workspace&, void*) {
  fake_cuda::params = p, fake_cuda::grads = g, fake_cuda::called = "backward";
  return p.dtype != DType::f32 ? "cuda/backward/chunkwise" : "cuda/backward/recurrent";
}
const char* decode(const Params& p, Workspace&, void*) {
  fake_cuda::params = p, fake_cuda::called = "decode";
  return "cuda/decode/fake";
}

}  // namespace dgps::cuda

namespace {

using dgps_test::Case;
using dgps_test::CaseTensors;

constexpr dgps::Shape kShape{.batch = 2, .time = 5, .heads = 2, .v_heads = 4, .key_dim = 8, .value_dim = 6};

/// A small random problem of model R with host tensors of type T and room for o, hT, aT.
template <class R, class T>
struct Fixture {
  using S = dgps::state_t<T>;
  Case c = dgps_test::random_case(dgps::spec_of<R>(), kShape, {}, 35);
  CaseTensors<T> ct{c};
  std::vector<T> o = std::vector<T>(size_t(2 * 5 * 4 * 6));
  std::vector<S> hT = std::vector<S>(size_t(2 * 4 * 8 * 6)), aT = std::vector<S>(size_t(2 * 2 * 8));
  dgps::Inputs<T> in = ct.inputs(c);

  dgps::Outputs<T> out() {
    const bool pre = dgps::spec_of<R>().precond != dgps::precond::Kind::identity;
    return dgps::outputs<T>(o.data()).final_state(hT.data(), pre ? aT.data() : nullptr);
  }
  /// Marks every input as device memory (the stand-in's answer).
  void on_device() {
    for (const auto& [n, v] : ct.t) fake_cuda::device.insert(v.data());
  }
};

dgps::Options with(dgps::Backend b) {
  dgps::Options o;
  o.backend = b;
  o.threads = 1;
  return o;
}

template <class T>
dgps::cuda::DType dtype_of() {
  return std::is_same_v<T, float>        ? dgps::cuda::DType::f32
         : std::is_same_v<T, dgps::bf16> ? dgps::cuda::DType::bf16
                                         : dgps::cuda::DType::f16;
}

/// dgps::forward<R, T> on device tensors reaches dgps::cuda::forward with Params that describe them.
template <class R, class T>
void forward_routes() {
  fake_cuda::reset(true);
  Fixture<R, T> f;
  f.on_device();
  const dgps::RunInfo info = dgps::forward<R>(f.in, f.out(), with(dgps::Backend::automatic));
  REQUIRE(fake_cuda::called == "forward");
  const dgps::cuda::Params& p = fake_cuda::params;
  CHECK(info.backend == dgps::Backend::cuda);
  CHECK(info.impl == (std::is_same_v<T, float> ? "cuda/recurrent/fake" : "cuda/chunkwise/fake"));
  CHECK(info.algorithm == (std::is_same_v<T, float> ? dgps::Algorithm::recurrent : dgps::Algorithm::chunkwise));
  CHECK(p.dtype == dtype_of<T>());
  CHECK(p.gate_dtype == dtype_of<T>());
  CHECK(p.spec == dgps::spec_of<R>());
  CHECK((p.B == 2 && p.T == 5 && p.H == 2 && p.HV == 4 && p.K == 8 && p.V == 6 && p.N == 2));
  CHECK(p.q.data == f.ct.p("q"));
  CHECK((p.q.stride[0] == 5 * 2 * 8 && p.q.stride[1] == 2 * 8 && p.q.stride[2] == 8));
  CHECK(p.v.data == f.ct.p("v"));
  CHECK(p.g.data == f.ct.p("g"));
  CHECK(p.beta.data == f.ct.p("beta"));
  CHECK(p.o.data == f.o.data());
  CHECK((p.o.stride[0] == 5 * 4 * 6 && p.o.stride[2] == 6));
  CHECK(p.hT.data == f.hT.data());
  CHECK(p.h0.data == f.ct.ps("h0"));
  CHECK(p.cu_seqlens == nullptr);
  CHECK(p.slots == nullptr);
  CHECK(p.scale == doctest::Approx(1 / std::sqrt(8.0)));
  CHECK(p.x == 1.5f);
  CHECK(p.l2norm);
  CHECK(p.algorithm == dgps::Algorithm::automatic);
  if constexpr (dgps::precond::needs_center<typename R::precond_type>) {
    CHECK(p.g_p.data == f.ct.p("g_p"));
    CHECK(p.center.data == f.ct.p("center"));
    CHECK(p.aT.data == f.aT.data());
  }
}

}  // namespace

TEST_CASE("unified API: bf16, f16 and f32 device tensors reach dgps::cuda::forward") {
  forward_routes<dgps::GDN, dgps::bf16>();
  forward_routes<dgps::GDN, dgps::f16>();
  forward_routes<dgps::GDN, float>();
  forward_routes<dgps::PGDN, dgps::bf16>();
  forward_routes<dgps::PGDN, dgps::f16>();
}

TEST_CASE("unified API: without a GPU, or with host tensors, bf16 runs on the CPU") {
  for (bool gpu : {false, true}) {
    fake_cuda::reset(gpu);
    Fixture<dgps::PGDN, dgps::bf16> f;
    const dgps::RunInfo info = dgps::forward<dgps::PGDN>(f.in, f.out(), with(dgps::Backend::automatic));
    CHECK(fake_cuda::called.empty());
    CHECK(info.backend == dgps::Backend::cpu);
    CHECK(info.impl.rfind("cpu/", 0) == 0);
    // The CPU result equals a forward of the same call asked for the CPU explicitly.
    const std::vector<dgps::bf16> first = f.o;
    (void)dgps::forward<dgps::PGDN>(f.in, f.out(), with(dgps::Backend::cpu));
    CHECK(std::memcmp(first.data(), f.o.data(), first.size() * sizeof(dgps::bf16)) == 0);
  }
  fake_cuda::reset(false);
  Fixture<dgps::GDN, dgps::bf16> f;
  f.on_device();  // device memory without a usable GPU: the cuda backend is not available
  CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(f.in, f.out(), with(dgps::Backend::cuda)),
                       doctest::Contains("backend 'cuda' is not available"), dgps::Error);
  CHECK(fake_cuda::called.empty());
}

TEST_CASE("unified API: the CUDA branch validates like the CPU and refuses what dgps::cuda lacks") {
  fake_cuda::reset(true);
  {
    Fixture<dgps::GDN, dgps::bf16> f;
    f.on_device();
    f.in.g = {};  // GDN's decay needs g
    CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(f.in, f.out(), with(dgps::Backend::cuda)),
                         doctest::Contains("tensor 'g' is required"), dgps::Error);
  }
  {
    Fixture<dgps::GDN, double> f;
    f.on_device();
    CHECK_THROWS_WITH_AS(dgps::forward<dgps::GDN>(f.in, f.out(), with(dgps::Backend::cuda)),
                         doctest::Contains("no float64 kernels"), dgps::Error);
  }
  {  // The exact preconditioners have no chunkwise form on the GPU.
    Fixture<dgps::MesaLayer, dgps::bf16> f;
    f.on_device();
    dgps::Outputs<dgps::bf16> out = dgps::outputs<dgps::bf16>(f.o.data());
    dgps::Options opt = with(dgps::Backend::cuda);
    opt.algorithm = dgps::Algorithm::chunkwise;
    CHECK_THROWS_WITH_AS(dgps::forward<dgps::MesaLayer>(f.in, out, opt),
                         doctest::Contains("backend 'cuda' has no chunkwise algorithm"), dgps::Error);
  }
  CHECK(fake_cuda::called.empty());
}

TEST_CASE("unified API: the exact preconditioners reach dgps::cuda with lambda and the [N, H, K, K] state") {
  fake_cuda::reset(true);
  Fixture<dgps::MesaLayer, dgps::bf16> f;
  f.on_device();
  std::vector<float> aT(size_t(2 * 2 * 8 * 8));
  dgps::Options opt = with(dgps::Backend::cuda);
  opt.lambda = 0.5;
  (void)dgps::forward<dgps::MesaLayer>(f.in, dgps::outputs<dgps::bf16>(f.o.data()).final_state(f.hT.data(), aT.data()),
                                       opt);
  REQUIRE(fake_cuda::called == "forward");
  const dgps::cuda::Params& p = fake_cuda::params;
  CHECK(p.spec == dgps::spec_of<dgps::MesaLayer>());
  CHECK(p.lambda == 0.5f);
  CHECK(p.a0.data == f.ct.ps("a0"));
  CHECK((p.a0.stride[0] == 2 * 8 * 8 && p.a0.stride[1] == 8 * 8 && p.a0.stride[2] == 8));
  CHECK(p.aT.data == aT.data());
  CHECK(p.center.data == nullptr);
  // a0 of a diagonal preconditioner's shape [N, H, K] is refused before any call, naming the tensor.
  fake_cuda::reset(true);
  f.on_device();
  dgps::Inputs<dgps::bf16> bad = f.in;
  bad.a0 = dgps::view<const float>(f.ct.ps("a0"), {2, 2, 8});
  CHECK_THROWS_WITH_AS(dgps::forward<dgps::MesaLayer>(bad, dgps::outputs<dgps::bf16>(f.o.data()), opt),
                       doctest::Contains("a0"), dgps::Error);
  CHECK(fake_cuda::called.empty());
  CHECK(dgps::supports<dgps::MesaLayer>(dgps::Backend::cuda));
  CHECK(dgps::supports<dgps::RidgeReadout>(dgps::Backend::cuda, dgps::Algorithm::recurrent));
  CHECK_FALSE(dgps::supports<dgps::RidgeReadout>(dgps::Backend::cuda, dgps::Algorithm::chunkwise));
}

TEST_CASE("unified API: bf16 backward and f16 decode reach dgps::cuda") {
  fake_cuda::reset(true);
  {
    Fixture<dgps::PGDN, dgps::bf16> f;
    f.on_device();
    std::vector<dgps::bf16> dq(f.ct.t.at("q").size()), dbeta(f.ct.t.at("beta").size());
    std::vector<float> dh0(f.hT.size());
    dgps::Grads<dgps::bf16> g;
    g.dq = dgps::view(dq.data(), {2, 5, 2, 8});
    g.dbeta = dgps::view(dbeta.data(), {2, 5, 4});
    g.dh0 = dgps::view(dh0.data(), {2, 4, 8, 6});
    const auto gi = dgps::grads_in<dgps::bf16>(f.ct.p("do"));
    dgps::Options opt = with(dgps::Backend::automatic);
    opt.algorithm = dgps::Algorithm::chunkwise;
    const dgps::RunInfo info = dgps::backward<dgps::PGDN>(f.in, gi, g, opt);
    REQUIRE(fake_cuda::called == "backward");
    CHECK(info.backend == dgps::Backend::cuda);
    CHECK(info.algorithm == dgps::Algorithm::chunkwise);
    CHECK(info.impl == "cuda/backward/chunkwise");
    CHECK(fake_cuda::params.dtype == dgps::cuda::DType::bf16);
    CHECK(fake_cuda::params.algorithm == dgps::Algorithm::chunkwise);
    CHECK(fake_cuda::grads.d_o.data == f.ct.p("do"));
    CHECK(fake_cuda::grads.dq.data == dq.data());
    CHECK(fake_cuda::grads.dbeta.data == dbeta.data());
    CHECK(fake_cuda::grads.dh0.data == dh0.data());
    CHECK(fake_cuda::grads.dk.data == nullptr);
  }
  {
    fake_cuda::reset(true);
    Fixture<dgps::PGDN, dgps::f16> f;
    f.in.h0 = {}, f.in.a0 = {};  // decode takes its states from DecodeState
    f.on_device();
    std::vector<float> h(size_t(3 * 4 * 8 * 6)), a(size_t(3 * 2 * 8));
    const std::vector<int64_t> slots = {2, 0};
    dgps::DecodeState<dgps::f16> st;
    st.h = dgps::view(h.data(), {3, 4, 8, 6});
    st.a = dgps::view(a.data(), {3, 2, 8});
    st.slots = dgps::view(slots.data(), {2});
    fake_cuda::device.insert(slots.data());
    const dgps::RunInfo info = dgps::decode<dgps::PGDN>(st, f.in, f.o.data(), with(dgps::Backend::cuda));
    REQUIRE(fake_cuda::called == "decode");
    CHECK(info.backend == dgps::Backend::cuda);
    CHECK(info.algorithm == dgps::Algorithm::recurrent);
    CHECK(info.impl == "cuda/decode/fake");
    CHECK(fake_cuda::params.dtype == dgps::cuda::DType::f16);
    CHECK(fake_cuda::params.slots == slots.data());
    CHECK(fake_cuda::params.h0.data == h.data());
    CHECK(fake_cuda::params.hT.data == h.data());
    CHECK(fake_cuda::params.a0.data == a.data());
    // The serving pool's other index tensors are CPU-only: a clear error, nothing reaches dgps::cuda.
    fake_cuda::reset(true);
    const std::vector<int64_t> outs = {1, 2};
    st.out_slots = dgps::view(outs.data(), {2});
    std::string msg;
    try {
      dgps::decode<dgps::PGDN>(st, f.in, f.o.data(), with(dgps::Backend::cuda));
    } catch (const dgps::Error& e) {
      msg = e.what();
    }
    CHECK(msg.find("CUDA backend takes slots only") != std::string::npos);
    CHECK(fake_cuda::called.empty());
  }
}
