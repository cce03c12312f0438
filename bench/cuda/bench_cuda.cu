/// @brief dgps::cuda benchmark: forward, forward + backward and decode of the issue's shapes; CUDA events, median.
///
/// Prints one CSV row per case (`impl,model,case,B,T,H,HV,K,V,ms,tokens_per_s,tflops,gbps,copy_frac`)
/// and writes the same rows to argv[1] when given. FLOPs count the recurrent form, 6*K*V per token
/// and value head (S^T k, the rank-1 write, S^T q) for a forward and twice that for a backward;
/// bytes count the unavoidable traffic: every input read once, o and the final states written once
/// (decode: the state read and written; backward: the inputs and do read, the gradients written).
/// Backward rows also record the bytes of workspace dgps::cuda::backward needs (`mem_bytes`).
/// argv[2] filters: the models whose names it contains (e.g. `gdn` runs gdn and pgdn); with `fwd` in
/// it, only the forward rows; `none` runs only the decode rows.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <dgps/cuda.hpp>

#include "plan.hpp"

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

__device__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return float(x >> 40) * (1.0f / 16777216.0f);
}

/// kind 0: approximately normal; 1: logsigmoid(normal) (a log-decay); 2: sigmoid(normal) (a gain).
template <class T>
__global__ void fill(T* p, int64_t n, uint64_t seed, int kind) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float z = (hash_uniform(i, seed) + hash_uniform(i, seed + 1) + hash_uniform(i, seed + 2) - 1.5f) * 2.0f;
    float x = z;
    if (kind == 1) x = -log1pf(expf(-z));
    if (kind == 2) x = 1.f / (1.f + expf(-z));
    p[i] = T(x);
  }
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { ck(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc"); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

template <class T>
void fill_buf(Buf& b, int64_t n, uint64_t seed, int kind) {
  fill<T><<<1024, 256>>>(static_cast<T*>(b.p), n, seed, kind);
  ck(cudaGetLastError(), "fill");
}

double g_copy_gbps = 0;

/// Device-to-device copy bandwidth (read + write bytes per second) over 2 GiB, median of 20.
double copy_bandwidth() {
  const size_t bytes = size_t(1) << 31;
  Buf a(bytes), b(bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  std::vector<float> t;
  for (int i = 0; i < 25; ++i) {
    cudaEventRecord(e0);
    ck(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice), "copy");
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 5) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return 2.0 * bytes / (t[t.size() / 2] * 1e-3) / 1e9;
}

struct Row {
  std::string model, name;
  int64_t B, T, H, HV, K, V;
  double ms, bytes, flops;
  std::string impl;
  size_t mem_bytes = 0;  ///< backward rows: dgps::cuda::backward_workspace_bytes (0 otherwise)
};
std::vector<Row> g_rows;

void emit(const Row& r) {
  g_rows.push_back(r);
  const double s = r.ms * 1e-3;
  std::printf("dgps,%s,%s,%lld,%lld,%lld,%lld,%lld,%lld,%.4f,%.4g,%.2f,%.1f,%.3f,%s\n", r.model.c_str(), r.name.c_str(),
              (long long)r.B, (long long)r.T, (long long)r.H, (long long)r.HV, (long long)r.K, (long long)r.V, r.ms,
              r.B * r.T / s, r.flops / s / 1e12, r.bytes / s / 1e9, r.bytes / s / 1e9 / g_copy_gbps, r.impl.c_str());
  std::fflush(stdout);
}

/// Median time in ms of `f` over `reps` runs after `warm` warm-up runs, each timed with events.
int g_warm = 5, g_reps = 30;

template <class F>
double median_ms(F&& f, int warm = g_warm, int reps = g_reps) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  std::vector<float> t;
  for (int i = 0; i < warm + reps; ++i) {
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    ck(cudaEventSynchronize(e1), "timed run");
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= warm) t.push_back(ms);
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Median time in ms of one call of `f(stream)` replayed from a CUDA graph: one eager call first (it sizes the
/// workspace), then a graph of G calls (G so that a replay takes about a millisecond, 1 to `max_calls`) replayed
/// 20 times after 5 warm-up replays; the median replay over G.
template <class F>
double graph_ms(F&& f, int max_calls = 20) {
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  f(s);
  cudaEventRecord(e0, s);
  for (int i = 0; i < 3; ++i) f(s);
  cudaEventRecord(e1, s);
  ck(cudaEventSynchronize(e1), "eager runs");
  float eager;
  cudaEventElapsedTime(&eager, e0, e1);
  const int G = std::clamp(int(3.0f / std::max(eager, 1e-3f)), 1, max_calls);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < G; ++i) f(s);
  ck(cudaStreamEndCapture(s, &g), "end capture");
  ck(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  std::vector<float> t;
  for (int i = 0; i < 25; ++i) {
    cudaEventRecord(e0, s);
    cudaGraphLaunch(ge, s);
    cudaEventRecord(e1, s);
    ck(cudaEventSynchronize(e1), "graph replay");
    float m;
    cudaEventElapsedTime(&m, e0, e1);
    if (i >= 5) t.push_back(m / G);
  }
  cudaGraphExecDestroy(ge), cudaGraphDestroy(g), cudaStreamDestroy(s);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// All inputs of a model for [B, T] tokens, bf16 q/k/v/o, float32 gates and states.
struct Problem {
  dgps::cuda::Params p;
  std::vector<Buf*> owned;
  double in_bytes = 0;
  ~Problem() {
    for (Buf* b : owned) delete b;
  }
  Buf& make(size_t bytes) {
    owned.push_back(new Buf(bytes));
    return *owned.back();
  }
};

void setup(Problem& pr, const char* model, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
           uint64_t seed) {
  using dgps::cuda::Tensor;
  auto& p = pr.p;
  p.spec = dgps::model_by_name(model);
  p.dtype = dgps::cuda::DType::bf16;
  p.gate_dtype = dgps::cuda::DType::f32;
  p.B = B, p.T = T, p.H = H, p.HV = HV, p.K = K, p.V = V, p.N = B;
  auto bf = [&](int64_t n, int kind) {
    Buf& b = pr.make(size_t(n) * 2);
    fill_buf<__nv_bfloat16>(b, n, seed++, kind);
    pr.in_bytes += 2.0 * n;
    return b.p;
  };
  auto f32 = [&](int64_t n, int kind) {
    Buf& b = pr.make(size_t(n) * 4);
    fill_buf<float>(b, n, seed++, kind);
    pr.in_bytes += 4.0 * n;
    return b.p;
  };
  p.q = Tensor::contiguous(bf(B * T * H * K, 0), T, H, K);
  p.k = Tensor::contiguous(bf(B * T * H * K, 0), T, H, K);
  p.v = Tensor::contiguous(bf(B * T * HV * V, 0), T, HV, V);
  if (p.spec.decay == dgps::decay::Kind::scalar) p.g = Tensor::contiguous(f32(B * T * HV, 1), T, HV, 1);
  if (p.spec.decay == dgps::decay::Kind::diagonal) p.g = Tensor::contiguous(f32(B * T * HV * K, 1), T, HV, K);
  if (p.spec.gain == dgps::gain::Kind::scalar) p.beta = Tensor::contiguous(f32(B * T * HV, 2), T, HV, 1);
  if (p.spec.precond != dgps::precond::Kind::identity) {
    p.g_p = Tensor::contiguous(f32(B * T * H, 1), T, H, 1);
    p.beta_p = Tensor::contiguous(f32(B * T * H, 2), T, H, 1);
    p.center = Tensor::contiguous(f32(H, 0), 1, 1, 1);
  }
  p.o = Tensor::contiguous(pr.make(size_t(B * T * HV * V) * 2).p, T, HV, V);
}

void bench_forward(const char* model, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V,
                   dgps::Algorithm alg = dgps::Algorithm::automatic) {
  Problem pr;
  setup(pr, model, B, T, H, H, K, V, 1);
  auto& p = pr.p;
  p.algorithm = alg;
  p.hT = dgps::cuda::Tensor::contiguous(pr.make(size_t(B * H * K * V) * 4).p, H, K, V);
  const bool prec = p.spec.precond != dgps::precond::Kind::identity;
  if (prec) p.aT = dgps::cuda::Tensor::contiguous(pr.make(size_t(B * H * K) * 4).p, H, K, 1);
  dgps::cuda::Workspace ws;
  const char* impl = "";
  const double ms = median_ms([&] { impl = dgps::cuda::forward(p, ws, nullptr); });
  const double bytes = pr.in_bytes + 2.0 * B * T * H * V + 4.0 * B * H * K * V + (prec ? 4.0 * B * H * K : 0);
  const std::string suffix = alg == dgps::Algorithm::recurrent ? "_recurrent" : "";
  emit({model, "fwd_B" + std::to_string(B) + "_T" + std::to_string(T) + "_H" + std::to_string(H) + suffix, B, T, H, H,
        K, V, ms, bytes, 6.0 * K * V * H * B * T, impl});
}

/// Forward + backward (every gradient, no dhT/daT: a training step's recurrence), with the training
/// forward's saved activations and with the backward recomputing them, and backward alone; bf16
/// q/k/v/o/do, float32 gates, K = V = 128, one workspace reused by every call.
void bench_backward(const char* model, int64_t B, int64_t T, int64_t H) {
  using dgps::cuda::Tensor;
  const int64_t K = 128, V = 128;
  Problem pr;
  setup(pr, model, B, T, H, H, K, V, 3);
  const dgps::cuda::Params& p = pr.p;
  const double fwd_bytes = pr.in_bytes + 2.0 * B * T * H * V;
  Buf& d_o = pr.make(size_t(B * T * H * V) * 2);
  fill_buf<__nv_bfloat16>(d_o, B * T * H * V, 11, 0);
  dgps::cuda::GradParams g;
  g.d_o = Tensor::contiguous(d_o.p, T, H, V);
  auto grad = [&](const Tensor& in, int64_t n, size_t elem) {
    Tensor t = in;  // the input's strides
    t.data = in.data ? pr.make(size_t(n) * elem).p : nullptr;
    return t;
  };
  const int64_t gk = p.spec.decay == dgps::decay::Kind::diagonal ? K : 1;
  g.dq = grad(p.q, B * T * H * K, 2), g.dk = grad(p.k, B * T * H * K, 2), g.dv = grad(p.v, B * T * H * V, 2);
  g.dg = grad(p.g, B * T * H * gk, 4), g.dbeta = grad(p.beta, B * T * H, 4);
  g.dg_p = grad(p.g_p, B * T * H, 4), g.dbeta_p = grad(p.beta_p, B * T * H, 4), g.dcenter = grad(p.center, H, 4);
  const bool prec = p.spec.precond != dgps::precond::Kind::identity;
  g.dh0 = Tensor::contiguous(pr.make(size_t(B * H * K * V) * 4).p, H, K, V);
  if (prec) g.da0 = Tensor::contiguous(pr.make(size_t(B * H * K) * 4).p, H, K, 1);
  const size_t ws_bytes = dgps::cuda::backward_workspace_bytes(p);
  std::printf("# %s B%lld T%lld H%lld: backward workspace %.1f MiB\n", model, (long long)B, (long long)T, (long long)H,
              ws_bytes / 1048576.0);
  dgps::cuda::Workspace ws;
  const char* fwd_impl = "";
  const char* bwd_impl = "";
  // A training step: the forward keeps its activations for the backward (forward_training); beside
  // it, the plain forward followed by a backward that recomputes them.
  const double both = median_ms([&] {
    fwd_impl = dgps::cuda::forward_training(p, ws, nullptr);
    bwd_impl = dgps::cuda::backward(p, g, ws, nullptr);
  });
  const char* rec_impl = "";
  const double both_rec = median_ms([&] {
    dgps::cuda::forward(p, ws, nullptr);
    rec_impl = dgps::cuda::backward(p, g, ws, nullptr);
  });
  const char* alone_impl = "";  // the backward alone recomputes the forward's activations
  const double bwd = median_ms([&] { alone_impl = dgps::cuda::backward(p, g, ws, nullptr); });
  // Backward traffic: inputs and do read, a gradient of every input written, dh0/da0 written.
  const double bwd_bytes = 2.0 * pr.in_bytes + 2.0 * B * T * H * V + 4.0 * B * H * K * V + (prec ? 4.0 * B * H * K : 0);
  const double flops = 6.0 * K * V * H * B * T;
  const std::string shape = "_B" + std::to_string(B) + "_T" + std::to_string(T) + "_H" + std::to_string(H);
  emit({model, "fwdbwd" + shape, B, T, H, H, K, V, both, fwd_bytes + bwd_bytes, 3 * flops,
        std::string(fwd_impl) + "+" + bwd_impl, ws_bytes});
  emit({model, "fwdbwd_recompute" + shape, B, T, H, H, K, V, both_rec, fwd_bytes + bwd_bytes, 3 * flops,
        std::string(fwd_impl) + "+" + rec_impl, ws_bytes});
  emit({model, "bwd" + shape, B, T, H, H, K, V, bwd, bwd_bytes, 2 * flops, alone_impl, ws_bytes});
}

void bench_decode(const char* model, int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, bool graph) {
  Problem pr;
  setup(pr, model, B, 1, H, HV, K, V, 7);
  auto& p = pr.p;
  Buf& h = pr.make(size_t(B * HV * K * V) * 4);
  fill_buf<float>(h, B * HV * K * V, 99, 0);
  p.h0 = dgps::cuda::Tensor::contiguous(h.p, HV, K, V);
  const bool prec = p.spec.precond != dgps::precond::Kind::identity;
  if (prec) {
    Buf& a = pr.make(size_t(B * H * K) * 4);
    fill_buf<float>(a, B * H * K, 98, 2);
    p.a0 = dgps::cuda::Tensor::contiguous(a.p, H, K, 1);
  }
  dgps::cuda::Workspace ws;
  const char* impl = dgps::cuda::decode(p, ws, nullptr);  // sizes the workspace before any capture
  ck(cudaDeviceSynchronize(), "decode");
  double ms;
  std::string name = "decode_B" + std::to_string(B) + "_HV" + std::to_string(HV);
  if (graph) {  // up to 100 calls per graph (a call takes a few microseconds)
    ms = graph_ms([&](cudaStream_t s) { dgps::cuda::decode(p, ws, s); }, 100);
    name += "_graph";
  } else {
    ms = median_ms([&] { dgps::cuda::decode(p, ws, nullptr); });
  }
  const double bytes = pr.in_bytes + 2.0 * B * HV * V + 8.0 * B * HV * K * V + (prec ? 8.0 * B * H * K : 0);
  emit({model, name, B, 1, H, HV, K, V, ms, bytes, 6.0 * K * V * HV * B, impl});
}

/// One point of the plan grid: packed sequences of `lens` tokens (cu_seqlens), h_qk / h_v heads.
struct GridLayout {
  const char* name;
  std::vector<int64_t> lens;
};

/// The plan grid (--grid): the forward of GDN, PGDN, KDA and PKDA (bf16, K = V = 128, float32 gates, hT
/// written) on packed sequences (cu_seqlens, as serving engines and the public Hopper benchmarks call it)
/// at real models' head layouts, each point timed (CUDA graphs, graph_ms) with the automatic plan and with
/// every forced variant of the state pass: value tiles of 128, 64, 32, 16 columns without a split, and the
/// split pass with segments of 16 to 256 chunks (where that gives 2 to 64 segments). Prints a CSV row per
/// variant (`grid,model,layout,hqk,hv,variant,impl,ms,ns_per_token_head,floor_frac`, floor_frac: the
/// bytes floor, every input read and o, hT written once at the measured copy bandwidth, over the time)
/// and per point the best variant and the automatic plan's time over it; `only` filters models as main's;
/// `auto_only`: the automatic plan alone.
void bench_grid(const std::string& only, FILE* csv, bool auto_only) {
  using dgps::cuda::Tensor;
  namespace pt = dgps::cuda::testing;
  const GridLayout layouts[] = {{"1024x8", std::vector<int64_t>(8, 1024)}, {"2048x4", std::vector<int64_t>(4, 2048)},
                                {"4096x8", std::vector<int64_t>(8, 4096)}, {"8192x4", std::vector<int64_t>(4, 8192)},
                                {"1x2048", {2048}},
                                {"1x8192", {8192}},
                                {"1x32768", {32768}},
                                {"28672+4096", {28672, 4096}}};
  const std::pair<int64_t, int64_t> heads[] = {{2, 8}, {4, 16}, {8, 32}, {16, 16}, {16, 32}, {16, 64}, {32, 32}};
  std::printf("grid,model,layout,hqk,hv,variant,impl,ms,ns_per_token_head,floor_frac\n");
  if (csv) std::fprintf(csv, "model,layout,hqk,hv,variant,impl,ms,ns_per_token_head,floor_frac\n");
  const int64_t K = 128, V = 128;
  for (const char* m : {"gdn", "pgdn", "kda", "pkda"}) {
    if (!only.empty() && only.find(m) == std::string::npos) continue;
    for (const GridLayout& L : layouts)
      for (const auto& [H, HV] : heads) {
        std::vector<int64_t> cu{0};
        for (int64_t l : L.lens) cu.push_back(cu.back() + l);
        const int64_t T = cu.back(), N = int64_t(L.lens.size());
        const int64_t longest = *std::max_element(L.lens.begin(), L.lens.end());
        Problem pr;
        setup(pr, m, 1, T, H, HV, K, V, 5);
        auto& p = pr.p;
        p.N = N;
        Buf& cub = pr.make(sizeof(int64_t) * cu.size());
        ck(cudaMemcpy(cub.p, cu.data(), sizeof(int64_t) * cu.size(), cudaMemcpyHostToDevice), "cu_seqlens");
        p.cu_seqlens = static_cast<const int64_t*>(cub.p);
        p.hT = Tensor::contiguous(pr.make(size_t(N * HV * K * V) * 4).p, HV, K, V);
        const bool prec = p.spec.precond != dgps::precond::Kind::identity;
        if (prec) p.aT = Tensor::contiguous(pr.make(size_t(N * H * K) * 4).p, H, K, 1);
        const double bytes = pr.in_bytes + 2.0 * T * HV * V + 4.0 * N * HV * K * V + (prec ? 4.0 * N * H * K : 0);
        dgps::cuda::Workspace ws;
        struct Variant {
          std::string name;
          pt::PlanOverride o;
        };
        std::vector<Variant> vs{{"auto", {}}};
        if (!auto_only) {
          for (int vt : {128, 64, 32, 16}) {
            pt::PlanOverride o;
            o.state_vt = vt, o.split_chunks = 0;
            vs.push_back({"v" + std::to_string(vt), o});
          }
          const int64_t chunks = (longest + 63) / 64;
          for (int64_t seg : {16, 32, 64, 128, 256}) {
            const int64_t segs = (chunks + seg - 1) / seg;
            if (segs < 2 || segs > 64) continue;
            pt::PlanOverride o;
            o.split_chunks = seg;
            vs.push_back({"s" + std::to_string(seg), o});
          }
        }
        double auto_ms = 0, best_ms = 1e30;
        std::string best, auto_impl;
        std::vector<std::string> seen;  // variants that ran as another one already timed
        for (const Variant& v : vs) {
          const char* impl = "";
          double ms = 0;
          {
            const pt::ScopedPlanOverride forced(v.o);
            impl = dgps::cuda::forward(p, ws, nullptr);
            const std::string key = std::string(impl) + "/" + std::to_string(pt::last_plan().seg_chunks);
            if (v.name != "auto" && std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
            seen.push_back(key);
            ms = graph_ms([&](cudaStream_t s) { dgps::cuda::forward(p, ws, s); });
          }
          const double ns = ms * 1e6 / (double(T) * HV), frac = bytes / (ms * 1e-3) / 1e9 / g_copy_gbps;
          std::printf("grid,%s,%s,%lld,%lld,%s,%s,%.4f,%.3f,%.3f\n", m, L.name, (long long)H, (long long)HV,
                      v.name.c_str(), impl, ms, ns, frac);
          if (csv)
            std::fprintf(csv, "%s,%s,%lld,%lld,%s,%s,%.5f,%.4f,%.4f\n", m, L.name, (long long)H, (long long)HV,
                         v.name.c_str(), impl, ms, ns, frac);
          if (v.name == "auto") auto_ms = ms, auto_impl = impl;
          if (ms < best_ms) best_ms = ms, best = v.name;
        }
        std::printf("# %s %s h%lld/%lld: auto %.4f ms (%s), best %s %.4f ms, auto/best %.3f\n", m, L.name,
                    (long long)H, (long long)HV, auto_ms, auto_impl.c_str(), best.c_str(), best_ms, auto_ms / best_ms);
        std::fflush(stdout);
        if (csv) std::fflush(csv);
      }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!dgps::cuda::available()) {
    std::printf("SKIP: no CUDA GPU available\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "properties");
  // --profile M [bwd|bwdlong|decode]: kernels of one model's forward (or backward: bwd at B=8 T=2048,
  // bwdlong at B=1 T=32768; or decode at B=1 and B=256), run once each, for ncu.
  if (argc > 1 && std::string(argv[1]) == "--profile") {
    g_copy_gbps = 1;
    g_warm = 0, g_reps = 1;
    const char* m = argc > 2 ? argv[2] : "gdn";
    if (argc > 3 && std::string(argv[3]) == "bwd") {
      bench_backward(m, 8, 2048, 16);
      return 0;
    }
    if (argc > 3 && std::string(argv[3]) == "decode") {
      bench_decode(m, 1, 16, 32, 128, 128, false);
      bench_decode(m, 256, 16, 32, 128, 128, false);
      return 0;
    }
    if (argc > 3 && std::string(argv[3]) == "bwdlong") {
      bench_backward(m, 1, 32768, 16);
      return 0;
    }
    bench_forward(m, 8, 2048, 16, 128, 128);
    bench_forward(m, 1, 32768, 16, 128, 128);
    return 0;
  }
  g_copy_gbps = copy_bandwidth();
  // --grid [file] [models] [auto]: the plan grid (bench_grid), its rows also written to file; "auto": the
  // automatic plan only.
  if (argc > 1 && std::string(argv[1]) == "--grid") {
    std::printf("# device %s, %d SMs, measured copy bandwidth %.0f GB/s\n", prop.name, prop.multiProcessorCount,
                g_copy_gbps);
    FILE* f = argc > 2 ? std::fopen(argv[2], "w") : nullptr;
    bench_grid(argc > 3 ? argv[3] : "", f, argc > 4 && std::string(argv[4]) == "auto");
    if (f) std::fclose(f);
    return 0;
  }
  std::printf("# device %s, %d SMs, measured copy bandwidth %.0f GB/s\n", prop.name, prop.multiProcessorCount,
              g_copy_gbps);
  std::printf("impl,model,case,B,T,H,HV,K,V,ms,tokens_per_s,tflops,gbps,copy_frac,variant\n");
  const std::string only = argc > 2 ? argv[2] : "";
  for (const char* m : {"gdn", "pgdn", "pkda", "kda", "dn", "pdn", "mamba2", "pmamba2"}) {
    if (!only.empty() && only.find(m) == std::string::npos) continue;
    bench_forward(m, 8, 2048, 16, 128, 128);
    bench_forward(m, 1, 32768, 16, 128, 128);
    bench_forward(m, 4, 8192, 32, 128, 128);
    // The recurrent kernels on the same inputs, side by side with the chunkwise ones.
    if (dgps::cuda::supports(dgps::model_by_name(m), dgps::Algorithm::chunkwise))
      bench_forward(m, 8, 2048, 16, 128, 128, dgps::Algorithm::recurrent);
  }
  // "fwd" in the filter: the forward rows only (no training or decode rows).
  const bool fwd_only = only.find("fwd") != std::string::npos;
  const std::pair<const char*, std::pair<int64_t, int64_t>> training[] = {
      {"pgdn", {8, 2048}}, {"gdn", {8, 2048}}, {"pgdn", {1, 32768}}, {"pkda", {8, 2048}}, {"kda", {8, 2048}}};
  for (const auto& [m, bt] : training)
    if (!fwd_only && (only.empty() || only.find(m) != std::string::npos)) bench_backward(m, bt.first, bt.second, 16);
  for (const char* m : {"gdn", "pgdn"}) {
    if (fwd_only) break;
    bench_decode(m, 1, 16, 32, 128, 128, true);
    bench_decode(m, 64, 16, 32, 128, 128, false);
    bench_decode(m, 256, 16, 32, 128, 128, false);
  }
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f) {
      std::fprintf(f, "impl,model,case,B,T,HV,ms,bytes,flops,copy_gbps,variant,mem_bytes\n");
      for (const Row& r : g_rows)
        std::fprintf(f, "dgps,%s,%s,%lld,%lld,%lld,%.5f,%.6g,%.6g,%.1f,%s,%zu\n", r.model.c_str(), r.name.c_str(),
                     (long long)r.B, (long long)r.T, (long long)r.HV, r.ms, r.bytes, r.flops, g_copy_gbps,
                     r.impl.c_str(), r.mem_bytes);
      std::fclose(f);
    }
  }
  return 0;
}
