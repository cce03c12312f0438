/// @brief Shared by the GPU tests: device buffers, typed uploads, case inputs as dgps::cuda::Params, ok/FAIL lines.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <dgps/cuda.hpp>
#include <dgps/dgps.hpp>

/// The conformance data: $DGPS_TEST_DATA_DIR when set (the GPU machine has its own checkout path).
inline const char* dgps_cuda_test_data() {
  const char* e = std::getenv("DGPS_TEST_DATA_DIR");
  return e && *e ? e : DGPS_TEST_DATA_DEFAULT;
}
#define DGPS_TEST_DATA dgps_cuda_test_data()
#include "../support.hpp"

namespace dgps_gpu_test {

using dgps::cuda::DType;
using dgps_test::Arrays;
using dgps_test::Case;

/// Number of FAIL lines printed so far (the exit status of dgps_cuda_tests).
inline int g_failures = 0;

/// Exits with status 2 and a message on a CUDA runtime error.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

/// A device buffer freed on scope exit.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  /// Allocates `n` bytes (at least one).
  explicit DevBuf(size_t n) : bytes(n) { check_cuda(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  /// Takes the buffer of `o`, which becomes empty.
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  /// Swaps buffers with `o` (which frees ours).
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
};

/// Bytes per element of a device tensor of type d.
inline size_t elem_size(DType d) { return d == DType::f32 ? 4 : 2; }

/// Rounds to the given type and back (the values the GPU sees).
inline double round_to(double x, DType d) {
  if (d == DType::bf16) return double(__bfloat162float(__float2bfloat16(float(x))));
  if (d == DType::f16) return double(__half2float(__float2half(float(x))));
  return double(float(x));
}

/// A device copy of `v` converted to type d.
inline DevBuf upload(const std::vector<double>& v, DType d) {
  DevBuf b(v.size() * elem_size(d));
  std::vector<unsigned char> host(b.bytes ? b.bytes : 1);
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::f32) {
      const float f = float(v[i]);
      std::memcpy(&host[4 * i], &f, 4);
    } else if (d == DType::bf16) {
      const __nv_bfloat16 h = __float2bfloat16(float(v[i]));
      std::memcpy(&host[2 * i], &h, 2);
    } else {
      const __half h = __float2half(float(v[i]));
      std::memcpy(&host[2 * i], &h, 2);
    }
  }
  check_cuda(cudaMemcpy(b.p, host.data(), b.bytes, cudaMemcpyHostToDevice), "upload");
  return b;
}

/// The first `n` elements (type d) of a device buffer as float64 (exact: distinct bits stay distinct).
inline std::vector<double> download(const DevBuf& b, size_t n, DType d, size_t offset = 0) {
  std::vector<unsigned char> host(n * elem_size(d) + 1);
  check_cuda(cudaMemcpy(host.data(), static_cast<const char*>(b.p) + offset * elem_size(d), n * elem_size(d),
                        cudaMemcpyDeviceToHost),
             "download");
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (d == DType::f32) {
      float f;
      std::memcpy(&f, &host[4 * i], 4);
      out[i] = f;
    } else if (d == DType::bf16) {
      __nv_bfloat16 h;
      std::memcpy(&h, &host[2 * i], 2);
      out[i] = __bfloat162float(h);
    } else {
      __half h;
      std::memcpy(&h, &host[2 * i], 2);
      out[i] = __half2float(h);
    }
  }
  return out;
}

/// Fills `bytes` bytes at `p` with 0xff (NaN in every float type) and waits for it: cudaMemset runs on
/// the legacy default stream, asynchronously to the host, and work on a non-blocking stream (a graph's
/// replay) does not wait for it, so an unwaited poison could land after the outputs were written.
inline void poison(void* p, size_t bytes) {
  check_cuda(cudaMemset(p, 0xff, bytes), "poison");
  check_cuda(cudaDeviceSynchronize(), "poison");
}

/// A device buffer of `bytes` filled with 0xff (poison), so missing writes show.
inline DevBuf poisoned(size_t bytes) {
  DevBuf b(bytes);
  poison(b.p, b.bytes);
  return b;
}

/// A copy of the case with q, k, v rounded to `d` and the gates to `gd` (what the GPU computes on).
inline Case rounded(const Case& c, DType d, DType gd) {
  Case r = c;
  for (auto& [n, v] : r.arr) {
    const bool io = n == "q" || n == "k" || n == "v";
    const bool gate = n == "g" || n == "beta" || n == "g_p" || n == "beta_p" || n == "center";
    if (io || gate)
      for (auto& x : v) x = round_to(x, io ? d : gd);
  }
  return r;
}

/// The contiguous tensor [., d1, d2, d3] on `b`, or an absent tensor when `b` holds nothing.
inline dgps::cuda::Tensor contiguous4(const DevBuf& b, int64_t d1, int64_t d2, int64_t d3) {
  return b.p ? dgps::cuda::Tensor::contiguous(b.p, d1, d2, d3) : dgps::cuda::Tensor{};
}

/// Prints an ok/FAIL line for `err` against `tol` (counting failures).
inline void report(const std::string& name, const char* what, double err, double tol, const std::string& impl) {
  const bool ok = err < tol;
  if (!ok) ++g_failures;
  std::printf("%-5s %-44s %-3s err %.3e (tol %.0e) %s\n", ok ? "ok" : "FAIL", name.c_str(), what, err, tol,
              impl.c_str());
}

/// Prints an ok/FAIL line for a yes/no check (counting failures).
inline void report_check(bool ok, const std::string& what) {
  if (!ok) ++g_failures;
  std::printf("%-5s %s\n", ok ? "ok" : "FAIL", what.c_str());
}

/// Device copies of a case's inputs (q, k, v of type d; gates of type gd; h0, a0 float32;
/// cu_seqlens) and the dgps::cuda::Params describing them, outputs left absent.
struct DeviceCase {
  std::map<std::string, DevBuf> buf;
  DevBuf cu;
  dgps::cuda::Params p;

  /// Uploads the inputs of `c` and fills `p` (options from `c.opt`, the algorithm `alg`).
  DeviceCase(const Case& c, DType d, DType gd, dgps::Algorithm alg) {
    const int64_t T = c.shape.time, H = c.shape.heads, HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim;
    for (const char* n : {"q", "k", "v"})
      if (c.has(n)) buf[n] = upload(c.arr.at(n), d);
    for (const char* n : {"g", "beta", "g_p", "beta_p", "center"})
      if (c.has(n)) buf[n] = upload(c.arr.at(n), gd);
    for (const char* n : {"h0", "a0"})
      if (c.has(n)) buf[n] = upload(c.arr.at(n), DType::f32);
    if (!c.cu.empty()) {
      cu = DevBuf(c.cu.size() * sizeof(int64_t));
      check_cuda(cudaMemcpy(cu.p, c.cu.data(), cu.bytes, cudaMemcpyHostToDevice), "cu_seqlens");
    }
    p.spec = c.spec;
    p.dtype = d;
    p.gate_dtype = gd;
    p.B = c.shape.batch, p.T = T, p.H = H, p.HV = HV, p.K = K, p.V = V, p.N = c.N;
    p.q = contiguous4(buf["q"], T, H, K);
    p.k = contiguous4(buf["k"], T, H, K);
    p.v = contiguous4(buf["v"], T, HV, V);
    p.g = contiguous4(buf["g"], T, HV, c.spec.decay == dgps::decay::Kind::diagonal ? K : 1);
    p.beta = contiguous4(buf["beta"], T, HV, 1);
    p.g_p = contiguous4(buf["g_p"], T, H, 1);
    p.beta_p = contiguous4(buf["beta_p"], T, H, 1);
    p.center = contiguous4(buf["center"], 1, 1, 1);
    p.h0 = contiguous4(buf["h0"], HV, K, V);
    p.a0 = contiguous4(buf["a0"], H, K, 1);
    p.cu_seqlens = c.cu.empty() ? nullptr : static_cast<const int64_t*>(cu.p);
    p.scale = float(c.opt.scale ? *c.opt.scale : 1.0 / std::sqrt(double(K)));
    p.x = float(c.opt.x);
    p.eps = float(c.opt.eps);
    p.lambda = float(c.opt.lambda);
    p.l2norm = c.opt.l2norm_qk;
    p.algorithm = alg;
  }
};

/// True when two downloaded arrays hold the same bits (download's float64 values are exact and distinct
/// for distinct bit patterns, so comparing their bytes compares the device buffers' bytes).
inline bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

/// A CUDA graph of the calls `record(stream)` makes, captured on a stream of its own (non-blocking);
/// replay() launches it there and waits for it.
class CapturedGraph {
 public:
  template <class F>
  explicit CapturedGraph(F&& record) {
    check_cuda(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "stream");
    check_cuda(cudaStreamBeginCapture(s_, cudaStreamCaptureModeGlobal), "capture");
    record(s_);
    check_cuda(cudaStreamEndCapture(s_, &g_), "end capture");
    check_cuda(cudaGraphInstantiate(&ge_, g_, 0), "instantiate");
  }
  ~CapturedGraph() { cudaGraphExecDestroy(ge_), cudaGraphDestroy(g_), cudaStreamDestroy(s_); }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void replay() {
    check_cuda(cudaGraphLaunch(ge_, s_), "graph launch");
    check_cuda(cudaStreamSynchronize(s_), "graph replay");
  }

 private:
  cudaStream_t s_ = nullptr;
  cudaGraph_t g_ = nullptr;
  cudaGraphExec_t ge_ = nullptr;
};

/// A random problem of the named model (dgps_test::random_case) with the default options.
inline Case make_random(const char* model, dgps::Shape s, std::vector<int64_t> cu, uint64_t seed,
                        const dgps_test::Gen& gen = {}) {
  Case c = dgps_test::random_case(dgps::model_by_name(model), s, cu, seed, gen);
  c.opt = dgps::Options{};
  return c;
}

/// The float64 reference forward of a case (dgps::reference, SPEC §2 token by token).
inline Arrays reference_forward(const Case& c) {
  return dgps::dispatch(c.spec, [&]<class R>() {
    dgps_test::CaseTensors<double> ct(c);
    const int64_t HV = c.shape.v_heads, K = c.shape.key_dim, V = c.shape.value_dim, H = c.shape.heads;
    std::vector<double> o(std::max<int64_t>(c.shape.batch * c.shape.time * HV * V, 1));
    std::vector<double> hT(c.N * HV * K * V), aT(c.N * H * K);
    auto in = ct.inputs(c);
    auto out = dgps::outputs<double>(o.data()).final_state(
        hT.data(), c.spec.precond == dgps::precond::Kind::identity ? nullptr : aT.data());
    const auto p = dgps::detail::check_forward<R>(in, out, c.opt);
    dgps::reference::forward<R, double, double>(p, 1);
    o.resize(c.shape.batch * c.shape.time * HV * V);
    Arrays r{{"o", o}, {"hT", hT}};
    if (c.spec.precond != dgps::precond::Kind::identity) r["aT"] = aT;
    return r;
  });
}

/// The backward-pass tests (test_cuda_backward.cpp); `quick`: float32 conformance and one small random case.
void backward_tests(dgps::cuda::Workspace& ws, bool quick);

/// The exact preconditioners' tests (test_cuda_exact.cpp); `quick`: the small shapes only.
void exact_tests(dgps::cuda::Workspace& ws, bool quick);

/// FLA's metric rms(x - ref) / rms(ref) (rms(x - ref) when ref is zero); infinity if any x is not finite.
inline double rms_rel(const std::vector<double>& x, const std::vector<double>& ref) {
  if (x.size() != ref.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    diff += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff / double(x.size() ? x.size() : 1));
}

}  // namespace dgps_gpu_test
