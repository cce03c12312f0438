/// @brief dgps::distributed: one sequence split over several ranks (context parallelism), exact, for every
/// chunkwise model, forward and backward, on host tensors; ranks are the members of a Communicator (threads
/// of one process with dgps::distributed::ThreadGroup, or the caller's own transport).
///
/// The decomposition (docs/distributed.md). Rank r holds tokens [t_r, t_{r+1}) of every sequence. Given the
/// preconditioner statistics entering its segment, the segment acts on the recurrent state as an affine map
/// `S_out = M_r S_in + B_r` (M_r: K x K per value head, B_r: K x V), and the diagonal statistics as
/// `A_out = exp(G_r) A_in + b_r` (G_r the segment's summed g_p). One forward of the segment with the values
/// widened to `[v | 0]` (V + K columns) from the state `[0 | I]` gives `[B_r | M_r]` as its final state and,
/// in its last K output columns, `p_t = M_{<=t}^T qr_t`, so that the outputs from the true incoming state are
/// `o_t = o_t(0) + S_in^T p_t`. The ranks exchange their maps (O(N * HV * K * (K + V)) values each, whatever
/// the length) and fold them in rank order, so every rank computes the same incoming states: the result is
/// deterministic and equals the single call within float rounding.
///
/// The backward runs the same in reverse: the state cotangent entering rank r from the right is
/// `dS_out^(r) = dS_in^(r+1)`, with `dS_in^(j) = M_j^T dS_out^(j) + c_j` and `c_j = sum_t p_t do_t^T`;
/// each rank then runs one ordinary backward of its segment from its true incoming state with that cotangent,
/// and adds the statistics' share `dA_out^(r)` (from the reverse fold of the ranks' `da0`) to dk, dg_p and
/// dbeta_p in closed form.
#pragma once

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dgps/detail/squash.hpp"
#include "dgps/dgps.hpp"

namespace dgps::distributed {

/// The one collective a context-parallel call needs. Every rank of the group calls it with the same byte
/// count, in the same order; it returns when `recv` holds every rank's contribution (rank j's `bytes`
/// bytes at offset `j * bytes`). Implement it over MPI, NCCL, sockets, ...; ThreadGroup is the in-process one.
class Communicator {
 public:
  virtual ~Communicator() = default;
  /// This member's index, 0 .. size() - 1: its segment's place in the sequence.
  virtual int rank() const = 0;
  /// The number of members.
  virtual int size() const = 0;
  /// Gathers `bytes` bytes from every member into `recv` (size() * bytes), in rank order. Blocking.
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
};

/// `size` ranks in one process, one thread each: `group.member(r)` is rank r's Communicator. Every member
/// must be used by its own thread (a collective waits for all of them). Thread-safe; reusable for any
/// number of calls.
class ThreadGroup {
 public:
  /// A group of `size` >= 1 members.
  explicit ThreadGroup(int size) : posted_(static_cast<size_t>(size > 0 ? size : 0)) {
    if (size < 1) throw Error("distributed::ThreadGroup: size must be >= 1, got " + std::to_string(size));
    for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<Member>(*this, r));
  }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;
  /// Rank r's communicator (0 <= r < size()).
  Communicator& member(int r) {
    if (r < 0 || r >= size())
      throw Error("distributed::ThreadGroup: member " + std::to_string(r) + " of a group of " + std::to_string(size()));
    return *members_[static_cast<size_t>(r)];
  }
  /// The number of members.
  int size() const { return static_cast<int>(members_.size()); }

 private:
  struct Member final : Communicator {
    ThreadGroup& g;
    int r;
    Member(ThreadGroup& group, int rank) : g(group), r(rank) {}
    int rank() const override { return r; }
    int size() const override { return g.size(); }
    void all_gather(const void* send, size_t bytes, void* recv) override {
      g.posted_[static_cast<size_t>(r)] = send;
      g.arrive();  // every send buffer is posted
      for (int j = 0; j < g.size(); ++j)
        if (bytes)
          std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(j) * bytes, g.posted_[static_cast<size_t>(j)],
                      bytes);
      g.arrive();  // every member has copied: the send buffers may change
    }
  };
  void arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == size()) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }
  std::vector<std::unique_ptr<Member>> members_;
  std::vector<const void*> posted_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

namespace detail {

using dgps::detail::Problem;

/// What every rank tells the others before any work: its sizes and whether its own validation passed
/// (with the message), so that a bad call throws the same error on every rank instead of deadlocking.
struct Status {
  int64_t B, H, HV, K, V, T, spec;
  int32_t ok, elem;
  char what[472];
};

template <class R, class T>
int64_t spec_code() {
  const ModelSpec s = spec_of<R>();
  return int64_t(s.decay) | int64_t(s.gain) << 4 | int64_t(s.precond) << 8 | int64_t(s.solve) << 12;
}

/// Validates locally (`check` returns the Problem or throws), exchanges Status, and throws on every rank
/// when any rank failed or the ranks disagree on the model, type or sizes (the time T may differ).
template <class R, class T, class Check>
Problem<T> agree(Communicator& comm, const char* call, Check&& check) {
  Status st{};
  st.spec = spec_code<R, T>();
  st.elem = int32_t(sizeof(T));
  Problem<T> p;
  try {
    p = check();
    st.ok = 1;
    st.B = p.B, st.H = p.H, st.HV = p.HV, st.K = p.K, st.V = p.V, st.T = p.T_;
  } catch (const std::exception& e) {
    st.ok = 0;
    const std::string w = Error::message_of(e);
    std::strncpy(st.what, w.c_str(), sizeof(st.what) - 1);
  }
  const int R_ = comm.size();
  std::vector<Status> all(static_cast<size_t>(R_));
  comm.all_gather(&st, sizeof(Status), all.data());
  const std::string who = std::string("distributed::") + call + ": ";
  for (int j = 0; j < R_; ++j)
    if (!all[static_cast<size_t>(j)].ok)
      throw Error(who + "rank " + std::to_string(j) + ": " + all[static_cast<size_t>(j)].what);
  for (int j = 0; j < R_; ++j) {
    const Status& a = all[static_cast<size_t>(j)];
    if (a.spec != all[0].spec || a.elem != all[0].elem)
      throw Error(who + "rank " + std::to_string(j) + " runs another model or input type than rank 0");
    if (a.B != all[0].B || a.H != all[0].H || a.HV != all[0].HV || a.K != all[0].K || a.V != all[0].V)
      throw Error(who + "rank " + std::to_string(j) + "'s sizes [B, H, HV, K, V] = [" + std::to_string(a.B) + ", " +
                  std::to_string(a.H) + ", " + std::to_string(a.HV) + ", " + std::to_string(a.K) + ", " +
                  std::to_string(a.V) + "] differ from rank 0's [" + std::to_string(all[0].B) + ", " +
                  std::to_string(all[0].H) + ", " + std::to_string(all[0].HV) + ", " + std::to_string(all[0].K) + ", " +
                  std::to_string(all[0].V) + "]");
  }
  return p;
}

/// Rows of the corrections, taken kBlockRows at a time so each row of the K x V matrix is read once per block.
inline constexpr int64_t kBlockRows = 8;

/// y_t = x_t[0, V) + x_t[V, V + K) M for the rows t of `x` (the widened outputs [o | p]): M [K, V] contiguous,
/// `row(t)` gives row t of x and `out(t)` row t of y (type T); accumulated in S (float for 16-bit and float inputs).
template <class S, class T, class Row, class Out>
void widened_readout(int64_t rows, int64_t K, int64_t V, const S* M, Row row, Out out) {
  std::vector<S> acc(static_cast<size_t>(kBlockRows * V));
  const T* x[kBlockRows];
  for (int64_t t0 = 0; t0 < rows; t0 += kBlockRows) {
    const int64_t nb = std::min(kBlockRows, rows - t0);
    for (int64_t i = 0; i < nb; ++i) {
      x[i] = row(t0 + i);
      for (int64_t v = 0; v < V; ++v) acc[static_cast<size_t>(i * V + v)] = S(x[i][v]);
    }
    for (int64_t c = 0; c < K; ++c) {
      const S* m = M + c * V;
      for (int64_t i = 0; i < nb; ++i) {
        const S pc = S(x[i][V + c]);
        if (pc == S(0)) continue;
        S* a = acc.data() + i * V;
        for (int64_t v = 0; v < V; ++v) a[v] += pc * m[v];
      }
    }
    for (int64_t i = 0; i < nb; ++i) {
      T* y = out(t0 + i);
      for (int64_t v = 0; v < V; ++v) y[v] = T(acc[static_cast<size_t>(i * V + v)]);
    }
  }
}

/// C [K, V] = sum_t p_t d_t^T over the rows t: p_t = x_t[V, V + K) of the widened outputs (`row(t)`), d_t the
/// output cotangent's row (`drow(t)`, V entries); accumulated in S.
template <class S, class T, class Row, class DRow>
void widened_cotangent(int64_t rows, int64_t K, int64_t V, Row row, DRow drow, S* C) {
  std::fill(C, C + K * V, S(0));
  const T* x[kBlockRows];
  const T* d[kBlockRows];
  for (int64_t t0 = 0; t0 < rows; t0 += kBlockRows) {
    const int64_t nb = std::min(kBlockRows, rows - t0);
    for (int64_t i = 0; i < nb; ++i) x[i] = row(t0 + i), d[i] = drow(t0 + i);
    for (int64_t k = 0; k < K; ++k) {
      S* c = C + k * V;
      for (int64_t i = 0; i < nb; ++i) {
        const S pk = S(x[i][V + k]);
        if (pk == S(0)) continue;
        const T* di = d[i];
        for (int64_t v = 0; v < V; ++v) c[v] += pk * S(di[v]);
      }
    }
  }
}

/// What the split cannot take, whatever the pass: packed batches and the models without a chunkwise form.
template <class R, class T>
void check_splittable(const Inputs<T>& in) {
  if (in.cu_seqlens.data) throw Error("cu_seqlens: packed batches are not supported by the distributed calls");
  if (!chunkwise_covers(spec_of<R>()))
    throw Error(std::string("no distributed algorithm for ") + to_string(spec_of<R>()) +
                " (the exact preconditioners run token by token)");
}

/// A contiguous 4-d view of a vector.
template <class U>
TensorView<U> view4(std::vector<std::remove_const_t<U>>& v, int64_t a, int64_t b, int64_t c, int64_t d) {
  return TensorView<U>(v.data(), {a, b, c, d});
}

/// The diagonal statistics of this rank's segment (double): per (sequence, key head) G = sum g_p and the
/// statistics reached from A_in, run token by token as SPEC §2 writes them (the normalised keys).
template <class T>
struct Stats {
  int64_t N = 0, H = 0, K = 0;
  std::vector<double> G;  ///< [N, H]
  /// The statistics after the segment from `a_in` ([N, H, K]; zero when empty).
  std::vector<double> run(const Problem<T>& p, const std::vector<double>& a_in) const {
    std::vector<double> a = a_in.empty() ? std::vector<double>(static_cast<size_t>(N * H * K), 0.0) : a_in;
    std::vector<double> kn(static_cast<size_t>(K));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < p.T_; ++t)
        for (int64_t h = 0; h < H; ++h) {
          normalised_key(p, n, t, h, kn.data());
          const double dec = std::exp(double(p.g_p(n, t, h))), bp = double(p.beta_p(n, t, h));
          double* ah = &a[static_cast<size_t>((n * H + h) * K)];
          for (int64_t c = 0; c < K; ++c) ah[c] = maths::stats_step(ah[c], dec, bp, kn[static_cast<size_t>(c)]);
        }
    return a;
  }
  /// The key row (n, t, h) as the statistics see it, L2-normalised when the call asks; returns the factor
  /// applied (1 / sqrt(sum k^2 + 1e-6), or 1), which the backward's chain through the norm reuses.
  static double normalised_key(const Problem<T>& p, int64_t n, int64_t t, int64_t h, double* kn) {
    double ss = 0;
    for (int64_t c = 0; c < p.K; ++c) {
      kn[c] = double(p.k(n, t, h, c));
      ss += kn[c] * kn[c];
    }
    if (!p.l2norm) return 1.0;
    const double inv = 1.0 / std::sqrt(ss + 1e-6);
    for (int64_t c = 0; c < p.K; ++c) kn[c] *= inv;
    return inv;
  }
  explicit Stats(const Problem<T>& p) : N(p.B), H(p.H), K(p.K), G(static_cast<size_t>(p.B * p.H), 0.0) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < p.T_; ++t)
        for (int64_t h = 0; h < H; ++h) G[static_cast<size_t>(n * H + h)] += double(p.g_p(n, t, h));
  }
};

/// The forward phase every call runs: the statistics entering this rank's segment, every rank's state map,
/// the state entering this segment, the segment's outputs from a zero state and p_t.
template <class T>
struct Segment {
  using S = state_t<T>;
  int r = 0, R = 1;
  int64_t N = 0, HV = 0, H = 0, K = 0, V = 0, T_ = 0, W = 0;  // W = V + K
  bool precond = false;
  std::vector<double> stats_all;  ///< [R, N, H, 1 + K]: each rank's (G, b); rank 0's b includes a0
  std::vector<double> a_in;       ///< [N, H, K] statistics entering this segment (precond only)
  std::vector<S> maps;            ///< [R, N, HV, K, W]: rank j's [B_j | M_j]; rank 0's M is zero
  std::vector<S> s_in;            ///< [N, HV, K, V] state entering this segment
  std::vector<T> o_aug;           ///< [N, T, HV, W]: outputs from [0 | I] (ranks > 0): o(0) and p_t

  const S* map(int j, int64_t n, int64_t hv) const {
    return &maps[static_cast<size_t>(((int64_t(j) * N + n) * HV + hv) * K * W)];
  }

  /// S <- M_j S + B_j for every (sequence, value head); S [N, HV, K, V].
  void apply(int j, std::vector<S>& st) const {
    std::vector<double> row(static_cast<size_t>(V));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv) {
        const S* m = map(j, n, hv);
        S* s = &st[static_cast<size_t>((n * HV + hv) * K * V)];
        std::vector<S> out(static_cast<size_t>(K * V));
        for (int64_t c = 0; c < K; ++c) {
          for (int64_t v = 0; v < V; ++v) row[static_cast<size_t>(v)] = double(m[c * W + v]);
          for (int64_t d = 0; d < K; ++d) {
            const double mcd = double(m[c * W + V + d]);
            if (mcd == 0) continue;
            for (int64_t v = 0; v < V; ++v) row[static_cast<size_t>(v)] += mcd * double(s[d * V + v]);
          }
          for (int64_t v = 0; v < V; ++v) out[static_cast<size_t>(c * V + v)] = S(row[static_cast<size_t>(v)]);
        }
        std::copy(out.begin(), out.end(), s);
      }
  }
  /// The statistics fold over ranks [0, upto): a = exp(G_j) a + b_j.
  std::vector<double> stats_upto(int upto) const {
    std::vector<double> a(static_cast<size_t>(N * H * K), 0.0);
    for (int j = 0; j < upto; ++j)
      for (int64_t nh = 0; nh < N * H; ++nh) {
        const double* m = &stats_all[static_cast<size_t>((int64_t(j) * N * H + nh) * (1 + K))];
        const double dec = std::exp(m[0]);
        for (int64_t c = 0; c < K; ++c)
          a[static_cast<size_t>(nh * K + c)] = dec * a[static_cast<size_t>(nh * K + c)] + m[1 + c];
      }
    return a;
  }
};

template <class R, class T>
Segment<T> forward_phase(Communicator& comm, const Problem<T>& p, const Options& opt, RunInfo& ran,
                         const TensorView<T>* o_rank0) {
  using S = state_t<T>;
  Segment<T> s;
  s.r = comm.rank(), s.R = comm.size();
  s.N = p.B, s.HV = p.HV, s.H = p.H, s.K = p.K, s.V = p.V, s.T_ = p.T_, s.W = p.V + p.K;
  s.precond = p.spec.precond != precond::Kind::identity;
  const int64_t N = s.N, H = s.H, HV = s.HV, K = s.K, V = s.V, W = s.W, Tn = s.T_;

  // 1. Statistics: each rank's (G, b), gathered; the fold up to this rank gives a_in.
  if (s.precond) {
    const Stats<T> st(p);
    std::vector<double> a0;
    if (s.r == 0 && p.a0.data) {
      a0.resize(static_cast<size_t>(N * H * K));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < K; ++c) a0[static_cast<size_t>((n * H + h) * K + c)] = double(p.a0(n, h, c));
    }
    const std::vector<double> b = st.run(p, a0);
    std::vector<double> msg(static_cast<size_t>(N * H * (1 + K)));
    for (int64_t nh = 0; nh < N * H; ++nh) {
      msg[static_cast<size_t>(nh * (1 + K))] = s.r == 0 ? 0.0 : st.G[static_cast<size_t>(nh)];
      std::copy_n(&b[static_cast<size_t>(nh * K)], K, &msg[static_cast<size_t>(nh * (1 + K) + 1)]);
    }
    s.stats_all.resize(msg.size() * static_cast<size_t>(s.R));
    comm.all_gather(msg.data(), msg.size() * sizeof(double), s.stats_all.data());
    s.a_in = s.stats_upto(s.r);
  }

  // 2. This rank's map: rank 0 runs its segment from the caller's h0 (its map is constant); the others from
  //    [0 | I] with the values widened to [v | 0].
  std::vector<S> msg(static_cast<size_t>(N * HV * K * W), S(0));
  Inputs<T> in;
  in.shape = Shape{.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  in.q = p.q, in.k = p.k, in.v = p.v, in.g = p.g, in.beta = p.beta, in.g_p = p.g_p, in.beta_p = p.beta_p;
  in.center = p.center;
  std::vector<S> a_in_s;
  if (s.precond) {
    a_in_s.assign(s.a_in.begin(), s.a_in.end());
    in.a0 = TensorView<const S>(a_in_s.data(), {N, H, K});
  }
  if (s.r == 0) {
    std::vector<S> hT(static_cast<size_t>(N * HV * K * V));
    std::vector<T> o_scratch;
    if (Tn > 0) {
      in.h0 = p.h0;
      in.a0 = p.a0;
      Outputs<T> out;
      if (o_rank0) {
        out.o = *o_rank0;
      } else {
        o_scratch.resize(static_cast<size_t>(N * Tn * HV * V));
        out.o = TensorView<T>(o_scratch.data(), {N, Tn, HV, V});
      }
      out.hT = TensorView<S>(hT.data(), {N, HV, K, V});
      ran = dgps::forward<R, T>(in, out, opt);
    } else if (p.h0.data) {
      for (int64_t n = 0; n < N; ++n)
        for (int64_t hv = 0; hv < HV; ++hv)
          for (int64_t c = 0; c < K; ++c)
            for (int64_t v = 0; v < V; ++v)
              hT[static_cast<size_t>(((n * HV + hv) * K + c) * V + v)] = p.h0(n, hv, c, v);
    }
    for (int64_t i = 0; i < N * HV * K; ++i)
      std::copy_n(&hT[static_cast<size_t>(i * V)], V, &msg[static_cast<size_t>(i * W)]);
  } else {
    std::vector<S> h0(static_cast<size_t>(N * HV * K * W), S(0));
    for (int64_t i = 0; i < N * HV; ++i)
      for (int64_t c = 0; c < K; ++c) h0[static_cast<size_t>((i * K + c) * W + V + c)] = S(1);
    if (Tn > 0) {
      std::vector<T> v_aug(static_cast<size_t>(N * Tn * HV * W), T(0));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t t = 0; t < Tn; ++t)
          for (int64_t hv = 0; hv < HV; ++hv) {
            T* dst = &v_aug[static_cast<size_t>(((n * Tn + t) * HV + hv) * W)];
            for (int64_t v = 0; v < V; ++v) dst[v] = p.v(n, t, hv, v);
          }
      in.shape.value_dim = W;
      in.v = TensorView<const T>(v_aug.data(), {N, Tn, HV, W});
      in.h0 = TensorView<const S>(h0.data(), {N, HV, K, W});
      s.o_aug.resize(static_cast<size_t>(N * Tn * HV * W));
      Outputs<T> out;
      out.o = TensorView<T>(s.o_aug.data(), {N, Tn, HV, W});
      out.hT = TensorView<S>(msg.data(), {N, HV, K, W});
      ran = dgps::forward<R, T>(in, out, opt);
    } else {
      msg = h0;
      ran = RunInfo{dgps::detail::select_backend(opt.backend), Algorithm::automatic, "none"};
    }
  }
  s.maps.resize(msg.size() * static_cast<size_t>(s.R));
  comm.all_gather(msg.data(), msg.size() * sizeof(S), s.maps.data());

  // 3. The state entering this segment: the maps of ranks 0 .. r-1 folded in order.
  s.s_in.assign(static_cast<size_t>(N * HV * K * V), S(0));
  for (int j = 0; j < s.r; ++j) s.apply(j, s.s_in);
  return s;
}

}  // namespace detail

/// Forward of model R over a sequence (or a batch of B sequences) split over the ranks of `comm`: `in`
/// holds this rank's segment of every sequence, [B, T_r, ...] (T_r may differ between ranks and be 0;
/// rank 0 holds the first tokens). Writes this rank's outputs `o` [B, T_r, HV, V] and, where requested
/// (on any rank), the sequences' final states hT, aT after the last rank. `h0`, `a0` are read on rank 0 only.
/// Every rank of `comm` must call it with the same model, type and sizes B, H, HV, K, V; a bad call on any
/// rank throws the same dgps::Error on every rank (naming the rank) and writes nothing. Packed batches
/// (cu_seqlens) and the exact preconditioners are not supported. Host tensors (float, double, bf16, f16);
/// each rank's own work runs on `opt.backend` with `opt.threads` threads. Returns what ran on this rank.
template <class R, class T>
RunInfo forward(Communicator& comm, const Inputs<T>& in, const Outputs<T>& out, const Options& opt = {}) {
  using S = state_t<T>;
  const auto p = detail::agree<R, T>(comm, "forward", [&] {
    detail::check_splittable<R>(in);
    if (out.cache) throw Error("save_for_backward: the distributed forward fills no training cache");
    auto prob = dgps::detail::check_forward<R>(in, out, opt);
    if (comm.rank() != 0) prob.h0 = {}, prob.a0 = {};
    return prob;
  });
  RunInfo ran;
  auto seg = detail::forward_phase<R, T>(comm, p, opt, ran, &p.o);
  const int64_t N = p.B, HV = p.HV, K = p.K, V = p.V, W = V + K, Tn = p.T_;
  if (seg.r > 0)  // o = o(0) + S_in^T p_t
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv)
        detail::widened_readout<S, T>(
            Tn, K, V, &seg.s_in[static_cast<size_t>((n * HV + hv) * K * V)],
            [&](int64_t t) { return &seg.o_aug[static_cast<size_t>(((n * Tn + t) * HV + hv) * W)]; },
            [&](int64_t t) { return &p.o(n, t, hv, 0); });
  if (p.hT.data) {
    std::vector<S> st(static_cast<size_t>(N * HV * K * V), S(0));
    for (int j = 0; j < seg.R; ++j) seg.apply(j, st);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t c = 0; c < K; ++c)
          for (int64_t v = 0; v < V; ++v) p.hT(n, hv, c, v) = st[static_cast<size_t>(((n * HV + hv) * K + c) * V + v)];
  }
  if (p.aT.data) {
    const std::vector<double> a = seg.stats_upto(seg.R);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t c = 0; c < K; ++c) p.aT(n, h, c) = S(a[static_cast<size_t>((n * p.H + h) * K + c)]);
  }
  ran.impl = "distributed/" + std::to_string(seg.R) + "/" + ran.impl;
  return ran;
}

/// Backward of the distributed forward: this rank's gradients of `loss = sum(o * do) + sum(hT * dhT) +
/// sum(aT * daT)` over all ranks, for the inputs of its segment. `do` is this rank's [B, T_r, HV, V];
/// `dhT`, `daT` (the final states' cotangents) are read on the last rank only. `dh0`, `da0` are written on
/// rank 0 and set to zero on the others; `dcenter` is this rank's share (the gradient is the sum over the
/// ranks, as a data-parallel all-reduce forms it). No training cache. Otherwise as distributed::forward.
template <class R, class T>
RunInfo backward(Communicator& comm, const Inputs<T>& in, const GradsIn<T>& gin, const Grads<T>& grads,
                 const Options& opt = {}) {
  using S = state_t<T>;
  const auto p = detail::agree<R, T>(comm, "backward", [&] {
    detail::check_splittable<R>(in);
    if (gin.cache) throw Error("use_saved: the distributed backward reads no training cache");
    auto prob = dgps::detail::check_backward<R>(in, gin, grads, opt);
    if (comm.rank() != 0) prob.h0 = {}, prob.a0 = {};
    if (comm.rank() != comm.size() - 1) prob.dhT = {}, prob.daT = {};
    return prob;
  });
  RunInfo ran;
  auto seg = detail::forward_phase<R, T>(comm, p, opt, ran, nullptr);
  const int64_t N = p.B, H = p.H, HV = p.HV, K = p.K, V = p.V, W = V + K, Tn = p.T_;
  const int r = seg.r, Rn = seg.R;

  // c_r = sum_t p_t do_t^T (ranks > 0), gathered; the cotangent of this segment's final state by the
  // reverse fold dS <- M_j^T dS + c_j over ranks R-1 .. r+1, starting from dhT.
  std::vector<S> c(static_cast<size_t>(N * HV * K * V), S(0));
  if (r > 0)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv)
        detail::widened_cotangent<S, T>(
            Tn, K, V, [&](int64_t t) { return &seg.o_aug[static_cast<size_t>(((n * Tn + t) * HV + hv) * W)]; },
            [&](int64_t t) { return &p.d_o(n, t, hv, 0); }, &c[static_cast<size_t>((n * HV + hv) * K * V)]);
  std::vector<S> c_all(c.size() * static_cast<size_t>(Rn));
  comm.all_gather(c.data(), c.size() * sizeof(S), c_all.data());
  // dhT is read on the last rank only: every rank gathers it from there.
  std::vector<S> ds(static_cast<size_t>(N * HV * K * V), S(0)), ds_all(ds.size() * static_cast<size_t>(Rn));
  if (r == Rn - 1 && p.dhT.data)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t v = 0; v < V; ++v) ds[static_cast<size_t>(((n * HV + hv) * K + k) * V + v)] = p.dhT(n, hv, k, v);
  comm.all_gather(ds.data(), ds.size() * sizeof(S), ds_all.data());
  ds.assign(ds_all.end() - std::ptrdiff_t(ds.size()), ds_all.end());
  for (int j = Rn - 1; j > r; --j) {
    std::vector<double> row(static_cast<size_t>(V));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv) {
        const S* m = seg.map(j, n, hv);
        const S* cj = &c_all[static_cast<size_t>((int64_t(j) * N * HV + n * HV + hv) * K * V)];
        S* d = &ds[static_cast<size_t>((n * HV + hv) * K * V)];
        std::vector<S> next(static_cast<size_t>(K * V));
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t v = 0; v < V; ++v) row[static_cast<size_t>(v)] = double(cj[k * V + v]);
          for (int64_t e = 0; e < K; ++e) {  // (M^T dS)[k] = sum_e M[e][k] dS[e]
            const double mek = double(m[e * W + V + k]);
            if (mek == 0) continue;
            for (int64_t v = 0; v < V; ++v) row[static_cast<size_t>(v)] += mek * double(d[e * V + v]);
          }
          for (int64_t v = 0; v < V; ++v) next[static_cast<size_t>(k * V + v)] = S(row[static_cast<size_t>(v)]);
        }
        std::copy(next.begin(), next.end(), d);
      }
  }

  // One ordinary backward of this segment from its true incoming states with that cotangent.
  std::vector<S> a_in_s(seg.a_in.begin(), seg.a_in.end()), da0_local;
  Grads<T> g2;
  g2.dq = p.dq, g2.dk = p.dk, g2.dv = p.dv, g2.dg = p.dg, g2.dbeta = p.dbeta, g2.dg_p = p.dg_p;
  g2.dbeta_p = p.dbeta_p, g2.dcenter = p.dcenter;
  if (Tn > 0) {
    Inputs<T> in2;
    in2.shape = Shape{.batch = N, .time = Tn, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
    in2.q = p.q, in2.k = p.k, in2.v = p.v, in2.g = p.g, in2.beta = p.beta, in2.g_p = p.g_p;
    in2.beta_p = p.beta_p, in2.center = p.center;
    if (r == 0) {
      in2.h0 = p.h0, in2.a0 = p.a0;
      g2.dh0 = p.dh0;
    } else {
      in2.h0 = TensorView<const S>(seg.s_in.data(), {N, HV, K, V});
      if (seg.precond) in2.a0 = TensorView<const S>(a_in_s.data(), {N, H, K});
    }
    if (seg.precond && in2.a0.data) {
      da0_local.assign(static_cast<size_t>(N * H * K), S(0));
      g2.da0 = TensorView<S>(da0_local.data(), {N, H, K});
    }
    GradsIn<T> gi2;
    gi2.d_o = p.d_o;
    gi2.dhT = TensorView<const S>(ds.data(), {N, HV, K, V});
    ran = dgps::backward<R, T>(in2, gi2, g2, opt);
  } else {
    ran = RunInfo{dgps::detail::select_backend(opt.backend), Algorithm::automatic, "none"};
    if (r == 0 && p.dh0.data)  // an empty segment passes the cotangent through
      for (int64_t n = 0; n < N; ++n)
        for (int64_t hv = 0; hv < HV; ++hv)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t v = 0; v < V; ++v)
              p.dh0(n, hv, k, v) = ds[static_cast<size_t>(((n * HV + hv) * K + k) * V + v)];
    if (p.dcenter.data)
      for (int64_t h = 0; h < H; ++h) p.dcenter(h) = T(0);
  }
  if (r == 0 && p.da0.data)  // this segment's own share; the later ranks' is added below
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c2 = 0; c2 < K; ++c2)
          p.da0(n, h, c2) = da0_local.empty() ? S(0) : da0_local[static_cast<size_t>((n * H + h) * K + c2)];
  if (r != 0 && p.dh0.data)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t v = 0; v < V; ++v) p.dh0(n, hv, k, v) = S(0);

  // The statistics: dA_in^(j) = e_j + exp(G_j) dA_out^(j), e_j this backward's da0; folded from daT over
  // ranks R-1 .. r+1, then its share in dk, dg_p, dbeta_p (and da0 on rank 0) in closed form.
  if (seg.precond) {
    std::vector<double> msg(static_cast<size_t>(N * H * (1 + K)), 0.0), all(msg.size() * static_cast<size_t>(Rn));
    const detail::Stats<T> st(p);
    for (int64_t nh = 0; nh < N * H; ++nh) {
      msg[static_cast<size_t>(nh * (1 + K))] = st.G[static_cast<size_t>(nh)];
      if (!da0_local.empty())
        for (int64_t c2 = 0; c2 < K; ++c2)
          msg[static_cast<size_t>(nh * (1 + K) + 1 + c2)] = double(da0_local[static_cast<size_t>(nh * K + c2)]);
    }
    comm.all_gather(msg.data(), msg.size() * sizeof(double), all.data());
    std::vector<double> daT(static_cast<size_t>(N * H * K), 0.0), daT_all(daT.size() * static_cast<size_t>(Rn));
    if (r == Rn - 1 && p.daT.data)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c2 = 0; c2 < K; ++c2) daT[static_cast<size_t>((n * H + h) * K + c2)] = double(p.daT(n, h, c2));
    comm.all_gather(daT.data(), daT.size() * sizeof(double), daT_all.data());
    std::vector<double> dA(daT_all.end() - std::ptrdiff_t(daT.size()), daT_all.end());
    for (int j = Rn - 1; j > r; --j)
      for (int64_t nh = 0; nh < N * H; ++nh) {
        const double* m = &all[static_cast<size_t>((int64_t(j) * N * H + nh) * (1 + K))];
        const double dec = std::exp(m[0]);
        for (int64_t c2 = 0; c2 < K; ++c2)
          dA[static_cast<size_t>(nh * K + c2)] = m[1 + c2] + dec * dA[static_cast<size_t>(nh * K + c2)];
      }
    // Closed form of d<dA, A_out>: A_out = (prod_{m>=t} a_m) A_{t-1} + ..., A_t = a_t A_{t-1} + beta_p,t kn_t^2.
    std::vector<double> a = seg.a_in;  // running statistics A_{t-1}
    if (r == 0) {
      a.assign(static_cast<size_t>(N * H * K), 0.0);
      if (p.a0.data)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t c2 = 0; c2 < K; ++c2) a[static_cast<size_t>((n * H + h) * K + c2)] = double(p.a0(n, h, c2));
    }
    std::vector<double> kn(static_cast<size_t>(K)), dkn(static_cast<size_t>(K));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const double* D = &dA[static_cast<size_t>((n * H + h) * K)];
        double* ah = &a[static_cast<size_t>((n * H + h) * K)];
        double rest = st.G[static_cast<size_t>(n * H + h)];  // sum of g_p over tokens t .. end
        for (int64_t t = 0; t < Tn; ++t) {
          const double gp = double(p.g_p(n, t, h)), bp = double(p.beta_p(n, t, h));
          const double w_prev = std::exp(rest);      // prod_{m>=t} a_m
          const double w_tok = std::exp(rest - gp);  // prod_{m>t} a_m
          const double inv = detail::Stats<T>::normalised_key(p, n, t, h, kn.data());
          double dgp = 0, dbp = 0;
          for (int64_t c2 = 0; c2 < K; ++c2) {
            dgp += D[c2] * w_prev * ah[c2];
            dbp += D[c2] * w_tok * kn[static_cast<size_t>(c2)] * kn[static_cast<size_t>(c2)];
          }
          if (p.dg_p.data) p.dg_p(n, t, h) = T(double(p.dg_p(n, t, h)) + dgp);
          if (p.dbeta_p.data) p.dbeta_p(n, t, h) = T(double(p.dbeta_p(n, t, h)) + dbp);
          if (p.dk.data) {  // d kn = 2 D w_tok beta_p kn, through the L2 norm to k
            double dot = 0;
            for (int64_t c2 = 0; c2 < K; ++c2) {
              dkn[static_cast<size_t>(c2)] = 2 * D[c2] * w_tok * bp * kn[static_cast<size_t>(c2)];
              dot += double(p.k(n, t, h, c2)) * dkn[static_cast<size_t>(c2)];
            }
            for (int64_t c2 = 0; c2 < K; ++c2) {
              double d = dkn[static_cast<size_t>(c2)];
              if (p.l2norm) d = (d - double(p.k(n, t, h, c2)) * dot * inv * inv) * inv;
              p.dk(n, t, h, c2) = T(double(p.dk(n, t, h, c2)) + d);
            }
          }
          const double dec = std::exp(gp);
          for (int64_t c2 = 0; c2 < K; ++c2) ah[c2] = maths::stats_step(ah[c2], dec, bp, kn[static_cast<size_t>(c2)]);
          rest -= gp;
        }
        if (r == 0 && p.da0.data)
          for (int64_t c2 = 0; c2 < K; ++c2)
            p.da0(n, h, c2) = S(double(p.da0(n, h, c2)) + std::exp(st.G[static_cast<size_t>(n * H + h)]) * D[c2]);
      }
  }
  if (r != 0 && p.da0.data)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c2 = 0; c2 < K; ++c2) p.da0(n, h, c2) = S(0);
  ran.impl = "distributed/" + std::to_string(Rn) + "/" + ran.impl;
  return ran;
}

}  // namespace dgps::distributed
