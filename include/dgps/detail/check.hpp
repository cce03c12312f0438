/// @brief Validation: every shape, stride, pointer and option is checked once, here (DESIGN.md).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "dgps/detail/problem.hpp"
#include "dgps/error.hpp"
#include "dgps/recurrence.hpp"
#include "dgps/tensor.hpp"
#include "dgps/training_cache.hpp"
#include "dgps/types.hpp"

namespace dgps::detail {

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// Throws dgps::Error naming `name` unless a tensor of sizes `dims` has an element count and a byte count
/// (`elem` bytes each) that int64 can hold. A zero size counts as one, so that the other sizes' product, which the
/// kernels still form (state sizes, offsets), is bounded too.
inline void check_extent(const std::string& name, const std::vector<int64_t>& dims, int64_t elem) {
  int64_t n = elem;
  for (int64_t d : dims)
    if (d < 0 || __builtin_mul_overflow(n, d > 0 ? d : 1, &n))
      throw Error("tensor '" + name + "' of shape " + shape_str(dims) + " is too large: its size in bytes (" +
                  std::to_string(elem) + " per element) overflows int64");
}

/// Throws dgps::Error naming `name` unless the largest element offset of a strided view, in bytes, fits int64.
inline void check_offsets(const char* name, const int64_t* size, const int64_t* stride, int rank, int64_t elem) {
  int64_t end = 0;
  for (int d = 0; d < rank; ++d) {
    if (size[d] == 0) return;  // no element is addressed
    int64_t span = 0;
    if (__builtin_mul_overflow(stride[d], size[d] - 1, &span) || __builtin_add_overflow(end, span, &end))
      throw Error(std::string("tensor '") + name + "': its strides address elements beyond int64 offsets");
  }
  if (__builtin_mul_overflow(end, elem, &end))
    throw Error(std::string("tensor '") + name + "': its strides address bytes beyond int64 offsets");
}

/// Checks one tensor against its expected shape and returns it with the rank resolved.
/// `required`: absence is an error; `why` explains the requirement in the message.
template <class T>
TensorView<T> resolve(const char* name, TensorView<T> t, const std::vector<int64_t>& expect, bool required,
                      const std::string& why) {
  if (!t.data) {
    if (t.rank > 0) throw Error(std::string("tensor '") + name + "' has null data but shape " + t.shape_string());
    if (required) throw Error(std::string("tensor '") + name + "' is required " + why + " but was not given");
    return {};
  }
  const int r = static_cast<int>(expect.size());
  check_extent(name, expect, static_cast<int64_t>(sizeof(T)));
  if (t.rank == kImplicitRank) {  // a bare pointer: contiguous, in the SPEC shape
    t.set_contiguous(expect.data(), r);
    return t;
  }
  if (t.rank < 0) throw Error(std::string("tensor '") + name + "': sizes and strides have different lengths");
  bool ok = t.rank == r;
  for (int d = 0; ok && d < r; ++d) ok = t.size[d] == expect[d];
  if (!ok)
    throw Error(std::string("tensor '") + name + "' has shape " + t.shape_string() + ", expected " + shape_str(expect));
  if (r > 0 && t.size[r - 1] > 1 && t.stride[r - 1] != 1)
    throw Error(std::string("tensor '") + name + "' must be contiguous in its last dimension (stride " +
                std::to_string(t.stride[r - 1]) + ", expected 1)");
  for (int d = 0; d < r; ++d)
    if (t.stride[d] < 0) throw Error(std::string("tensor '") + name + "' has a negative stride");
  check_offsets(name, t.size.data(), t.stride.data(), r, static_cast<int64_t>(sizeof(T)));
  return t;
}

/// Rejects a tensor that the model does not use (a likely mistake in the call).
template <class T>
void reject_unused(const char* name, const TensorView<T>& t, const std::string& why) {
  if (t.data || t.rank > 0) throw Error(std::string("tensor '") + name + "' was given but " + why);
}

/// The states of N sequences (h [N, HV, K, V], the exact preconditioner's [N, H, K, K]) fit int64 in bytes.
inline void check_state_extents(int64_t N, int64_t H, int64_t HV, int64_t K, int64_t V) {
  check_extent("h0", {N, HV, K, V}, 8);
  check_extent("a0", {N, H, K, K}, 8);
}

/// The shape rules on sizes alone (SPEC §1): every size >= 1 but `T` >= 0, and `HV` a multiple of `H`. check_inputs
/// applies them to a Shape; callers holding sizes (the CUDA entry points' Params) call it directly.
inline void check_sizes(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V) {
  auto positive = [](const char* what, int64_t v) {
    if (v < 1) throw Error(std::string("shape: ") + what + " must be >= 1, got " + std::to_string(v));
  };
  positive("batch", B);
  positive("heads", H);
  positive("v_heads", HV);
  positive("key_dim", K);
  positive("value_dim", V);
  if (T < 0) throw Error("shape: time must be >= 0, got " + std::to_string(T));
  if (HV % H != 0)
    throw Error("shape: v_heads (" + std::to_string(HV) + ") must be a multiple of heads (" + std::to_string(H) + ")");
  check_state_extents(B, H, HV, K, V);
  check_extent("q", {B, T, H, K}, 8);
  check_extent("v", {B, T, HV, V}, 8);
  check_extent("g", {B, T, HV, K}, 8);
}

/// The rules of the options every backend reads (SPEC §1): `scale`, when given, finite; `x` finite and > 0; `eps`
/// finite and >= 0.
inline void check_squash_options(const std::optional<double>& scale, double x, double eps) {
  if (scale && !std::isfinite(*scale)) throw Error("option 'scale' must be finite, got " + std::to_string(*scale));
  if (!(x > 0) || !std::isfinite(x)) throw Error("option 'x' must be finite and > 0, got " + std::to_string(x));
  if (!(eps >= 0) || !std::isfinite(eps))
    throw Error("option 'eps' must be finite and >= 0, got " + std::to_string(eps));
}

inline void check_options(const Options& o, int64_t K, double& scale) {
  check_squash_options(o.scale, o.x, o.eps);
  if (!(o.lambda > 0) || !std::isfinite(o.lambda))
    throw Error("option 'lambda' must be finite and > 0, got " + std::to_string(o.lambda));
  if (o.chunk_size < 1) throw Error("option 'chunk_size' must be >= 1, got " + std::to_string(o.chunk_size));
  if (o.threads < 0) throw Error("option 'threads' must be >= 0, got " + std::to_string(o.threads));
  scale = o.scale ? *o.scale : 1.0 / std::sqrt(double(K));
}

/// Which of a call's optional inputs are given (a pointer or a shape), for check_model_inputs.
struct GivenInputs {
  bool g = false, beta = false, g_p = false, beta_p = false, center = false;
  bool a0 = false, aT = false;  ///< the preconditioner's initial and final states
};

/// The model's rules for its optional inputs (SPEC §1) on a run-time ModelSpec: the tensors its policies read are
/// required ("tensor 'g' is required by <model> but was not given"), the others refused ("tensor 'beta' was given
/// but gain=unit uses no beta"). check_inputs applies them; the CUDA entry points call it on their Params.
inline void check_model_inputs(const ModelSpec& spec, const GivenInputs& given) {
  const std::string model = "by " + to_string(spec);
  auto rule = [&](const char* name, bool is_given, bool used, const char* unused_why) {
    if (used && !is_given)
      throw Error(std::string("tensor '") + name + "' is required " + model + " but was not given");
    if (!used && is_given) throw Error(std::string("tensor '") + name + "' was given but " + unused_why);
  };
  const bool stats = spec.precond != precond::Kind::identity;
  const bool diagonal = spec.precond == precond::Kind::diagonal_atk || spec.precond == precond::Kind::diagonal_atq;
  rule("g", given.g, spec.decay != decay::Kind::none, "decay=none uses no g");
  rule("beta", given.beta, spec.gain != gain::Kind::unit, "gain=unit uses no beta");
  rule("g_p", given.g_p, stats, "precond=identity uses no g_p");
  rule("beta_p", given.beta_p, stats, "precond=identity uses no beta_p");
  rule("center", given.center, diagonal, "only the diagonal preconditioners use center");
  if (!stats) {  // the states are optional where they exist
    rule("a0", given.a0, false, "precond=identity has no preconditioner state");
    rule("aT", given.aT, false, "precond=identity has no preconditioner state");
  }
}

/// Validates the inputs (SPEC §1) of model R and fills the input half of a Problem.
template <class R, class T>
Problem<T> check_inputs(const Inputs<T>& in, const Options& opt) {
  using D = typename R::decay_type;
  using G = typename R::gain_type;
  using P = typename R::precond_type;
  Problem<T> p;
  p.spec = spec_of<R>();
  const Shape& s = in.shape;
  const int64_t HV = s.v_heads == 0 ? s.heads : s.v_heads;
  check_sizes(s.batch, s.time, s.heads, HV, s.key_dim, s.value_dim);
  p.B = s.batch;
  p.T_ = s.time;
  p.H = s.heads;
  p.HV = HV;
  p.K = s.key_dim;
  p.V = s.value_dim;
  check_options(opt, p.K, p.scale);
  p.x = opt.x;
  p.eps = opt.eps;
  p.lambda = opt.lambda;
  p.l2norm = opt.l2norm_qk;
  p.threads = opt.threads;
  p.chunk = opt.chunk_size;

  // Packed variable-length batches.
  p.N = p.B;
  if (in.cu_seqlens.data || in.cu_seqlens.rank > 0) {
    auto cu = in.cu_seqlens;
    if (!cu.data) throw Error("tensor 'cu_seqlens' has null data");
    if (cu.rank != 1 || cu.size[0] < 2)
      throw Error("tensor 'cu_seqlens' has shape " + cu.shape_string() + ", expected [N+1] with N >= 1");
    if (cu.stride[0] != 1) throw Error("tensor 'cu_seqlens' must be contiguous");
    if (p.B != 1) throw Error("cu_seqlens requires batch == 1, got batch = " + std::to_string(p.B));
    const int64_t n1 = cu.size[0];
    if (cu.data[0] != 0) throw Error("cu_seqlens must start at 0, got " + std::to_string(cu.data[0]));
    for (int64_t i = 1; i < n1; ++i)
      if (cu.data[i] < cu.data[i - 1])
        throw Error("cu_seqlens must not decrease: cu_seqlens[" + std::to_string(i) +
                    "] = " + std::to_string(cu.data[i]) + " < cu_seqlens[" + std::to_string(i - 1) +
                    "] = " + std::to_string(cu.data[i - 1]));
    if (cu.data[n1 - 1] != p.T_)
      throw Error("cu_seqlens must end at T = " + std::to_string(p.T_) + ", got " + std::to_string(cu.data[n1 - 1]));
    p.cu_seqlens = cu.data;
    p.N = n1 - 1;
    check_state_extents(p.N, p.H, p.HV, p.K, p.V);
  }

  const int64_t B = p.B, Tn = p.T_, H = p.H, K = p.K, V = p.V, N = p.N;
  const std::string model = "by " + to_string(p.spec);
  p.q = resolve("q", in.q, {B, Tn, H, K}, true, model);
  p.k = resolve("k", in.k, {B, Tn, H, K}, true, model);
  p.v = resolve("v", in.v, {B, Tn, HV, V}, true, model);
  auto given = [](const auto& t) { return t.data != nullptr || t.rank > 0; };
  check_model_inputs(p.spec,
                     {given(in.g), given(in.beta), given(in.g_p), given(in.beta_p), given(in.center), given(in.a0)});
  if constexpr (D::needs_g)
    p.g = resolve("g", in.g, D::per_channel ? std::vector<int64_t>{B, Tn, HV, K} : std::vector<int64_t>{B, Tn, HV},
                  true, model);
  if constexpr (G::needs_beta) p.beta = resolve("beta", in.beta, {B, Tn, HV}, true, model);
  if constexpr (precond::needs_gates<P>) {
    p.g_p = resolve("g_p", in.g_p, {B, Tn, H}, true, model);
    p.beta_p = resolve("beta_p", in.beta_p, {B, Tn, H}, true, model);
  }
  if constexpr (precond::needs_center<P>) p.center = resolve("center", in.center, {H}, true, model);
  p.h0 = resolve("h0", in.h0, {N, HV, K, V}, false, "");
  if constexpr (P::state == precond::State::diagonal)
    p.a0 = resolve("a0", in.a0, {N, H, K}, false, "");
  else if constexpr (P::state == precond::State::exact)
    p.a0 = resolve("a0", in.a0, {N, H, K, K}, false, "");
  return p;
}

/// Expected shape of the preconditioner state of model R ([N,H,K], [N,H,K,K] or none).
template <class R>
std::vector<int64_t> precond_state_shape(int64_t N, int64_t H, int64_t K) {
  using P = typename R::precond_type;
  if constexpr (P::state == precond::State::diagonal) return {N, H, K};
  if constexpr (P::state == precond::State::exact) return {N, H, K, K};
  return {};
}

template <class R, class T, class V>
TensorView<V> resolve_precond_state(const char* name, TensorView<V> t, int64_t N, int64_t H, int64_t K, bool required) {
  if constexpr (R::precond_type::state == precond::State::none) {
    reject_unused(name, t, "precond=identity has no preconditioner state");
    return {};
  } else {
    return resolve(name, t, precond_state_shape<R>(N, H, K), required, "by the preconditioner");
  }
}

/// The training-cache key of a validated problem (dgps/training_cache.hpp): what the saved activations
/// depend on.
template <class T>
TrainingKey training_key(const Problem<T>& p) {
  TrainingKey k;
  k.spec = p.spec;
  k.dtype = std::is_same_v<T, double> ? "float64"
            : std::is_same_v<T, bf16> ? "bfloat16"
            : std::is_same_v<T, f16>  ? "float16"
                                      : "float32";
  k.B = p.B, k.T = p.T_, k.H = p.H, k.HV = p.HV, k.K = p.K, k.V = p.V, k.N = p.N, k.chunk = p.chunk;
  k.scale = p.scale, k.x = p.x, k.eps = p.eps, k.lambda = p.lambda, k.l2norm = p.l2norm;
  if (p.cu_seqlens) k.cu_seqlens.assign(p.cu_seqlens, p.cu_seqlens + p.N + 1);
  auto put = [&](int i, const auto& v) {
    k.t[i].data = v.data;
    for (int d = 0; d < 4 && d < v.rank; ++d) k.t[i].stride[d] = v.stride[d];
  };
  put(0, p.q), put(1, p.k), put(2, p.v), put(3, p.g), put(4, p.beta), put(5, p.g_p), put(6, p.beta_p);
  put(7, p.center), put(8, p.h0), put(9, p.a0);
  return k;
}

/// Bytes of the training cache of a validated problem whose layout is `l`.
template <class T>
size_t training_bytes(const Problem<T>& p, const TrainingLayout& l) {
  return size_t(l.elements(p.HV)) * sizeof(state_t<T>);
}

/// Where the CPU chunkwise kernels put the saved activations of a validated problem: the full cache when
/// it takes at most `max_full_bytes`, else the checkpoints.
template <class T>
TrainingLayout training_layout(const Problem<T>& p, size_t max_full_bytes) {
  const bool diag_pre = p.spec.precond == precond::Kind::diagonal_atk || p.spec.precond == precond::Kind::diagonal_atq;
  auto layout = [&](bool checkpoints) {
    return TrainingLayout::of(p.K, p.V, p.chunk, p.spec.solve == solve::Kind::online, diag_pre, sizeof(state_t<T>),
                              p.N, p.T_, p.cu_seqlens, checkpoints);
  };
  TrainingLayout full = layout(false);
  return training_bytes(p, full) <= max_full_bytes ? full : layout(true);
}

/// Validates a forward call.
template <class R, class T>
Problem<T> check_forward(const Inputs<T>& in, const Outputs<T>& out, const Options& opt) {
  Problem<T> p = check_inputs<R>(in, opt);
  p.o = resolve("o", out.o, {p.B, p.T_, p.HV, p.V}, true, "as the output");
  p.hT = resolve("hT", out.hT, {p.N, p.HV, p.K, p.V}, false, "");
  p.aT = resolve_precond_state<R, T>("aT", out.aT, p.N, p.H, p.K, false);
  p.save_to = out.cache;
  return p;
}

/// Checks a backward's training cache against the call (an empty cache is ignored): sets p.saved, or
/// throws dgps::Error naming the first difference from the forward that filled it.
template <class T>
void check_training_cache(Problem<T>& p, const TrainingCache* cache) {
  p.saved = nullptr;
  if (!cache || !cache->filled()) return;
  const std::string diff = TrainingKey::difference(TrainingCacheAccess::key(*cache), training_key(p));
  if (!diff.empty()) throw Error("training cache: " + diff);
  p.saved = cache;
}

/// Validates a backward call (the gradients requested must belong to inputs that are present).
template <class R, class T>
Problem<T> check_backward(const Inputs<T>& in, const GradsIn<T>& gi, const Grads<T>& go, const Options& opt) {
  Problem<T> p = check_inputs<R>(in, opt);
  const int64_t B = p.B, Tn = p.T_, H = p.H, HV = p.HV, K = p.K, V = p.V, N = p.N;
  p.d_o = resolve("do", gi.d_o, {B, Tn, HV, V}, true, "for the backward pass");
  p.dhT = resolve("dhT", gi.dhT, {N, HV, K, V}, false, "");
  p.daT = resolve_precond_state<R, T>("daT", gi.daT, N, H, K, false);
  auto grad = [](const char* name, const auto& g, const auto& input, const char* input_name) {
    if (!input.data) reject_unused(name, g, std::string("input '") + input_name + "' is absent");
    return resolve(name, g, std::vector<int64_t>(input.size.begin(), input.size.begin() + input.rank), false, "");
  };
  p.dq = grad("dq", go.dq, p.q, "q");
  p.dk = grad("dk", go.dk, p.k, "k");
  p.dv = grad("dv", go.dv, p.v, "v");
  p.dg = grad("dg", go.dg, p.g, "g");
  p.dbeta = grad("dbeta", go.dbeta, p.beta, "beta");
  p.dg_p = grad("dg_p", go.dg_p, p.g_p, "g_p");
  p.dbeta_p = grad("dbeta_p", go.dbeta_p, p.beta_p, "beta_p");
  p.dcenter = grad("dcenter", go.dcenter, p.center, "center");
  // dh0/da0 are the gradients of the initial states, also when h0/a0 were not given (zeros / defaults).
  p.dh0 = resolve("dh0", go.dh0, {N, HV, K, V}, false, "");
  p.da0 = resolve_precond_state<R, T>("da0", go.da0, N, H, K, false);
  check_training_cache(p, gi.cache);
  return p;
}

/// An optional int64 / uint8 index tensor of a decode state: null, or exactly `expect`, contiguous.
template <class I>
const I* resolve_index(const char* name, const TensorView<const I>& t, const std::vector<int64_t>& expect) {
  if (!t.data && t.rank <= 0) return nullptr;
  if (!t.data) throw Error(std::string("tensor '") + name + "' has null data");
  bool ok = t.rank == static_cast<int>(expect.size());
  for (int d = 0; ok && d < t.rank; ++d) ok = t.size[d] == expect[d];
  if (!ok)
    throw Error(std::string("tensor '") + name + "' has shape " + t.shape_string() + ", expected " + shape_str(expect));
  int64_t want = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    if (t.size[d] > 1 && t.stride[d] != want) throw Error(std::string("tensor '") + name + "' must be contiguous");
    want *= t.size[d];
  }
  return t.data;
}

/// Resolves the state-pool indices of a decode call (DecodeState) into p.in_slots, p.out_slots,
/// p.padded and p.token_slots, checking every index against the pool of P states and that no state
/// written by one sequence is read or written by another. Reads nothing but the index tensors.
template <class T>
void check_pool_indices(Problem<T>& p, const DecodeState<T>& st, int64_t P) {
  const int64_t N = p.N;
  const int64_t* slots = resolve_index("slots", st.slots, {N});
  const int64_t* outs = resolve_index("out_slots", st.out_slots, {N});
  const uint8_t* init = resolve_index("has_initial", st.has_initial, {N});
  const bool verify = st.token_slots.data || st.token_slots.rank > 0;
  const bool accepted = st.num_accepted.data || st.num_accepted.rank > 0;
  if (verify != accepted)
    throw Error(verify ? "tensor 'num_accepted' is required with token_slots but was not given"
                       : "tensor 'num_accepted' was given but token_slots (speculative verification) was not");
  auto seq_len = [&](int64_t n) { return p.seq_len(n); };
  auto in_pool = [&](const char* name, int64_t i, int64_t v) {
    if (v >= P)
      throw Error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v) +
                  " is outside the state pool [0, " + std::to_string(P) + ")");
  };
  if (verify) {
    if (slots || outs || init)
      throw Error("token_slots (speculative verification) takes the start state from num_accepted; slots, out_slots "
                  "and has_initial must not be given with it");
    if (st.token_slots.rank != 2 || !st.token_slots.data)
      throw Error("tensor 'token_slots' has shape " + st.token_slots.shape_string() + ", expected [" +
                  std::to_string(N) + ", D]");
    const int64_t D = st.token_slots.size[1];
    const int64_t* ts = resolve_index("token_slots", st.token_slots, {N, D});
    const int64_t* acc = resolve_index("num_accepted", st.num_accepted, {N});
    p.in_slots.assign(size_t(N), -1);
    p.out_slots.assign(size_t(N), -1);
    p.padded.assign(size_t(N), 0);
    for (int64_t n = 0; n < N; ++n) {
      if (acc[n] < 1 || acc[n] > D)
        throw Error("num_accepted[" + std::to_string(n) + "] = " + std::to_string(acc[n]) + " is outside [1, " +
                    std::to_string(D) + "] (token_slots has D = " + std::to_string(D) + " columns)");
      if (seq_len(n) > D)
        throw Error("sequence " + std::to_string(n) + " has " + std::to_string(seq_len(n)) +
                    " tokens but token_slots has D = " + std::to_string(D) + " columns");
      for (int64_t t = 0; t < D; ++t) in_pool("token_slots", n * D + t, ts[n * D + t]);
      const int64_t start = ts[n * D + acc[n] - 1];
      if (start < 0)
        p.padded[n] = 1;
      else
        p.in_slots[n] = start;
    }
    p.token_slots = ts;
    p.token_ld = D;
  } else if (slots || outs || init) {
    if (!slots && N > P)
      throw Error("tensor 'h' holds " + std::to_string(P) + " states; without slots sequence n reads state n, so N = " +
                  std::to_string(N) + " needs at least N");
    p.in_slots.assign(size_t(N), -1);
    p.out_slots.assign(size_t(N), -1);
    p.padded.assign(size_t(N), 0);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t si = slots ? slots[n] : n, so = outs ? outs[n] : si;
      if (slots) in_pool("slots", n, si);
      if (outs) in_pool("out_slots", n, so);
      if (init && init[n] > 1)
        throw Error("has_initial[" + std::to_string(n) + "] = " + std::to_string(init[n]) + ", expected 0 or 1");
      if (si < 0 || so < 0) {
        p.padded[n] = 1;
        continue;
      }
      p.in_slots[n] = init && !init[n] ? -1 : si;
      p.out_slots[n] = so;
    }
  } else {
    return;  // the identity: sequence n reads and writes state n
  }
  // A state written by one sequence is read or written by no other (tasks run in parallel).
  std::vector<int64_t> writer(static_cast<size_t>(P), -1);
  auto write = [&](int64_t n, int64_t slot) {
    if (slot < 0) return;
    if (writer[slot] >= 0 && writer[slot] != n)
      throw Error("slots: state " + std::to_string(slot) + " is written by two sequences (" +
                  std::to_string(writer[slot]) + " and " + std::to_string(n) + ")");
    if (writer[slot] == n && p.token_slots)
      throw Error("token_slots: state " + std::to_string(slot) + " is written twice by sequence " + std::to_string(n));
    writer[slot] = n;
  };
  for (int64_t n = 0; n < N; ++n) {
    if (p.padded[n]) continue;
    if (p.token_slots)
      for (int64_t t = 0; t < seq_len(n); ++t) write(n, p.token_slots[n * p.token_ld + t]);
    else
      write(n, p.out_slots[n]);
  }
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = p.padded[n] ? -1 : p.in_slots[n];
    if (r >= 0 && writer[r] >= 0 && writer[r] != n)
      throw Error("slots: state " + std::to_string(r) + " is read by sequence " + std::to_string(n) +
                  " and written by sequence " + std::to_string(writer[r]));
  }
}

/// Validates a decode call: `tokens.shape` is [N sequences, T new tokens], or with `cu_seqlens` a
/// packed batch of N sequences (B = 1); states and their pool indices in `st` (DecodeState).
template <class R, class T>
Problem<T> check_decode(const DecodeState<T>& st, const Inputs<T>& tokens, Out<T> o, const Options& opt) {
  if (tokens.h0.data || tokens.a0.data)
    throw Error("decode takes its states from DecodeState; the token inputs must not carry h0/a0");
  Problem<T> p = check_inputs<R>(tokens, opt);
  p.o = resolve("o", o.view, {p.B, p.T_, p.HV, p.V}, true, "as the output");
  auto given = [](const auto& t) { return t.data != nullptr || t.rank > 0; };
  const bool pooled = given(st.slots) || given(st.out_slots) || given(st.has_initial) || given(st.token_slots) ||
                      given(st.num_accepted);
  int64_t pool = p.N;
  if (pooled) {
    if (!st.h.data || st.h.rank < 1) throw Error("tensor 'h' (decode state) is required but was not given");
    pool = st.h.size[0];
  }
  // The pool is bounded by the state's validation before the index tables are sized from it. A K-last
  // pool becomes the strided view [P, HV, K, V] of its transpose (element (c, e) at stride 1 in c).
  const bool k_last = st.layout == StateLayout::k_last;
  if (!k_last && st.layout != StateLayout::k_major) throw Error("DecodeState: layout is neither k_major nor k_last");
  auto resolve_h = [&] {
    if (!k_last) return resolve("h", st.h, {pool, p.HV, p.K, p.V}, true, "as the decode state");
    try {
      return resolve("h", st.h, {pool, p.HV, p.V, p.K}, true, "as the decode state");
    } catch (const Error& e) {
      throw Error(Error::message_of(e) + " (DecodeState::layout is K-last: [P, HV, V, K])");
    }
  };
  auto h = resolve_h();
  if (k_last && h.data) {
    std::swap(h.size[2], h.size[3]);
    std::swap(h.stride[2], h.stride[3]);
  }
  auto a = resolve_precond_state<R, T>("a", st.a, pool, p.H, p.K, true);
  check_pool_indices(p, st, pool);
  p.h0 = h;
  p.hT = h;
  p.a0 = a;
  p.aT = a;
  return p;
}

}  // namespace dgps::detail
