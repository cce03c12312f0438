/// @brief The torch.ops.dgps operators: schema, argument parsing and the host (CPU) implementation.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <dgps/recurrence.hpp>
#include <dgps/training_cache.hpp>
#if defined(DGPS_TORCH_HAS_DYNAMIC)
#include <dgps/dynamic.hpp>
#endif

#include "common.hpp"
#include "models.hpp"
#include "ops.hpp"

namespace dgps_torch {

dgps::ModelSpec parse_model(const std::string& s) {
  if (s.find(',') == std::string::npos) return dgps::model_by_name(s);
  std::vector<std::string> part;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == ',') part.push_back(s.substr(start, i - start)), start = i + 1;
  TORCH_CHECK(part.size() == 4, "dgps: model axes are 'decay,gain,precond,solve', got '", s, "'");
  dgps::ModelSpec m;
  const std::string& d = part[0];
  TORCH_CHECK(d == "none" || d == "scalar" || d == "diagonal", "dgps: decay must be none, scalar or diagonal, got '", d,
              "'");
  m.decay = d == "none"     ? dgps::decay::Kind::none
            : d == "scalar" ? dgps::decay::Kind::scalar
                            : dgps::decay::Kind::diagonal;
  TORCH_CHECK(part[1] == "unit" || part[1] == "scalar", "dgps: gain must be unit or scalar, got '", part[1], "'");
  m.gain = part[1] == "unit" ? dgps::gain::Kind::unit : dgps::gain::Kind::scalar;
  const char* pn[] = {"identity", "diag-atk", "diag-atq", "exact-atk", "exact-atq"};
  bool found = false;
  for (int i = 0; i < 5; ++i)
    if (part[2] == pn[i]) m.precond = dgps::precond::Kind(i), found = true;
  TORCH_CHECK(found, "dgps: precond must be identity, diag-atk, diag-atq, exact-atk or exact-atq, got '", part[2], "'");
  TORCH_CHECK(part[3] == "online" || part[3] == "offline", "dgps: solve must be online or offline, got '", part[3],
              "'");
  m.solve = part[3] == "online" ? dgps::solve::Kind::online : dgps::solve::Kind::offline;
  return m;
}

dgps::Backend parse_backend(const std::string& s) {
  if (s == "automatic") return dgps::Backend::automatic;
  if (s == "reference") return dgps::Backend::reference;
  if (s == "cpu") return dgps::Backend::cpu;
  if (s == "cuda") return dgps::Backend::cuda;
  TORCH_CHECK(false, "dgps: backend must be automatic, reference, cpu or cuda, got '", s, "'");
}

namespace {

struct Entry {
  dgps::ModelSpec spec;
  const char* name;
  ForwardFn fwd;
  BackwardFn bwd;
  DecodeFn dec;
};

#define DGPS_TORCH_ENTRY(name) \
  Entry{dgps::spec_of<models::name>(), #name, &forward_##name, &backward_##name, &decode_##name},
const Entry kEntries[] = {DGPS_TORCH_MODELS(DGPS_TORCH_ENTRY)};
#undef DGPS_TORCH_ENTRY

const Entry* find_entry(const dgps::ModelSpec& s) {
  for (const Entry& e : kEntries)
    if (e.spec == s) return &e;
  return nullptr;
}

[[noreturn]] void not_compiled(const dgps::ModelSpec& s) {
  TORCH_CHECK(false, "dgps_torch: model '", dgps::to_string(s),
              "' is not compiled into this build for this dtype (compiled for every dtype: ", compiled_models(),
#if defined(DGPS_TORCH_HAS_DYNAMIC)
              "; every other combination for float32 and float64"
#else
              "; build with DGPS_TORCH_DYNAMIC=ON for every combination in float32 and float64"
#endif
              ")");
}

#if defined(DGPS_TORCH_HAS_DYNAMIC)
template <class T>
dgps::Inputs<T> dyn_inputs(const Args& a) {
  using S = dgps::state_t<T>;
  const dgps::Shape shape{a.q.size(0), a.q.size(1), a.q.size(2), a.v.size(2), a.q.size(3), a.v.size(3)};
  dgps::Inputs<T> in = dgps::inputs<T>(shape, view_of<const T>(a.q), view_of<const T>(a.k), view_of<const T>(a.v));
  in.g = view_of<const T>(a.g), in.beta = view_of<const T>(a.beta), in.g_p = view_of<const T>(a.g_p);
  in.beta_p = view_of<const T>(a.beta_p), in.center = view_of<const T>(a.center);
  in.h0 = view_of<const S>(a.h0), in.a0 = view_of<const S>(a.a0);
  in.cu_seqlens = view_of<const int64_t>(a.cu_seqlens);
  return in;
}
template <class T>
dgps::TensorView<T> maybe(const Tensor& t) {
  return t.defined() ? view_of<T>(t) : dgps::TensorView<T>{};
}
template <class F>
bool dyn_dtype(at::ScalarType st, F&& f) {
  if (st == at::kFloat) return f(float{}), true;
  if (st == at::kDouble) return f(double{}), true;
  return false;
}
#endif

// Training caches of CPU forwards, owned here between the forward and its backward: the op returns a
// handle (a 0-dim int64 tensor) that the Python autograd function releases.
std::mutex g_cache_mutex;
std::unordered_map<int64_t, std::unique_ptr<dgps::TrainingCache>> g_caches;
std::atomic<int64_t> g_next_handle{1};

}  // namespace

std::string compiled_models() {
  std::string s;
  for (const Entry& e : kEntries) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

void cpu_forward(const Args& a, const Tensor& o, const Tensor& hT, const Tensor& aT, dgps::TrainingCache* cache) {
  if (const Entry* e = find_entry(a.spec)) return e->fwd(a, o, hT, aT, cache);
#if defined(DGPS_TORCH_HAS_DYNAMIC)
  if (dyn_dtype(a.q.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        using S = dgps::state_t<T>;
        dgps::Outputs<T> out = dgps::outputs<T>(view_of<T>(o));
        out.hT = maybe<S>(hT), out.aT = maybe<S>(aT), out.cache = cache;
        dgps::dynamic::forward<T>(a.spec, dyn_inputs<T>(a), out, a.opt);
      }))
    return;
#endif
  not_compiled(a.spec);
}

void cpu_backward(const Args& a, const Tensor& d_o, const OptTensor& dhT, const OptTensor& daT, const GradTensors& r,
                  const dgps::TrainingCache* cache) {
  if (const Entry* e = find_entry(a.spec)) return e->bwd(a, d_o, dhT, daT, r, cache);
#if defined(DGPS_TORCH_HAS_DYNAMIC)
  if (dyn_dtype(a.q.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        using S = dgps::state_t<T>;
        dgps::GradsIn<T> gin;
        gin.d_o = view_of<const T>(d_o), gin.dhT = view_of<const S>(dhT), gin.daT = view_of<const S>(daT);
        gin.cache = cache;
        dgps::Grads<T> gr;
        gr.dq = maybe<T>(r.dq), gr.dk = maybe<T>(r.dk), gr.dv = maybe<T>(r.dv), gr.dg = maybe<T>(r.dg);
        gr.dbeta = maybe<T>(r.dbeta), gr.dg_p = maybe<T>(r.dg_p), gr.dbeta_p = maybe<T>(r.dbeta_p);
        gr.dcenter = maybe<T>(r.dcenter), gr.dh0 = maybe<S>(r.dh0), gr.da0 = maybe<S>(r.da0);
        dgps::dynamic::backward<T>(a.spec, dyn_inputs<T>(a), gin, gr, a.opt);
      }))
    return;
#endif
  not_compiled(a.spec);
}

Args make_args(const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
               const OptTensor& beta, const OptTensor& g_p, const OptTensor& beta_p, const OptTensor& center,
               const OptTensor& h0, const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale,
               bool l2norm, double x, double eps, double lamb, const std::string& backend, int64_t chunk_size) {
  Args a{parse_model(model), q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, {}};
  if (scale.has_value()) a.opt.scale = *scale;
  a.opt.l2norm_qk = l2norm;
  a.opt.x = x;
  a.opt.eps = eps;
  a.opt.lambda = lamb;
  a.opt.backend = parse_backend(backend);
  a.opt.chunk_size = chunk_size;
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, "dgps: q and v must be 4-D [B, T, H, K] and [B, T, HV, V], got ", q.sizes(),
              " and ", v.sizes());
  return a;
}

StateShapes state_shapes(const Args& a) {
  const int64_t N = num_seqs(a), H = a.q.size(2), HV = a.v.size(2), K = a.q.size(3), V = a.v.size(3);
  StateShapes s;
  s.h = {N, HV, K, V};
  const bool exact =
      a.spec.precond == dgps::precond::Kind::exact_atk || a.spec.precond == dgps::precond::Kind::exact_atq;
  if (a.spec.precond != dgps::precond::Kind::identity)
    s.a = exact ? std::vector<int64_t>{N, H, K, K} : std::vector<int64_t>{N, H, K};
  return s;
}

at::ScalarType state_dtype(const Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> forward_cpu(
    const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
    const OptTensor& beta, const OptTensor& g_p, const OptTensor& beta_p, const OptTensor& center, const OptTensor& h0,
    const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale, bool l2norm, double x, double eps,
    double lamb, bool output_final_state, bool save, const std::string& backend, int64_t chunk_size) {
  const Args a = make_args(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps,
                           lamb, backend, chunk_size);
  const auto opts = q.options();
  Tensor o = at::empty({q.size(0), q.size(1), v.size(2), v.size(3)}, opts);
  const StateShapes ss = state_shapes(a);
  Tensor hT = at::empty(output_final_state ? at::IntArrayRef(ss.h) : at::IntArrayRef{0}, opts.dtype(state_dtype(q)));
  Tensor aT = at::empty(output_final_state && !ss.a.empty() ? at::IntArrayRef(ss.a) : at::IntArrayRef{0},
                        opts.dtype(state_dtype(q)));
  std::unique_ptr<dgps::TrainingCache> cache;
  if (save) cache = std::make_unique<dgps::TrainingCache>();
  cpu_forward(a, o, output_final_state ? hT : Tensor(), output_final_state && !ss.a.empty() ? aT : Tensor(),
              cache.get());
  int64_t handle = 0;
  if (cache && cache->filled()) {
    handle = g_next_handle++;
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    g_caches.emplace(handle, std::move(cache));
  }
  return {o, hT, aT, at::scalar_tensor(handle, at::TensorOptions().dtype(at::kLong))};
}

std::vector<Tensor> backward_cpu(const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const OptTensor& g, const OptTensor& beta, const OptTensor& g_p,
                                 const OptTensor& beta_p, const OptTensor& center, const OptTensor& h0,
                                 const OptTensor& a0, const OptTensor& cu_seqlens, c10::optional<double> scale,
                                 bool l2norm, double x, double eps, double lamb, const std::string& backend,
                                 int64_t chunk_size, const Tensor& d_o, const OptTensor& dhT, const OptTensor& daT,
                                 const Tensor& handle) {
  const Args a = make_args(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps,
                           lamb, backend, chunk_size);
  GradTensors r = allocate_grads(a);
  std::unique_ptr<dgps::TrainingCache> cache;
  const int64_t h = handle.defined() && handle.numel() == 1 ? handle.item<int64_t>() : 0;
  if (h != 0) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    auto it = g_caches.find(h);
    if (it != g_caches.end()) cache = std::move(it->second), g_caches.erase(it);
  }
  cpu_backward(a, d_o, dhT, daT, r, cache.get());
  return grads_list(r);
}

void release_cache(const Tensor& handle) {
  if (!handle.defined() || handle.numel() != 1 || handle.device().type() != at::kCPU) return;
  const int64_t h = handle.item<int64_t>();
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_caches.erase(h);
}

std::string compiled_models_op() { return compiled_models(); }

/// Decode / prefill through a state pool: `h` [P, HV, K, V] (and `a`) updated in place at the slots that the
/// index tensors name (dgps::DecodeState; int64 indices, uint8 has_initial); returns o [B, T, HV, V].
Tensor decode_cpu(const std::string& model, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
                  const OptTensor& beta, const OptTensor& g_p, const OptTensor& beta_p, const OptTensor& center,
                  const Tensor& h, const OptTensor& a, const OptTensor& cu_seqlens, const OptTensor& slots,
                  const OptTensor& out_slots, const OptTensor& has_initial, const OptTensor& token_slots,
                  const OptTensor& num_accepted, c10::optional<double> scale, bool l2norm, double x, double eps,
                  double lamb, const std::string& backend, const std::string& algorithm, int64_t chunk_size) {
  Args args = make_args(model, q, k, v, g, beta, g_p, beta_p, center, c10::nullopt, c10::nullopt, cu_seqlens, scale,
                        l2norm, x, eps, lamb, backend, chunk_size);
  try {
    args.opt.algorithm = dgps::algorithm_from_string(algorithm);
  } catch (const dgps::Error& e) {
    TORCH_CHECK(false, e.what());
  }
  const Entry* e = find_entry(args.spec);
  TORCH_CHECK(e, "dgps_torch: decode through a state pool is compiled for ", compiled_models(), ", not for '",
              dgps::to_string(args.spec), "'");
  auto opt_t = [](const OptTensor& t) { return given(t) ? *t : Tensor(); };
  const PoolIndices ix{opt_t(slots), opt_t(out_slots), opt_t(has_initial), opt_t(token_slots), opt_t(num_accepted)};
  Tensor o = at::zeros({q.size(0), q.size(1), v.size(2), v.size(3)}, q.options());
  try {
    e->dec(args, o, h, opt_t(a), ix);
  } catch (const dgps::Error& err) {
    TORCH_CHECK_VALUE(false, err.what());
  }
  return o;
}

}  // namespace

GradTensors allocate_grads(const Args& a) {
  auto like = [](const OptTensor& t) { return given(t) ? at::empty_like(*t, at::MemoryFormat::Contiguous) : Tensor(); };
  GradTensors r;
  r.dq = at::empty_like(a.q, at::MemoryFormat::Contiguous);
  r.dk = at::empty_like(a.k, at::MemoryFormat::Contiguous);
  r.dv = at::empty_like(a.v, at::MemoryFormat::Contiguous);
  r.dg = like(a.g), r.dbeta = like(a.beta), r.dg_p = like(a.g_p), r.dbeta_p = like(a.beta_p);
  r.dcenter = like(a.center), r.dh0 = like(a.h0), r.da0 = like(a.a0);
  return r;
}

std::vector<Tensor> grads_list(const GradTensors& r) {
  std::vector<Tensor> out;
  for (const Tensor& t : {r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dg_p, r.dbeta_p, r.dcenter, r.dh0, r.da0})
    out.push_back(t.defined() ? t : at::empty({0}, r.dq.options()));
  return out;
}

}  // namespace dgps_torch

TORCH_LIBRARY(dgps, m) {
  m.def(
      "forward(str model, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? g_p, Tensor? beta_p, "
      "Tensor? center, Tensor? h0, Tensor? a0, Tensor? cu_seqlens, float? scale, bool l2norm, float x, float eps, "
      "float lamb, bool output_final_state, bool save, str backend, int chunk_size) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "backward(str model, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? g_p, Tensor? beta_p, "
      "Tensor? center, Tensor? h0, Tensor? a0, Tensor? cu_seqlens, float? scale, bool l2norm, float x, float eps, "
      "float lamb, str backend, int chunk_size, Tensor d_o, Tensor? dhT, Tensor? daT, Tensor handle) -> Tensor[]");
  m.def(
      "decode(str model, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? g_p, Tensor? beta_p, "
      "Tensor? center, Tensor(a!) h, Tensor(b!)? a, Tensor? cu_seqlens, Tensor? slots, Tensor? out_slots, "
      "Tensor? has_initial, Tensor? token_slots, Tensor? num_accepted, float? scale, bool l2norm, float x, float eps, "
      "float lamb, str backend, str algorithm, int chunk_size) -> Tensor");
  m.def("release_cache(Tensor handle) -> ()");
  m.def("compiled_models() -> str", &dgps_torch::compiled_models_op);
  m.def("has_cuda() -> bool", []() {
#if defined(DGPS_TORCH_HAS_CUDA)
    return true;
#else
    return false;
#endif
  });
}

TORCH_LIBRARY_IMPL(dgps, CPU, m) {
  m.impl("forward", &dgps_torch::forward_cpu);
  m.impl("backward", &dgps_torch::backward_cpu);
  m.impl("release_cache", &dgps_torch::release_cache);
  m.impl("decode", &dgps_torch::decode_cpu);
}
