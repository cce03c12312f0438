/// @brief dgps::TrainingCache: what a training forward saves so that its backward does not recompute it.
///
/// The chunkwise backward (SPEC §4, paper App. D) needs, for every chunk and value head, the state
/// entering the chunk S_in, the pseudo-values R and the intra-chunk matrices. Without a cache it
/// recomputes them with a forward sweep over the chunks before its reverse sweep (about 0.7 of a
/// forward). A forward given a cache (`dgps::outputs(o).save_for_backward(cache)`) stores them as it
/// goes; a backward given the filled cache (`dgps::grads_in(do).use_saved(cache)`) reads them instead.
///
/// Memory, per token and value head, with C = `Options::chunk_size` and S = the state type (4 bytes
/// for float, bf16 and f16 inputs, 8 for double), rows padded to 64 bytes (`pad(n)` = n rounded up to
/// 64 / S elements): S * (K * pad(V) / C + pad(V) + pad(C)) for the Online solve (S_in, R, and one
/// C x C block holding Aqk and Akk / beta), S * (K * pad(V) / C + pad(C)) for the Offline solve
/// (R = Diag(beta) V is cheap to rebuild), plus S * pad(K) / C with a diagonal preconditioner (the
/// statistics entering each chunk: 8 bytes per token for K = 128, C = 64). K = V = 128, C = 64, float: 1792 bytes
/// (Online), 1280 bytes (Offline) per token and value head, e.g. 117 MB for B = 1, T = 4096, HV = 16 (a chunk shorter
/// than C, at the end of a sequence, takes a whole chunk's block). `dgps::training_cache_bytes`
/// answers for a given call.
///
/// A forward whose full cache would exceed the cache's `max_full_bytes()` (1 GiB unless set) saves
/// checkpoints instead: per sequence and value head, the state entering every segment of
/// `kCheckpointTokens` tokens (4096; the first holds h0) and, with a diagonal preconditioner, the
/// statistics entering it: S * (K * pad(V) + pad(K)) bytes per segment, 18 bytes per token and value head
/// at K = V = 128 (float). The backward then recomputes each segment from its checkpoint, as it does
/// without a cache, but skips the sweep over the whole sequence that would find those states (about 0.6
/// of a forward on long sequences).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "dgps/recurrence.hpp"
#include "dgps/types.hpp"

namespace dgps {

namespace detail {

/// Tokens per segment of the CPU chunkwise backward (without a full training cache): it holds one
/// segment's per-token rows and per-chunk stores at once, from the state entering the segment.
constexpr int64_t kCheckpointTokens = 4096;

/// Chunks of C tokens per segment.
constexpr int64_t segment_chunks(int64_t C) { return C >= kCheckpointTokens ? 1 : kCheckpointTokens / C; }

/// What a forward was called with, as far as its saved activations depend on it: the model, the
/// element type, the sizes, the options of the math, the sequence boundaries, and the address and
/// strides of every input tensor. A backward may use a cache only when its own key is equal.
struct TrainingKey {
  /// One input tensor: address and element strides (sizes follow from the shape).
  struct Tensor {
    const void* data = nullptr;
    int64_t stride[4] = {0, 0, 0, 0};
    bool operator==(const Tensor& o) const {
      return data == o.data && stride[0] == o.stride[0] && stride[1] == o.stride[1] && stride[2] == o.stride[2] &&
             stride[3] == o.stride[3];
    }
  };
  static constexpr int kTensors = 10;
  static constexpr const char* kNames[kTensors] = {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0"};

  ModelSpec spec{};
  const char* dtype = "";  ///< "float32", "float64", "bfloat16", "float16"
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0, chunk = 0;
  double scale = 0, x = 0, eps = 0, lambda = 0;
  bool l2norm = false;
  std::vector<int64_t> cu_seqlens;  ///< empty for fixed-length batches
  Tensor t[kTensors];

  /// The first difference between the key `saved` of a forward and the key `now` of a backward, as a
  /// sentence; empty when they are equal.
  static std::string difference(const TrainingKey& saved, const TrainingKey& now) {
    auto num = [](double v) {
      std::string s = std::to_string(v);
      return s;
    };
    if (!(saved.spec == now.spec))
      return "it was saved for model '" + to_string(saved.spec) + "', the backward is for '" + to_string(now.spec) +
             "'";
    if (std::string(saved.dtype) != now.dtype)
      return std::string("it was saved for ") + saved.dtype + " inputs, the backward has " + now.dtype + " inputs";
    const int64_t a[] = {saved.B, saved.T, saved.H, saved.HV, saved.K, saved.V};
    const int64_t b[] = {now.B, now.T, now.H, now.HV, now.K, now.V};
    const char* dims[] = {"batch", "time", "heads", "v_heads", "key_dim", "value_dim"};
    for (int i = 0; i < 6; ++i)
      if (a[i] != b[i])
        return std::string("shape ") + dims[i] + " differs: saved " + std::to_string(a[i]) + ", backward " +
               std::to_string(b[i]);
    if (saved.cu_seqlens != now.cu_seqlens) return "the sequences (cu_seqlens) differ from the forward's";
    if (saved.chunk != now.chunk)
      return "option 'chunk_size' differs: saved " + std::to_string(saved.chunk) + ", backward " +
             std::to_string(now.chunk);
    if (saved.scale != now.scale)
      return "option 'scale' differs: saved " + num(saved.scale) + ", backward " + num(now.scale);
    if (saved.l2norm != now.l2norm) return "option 'l2norm_qk' differs from the forward's";
    if (saved.x != now.x) return "option 'x' differs: saved " + num(saved.x) + ", backward " + num(now.x);
    if (saved.eps != now.eps) return "option 'eps' differs: saved " + num(saved.eps) + ", backward " + num(now.eps);
    if (saved.lambda != now.lambda)
      return "option 'lambda' differs: saved " + num(saved.lambda) + ", backward " + num(now.lambda);
    for (int i = 0; i < kTensors; ++i)
      if (!(saved.t[i] == now.t[i]))
        return std::string("tensor '") + kNames[i] +
               "' is not the one the forward saw (a different address or strides, or given to one call only)";
    return {};
  }
};

/// Where a chunk's saved activations live (elements of the state type S): per (sequence n, value head
/// hv, chunk ci) one block of `block` elements at
/// `(chunk0[n] * HV + hv * chunks(n) + ci) * block`: S_in (K rows of `ld`), then for the Online solve R
/// (C rows of `ld`), then P (C rows of `pld`: P[i][j] = Aqk[i][j] for j <= i and Akk[j][i] / beta_j =
/// the unscaled key product for j > i), then with a diagonal preconditioner the statistics A entering
/// the chunk (K values at `aoff`). chunks(n) = ceil(len_n / C); `chunk0` is their prefix sum.
/// Checkpoints (`seg` > 0): one block per segment of `seg` chunks instead of per chunk (chunks(n) =
/// ceil(ceil(len_n / C) / seg)), holding the state entering the segment, then the statistics at `aoff`.
struct TrainingLayout {
  int64_t ld = 0, pld = 0, aoff = 0, block = 0, chunks = 0;
  int64_t seg = 0;              ///< chunks per block: 0 for the full cache (one block per chunk)
  std::vector<int64_t> chunk0;  ///< [N + 1]

  /// The layout of a problem: K, V, chunk C, Online or not, diagonal preconditioner or not, the state
  /// type's size, the sequence lengths (cu_seqlens, or N sequences of T tokens when empty).
  /// With `checkpoints`, the checkpoint layout (segments of segment_chunks(C) chunks).
  static TrainingLayout of(int64_t K, int64_t V, int64_t C, bool online, bool diag_pre, size_t state_bytes,
                           int64_t N, int64_t T, const int64_t* cu, bool checkpoints = false) {
    TrainingLayout l;
    const int64_t per_line = int64_t(64 / state_bytes);
    auto pad = [&](int64_t n) { return (n + per_line - 1) / per_line * per_line; };
    l.ld = pad(V);
    l.pld = checkpoints ? 0 : pad(C);
    l.aoff = K * l.ld + (checkpoints ? 0 : (online ? C * l.ld : 0) + C * l.pld);
    l.block = l.aoff + (diag_pre ? pad(K) : 0);
    l.seg = checkpoints ? segment_chunks(C) : 0;
    l.chunk0.assign(size_t(N + 1), 0);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t len = cu ? cu[n + 1] - cu[n] : T;
      const int64_t chunks = len > 0 ? (len + C - 1) / C : 0;
      l.chunk0[size_t(n + 1)] = l.chunk0[size_t(n)] + (checkpoints ? (chunks + l.seg - 1) / l.seg : chunks);
    }
    l.chunks = l.chunk0[size_t(N)];
    return l;
  }
  /// Elements of the whole cache.
  int64_t elements(int64_t HV) const { return chunks * HV * block; }
};

struct TrainingCacheAccess;

}  // namespace detail

/// Activations saved by a training forward for its backward (see the file comment for what and how
/// much). User-owned and reusable: each forward that saves into it replaces the previous contents (and
/// keeps the memory when it is large enough). Movable, not copyable. Not thread-safe: one call at a
/// time may use a given cache.
///
/// Which calls use it: the CPU chunkwise forward (`Backend::cpu` or `automatic` on host data, every
/// model with an Identity or diagonal preconditioner) fills it; every other forward (reference,
/// recurrent, CUDA) saves nothing and leaves it empty. The CPU chunkwise backward reads a filled cache;
/// the other backward paths ignore it. A backward given an empty cache recomputes, as without one. A
/// backward given a filled cache first checks that it was saved by a forward of the same model, input
/// type, shape, sequences, options (`chunk_size`, `scale`, `l2norm_qk`, `x`, `eps`, `lambda`) and input
/// tensors (same addresses and strides) and throws dgps::Error naming the first difference otherwise.
/// The values of the inputs are not checked: a backward must see the same input values as the forward
/// that filled the cache (as autograd frameworks guarantee for saved tensors).
class TrainingCache {
 public:
  TrainingCache() = default;
  TrainingCache(const TrainingCache&) = delete;
  TrainingCache& operator=(const TrainingCache&) = delete;
  /// Takes over `o`'s memory and contents; `o` is left empty.
  TrainingCache(TrainingCache&& o) noexcept { swap(o); }
  /// Frees this cache's memory and takes over `o`'s; `o` is left empty.
  TrainingCache& operator=(TrainingCache&& o) noexcept {
    if (this != &o) {
      clear();
      swap(o);
    }
    return *this;
  }
  ~TrainingCache() { std::free(data_); }

  /// The default of max_full_bytes(): 1 GiB.
  static constexpr size_t kDefaultMaxFullBytes = size_t(1) << 30;

  /// True when a forward saved into it (and nothing cleared it since).
  bool filled() const noexcept { return filled_; }
  /// True when the forward that filled it saved checkpoints only (its full cache was larger than
  /// max_full_bytes(); see the file comment).
  bool checkpoints_only() const noexcept { return filled_ && layout_.seg > 0; }
  /// The largest full cache a forward saves; above it the forward saves checkpoints. Set it to 0 for
  /// checkpoints always, to SIZE_MAX for the full cache always.
  size_t max_full_bytes() const noexcept { return max_full_; }
  void set_max_full_bytes(size_t bytes) noexcept { max_full_ = bytes; }
  /// Bytes of saved activations (0 when empty).
  size_t bytes() const noexcept { return filled_ ? used_ : 0; }
  /// Bytes allocated (kept for the next forward; at least bytes()).
  size_t capacity() const noexcept { return capacity_; }
  /// Empties the cache and frees its memory.
  void clear() noexcept {
    std::free(data_);
    data_ = nullptr;
    capacity_ = used_ = 0;
    filled_ = false;
    key_ = {};
    layout_ = {};
  }

 private:
  friend struct detail::TrainingCacheAccess;
  void swap(TrainingCache& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    std::swap(used_, o.used_);
    std::swap(filled_, o.filled_);
    std::swap(key_, o.key_);
    std::swap(layout_, o.layout_);
    std::swap(max_full_, o.max_full_);
  }
  void* data_ = nullptr;
  size_t capacity_ = 0, used_ = 0, max_full_ = kDefaultMaxFullBytes;
  bool filled_ = false;
  detail::TrainingKey key_;
  detail::TrainingLayout layout_;
};

namespace detail {

/// The library's access to a TrainingCache's internals.
struct TrainingCacheAccess {
  /// Empties `c` for a new forward (keeping its memory), sets its key and layout, and returns a 64-byte
  /// aligned buffer of `bytes` bytes (not zeroed).
  static void* prepare(TrainingCache& c, TrainingKey key, TrainingLayout layout, size_t bytes) {
    c.filled_ = false;
    if (bytes > c.capacity_) {
      std::free(c.data_);
      c.data_ = nullptr;
      c.capacity_ = 0;
      const size_t rounded = (bytes + 63) / 64 * 64;
      c.data_ = std::aligned_alloc(64, rounded ? rounded : 64);
      if (!c.data_) throw std::bad_alloc();
      c.capacity_ = rounded;
    }
    c.used_ = bytes;
    c.key_ = std::move(key);
    c.layout_ = std::move(layout);
    return c.data_;
  }
  /// Marks `c` filled (after the forward wrote everything) or empty (a forward that saved nothing).
  static void set_filled(TrainingCache& c, bool filled) noexcept { c.filled_ = filled; }
  static const TrainingKey& key(const TrainingCache& c) { return c.key_; }
  static const TrainingLayout& layout(const TrainingCache& c) { return c.layout_; }
  static void* data(const TrainingCache& c) { return c.data_; }
};

}  // namespace detail

}  // namespace dgps
