/// @brief A minimal continuous-batching loop on the CPU: requests arrive and finish, prefills and speculative
/// verification steps run through one GDN state pool (docs/serving.md), rollback by slot choice, tokens/s printed.
///
/// The "model" is one GDN layer over fixed random token embeddings with a random readout to a small vocabulary
/// (greedy). Every request owns a row of D + 1 pool slots. Each engine step runs (1) one packed prefill of the
/// requests that arrived (start from zero: has_initial = 0; final state to slot row[0]) and (2) one speculative
/// verification of every running request: the last token plus D draft tokens, starting from the slot of the last
/// accepted token, the state after every token written to row[t]. Drafts come from the target run token by token
/// into a scratch slot (slots -> out_slots), its greedy token kept with probability 0.7, else a random one, so some
/// are rejected: the next step simply starts from row[accepted - 1]
/// (no copy, no recompute). When a request finishes, its state is checked against one forward over its whole
/// accepted history.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include <dgps/dgps.hpp>

namespace {

constexpr int64_t H = 4, K = 32, V = 32, VOCAB = 64, D = 3;  // D draft tokens per verification
using Model = dgps::GDN;

/// Fixed random per-token inputs (q, k, v, g, beta of one token) and the readout o -> logits.
struct Toy {
  std::vector<float> q, k, v, g, beta, out;
  explicit Toy(std::mt19937& rng) {
    std::normal_distribution<float> z;
    auto fill = [&](std::vector<float>& x, int64_t n, float s, float m) {
      x.resize(size_t(n));
      for (float& e : x) e = m + s * z(rng);
    };
    fill(q, VOCAB * H * K, 1, 0), fill(k, VOCAB * H * K, 1, 0), fill(v, VOCAB * H * V, 1, 0);
    fill(g, VOCAB * H, 0.3f, -0.5f), fill(beta, VOCAB * H, 0.5f, 0);
    for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
    for (float& e : g) e = std::min(e, -0.01f);
    fill(out, H * V * VOCAB, 1, 0);
  }
  /// Packed inputs of a list of tokens.
  struct Batch {
    std::vector<float> q, k, v, g, beta;
  };
  Batch gather(const std::vector<int>& toks) const {
    Batch b;
    for (int t : toks) {
      b.q.insert(b.q.end(), q.begin() + t * H * K, q.begin() + (t + 1) * H * K);
      b.k.insert(b.k.end(), k.begin() + t * H * K, k.begin() + (t + 1) * H * K);
      b.v.insert(b.v.end(), v.begin() + t * H * V, v.begin() + (t + 1) * H * V);
      b.g.insert(b.g.end(), g.begin() + t * H, g.begin() + (t + 1) * H);
      b.beta.insert(b.beta.end(), beta.begin() + t * H, beta.begin() + (t + 1) * H);
    }
    return b;
  }
  /// Greedy next token from one output row o [H * V].
  int argmax(const float* o) const {
    int best = 0;
    float bv = -1e30f;
    for (int w = 0; w < VOCAB; ++w) {
      float s = 0;
      for (int64_t i = 0; i < H * V; ++i) s += o[i] * out[size_t(i * VOCAB + w)];
      if (s > bv) bv = s, best = w;
    }
    return best;
  }
};

struct Request {
  int id, arrive, want;            // arrival step, tokens to generate
  std::vector<int> history;        // every token fed to the model so far (prompt, then accepted ones)
  int next = -1;                   // the next token to feed (the last one generated)
  int generated = 0, row = -1, accepted = 1;
};

/// Runs `toks` (packed by `cu`) through decode with `st`; returns o [T, H, V].
std::vector<float> run(const Toy& toy, const std::vector<int>& toks, const std::vector<int64_t>& cu,
                       const dgps::DecodeState<float>& st) {
  const Toy::Batch b = toy.gather(toks);
  const int64_t T = int64_t(toks.size()), N = int64_t(cu.size()) - 1;
  const dgps::Shape s{.batch = 1, .time = T, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
  auto in = dgps::inputs<float>(s, b.q.data(), b.k.data(), b.v.data()).decay(b.g.data()).gain(b.beta.data());
  in.varlen(cu.data(), N);
  std::vector<float> o(size_t(std::max<int64_t>(1, T * H * V)));
  dgps::decode<Model>(st, in, o.data());
  return o;
}

}  // namespace

int main() {
  std::mt19937 rng(37);
  const Toy toy(rng);
  const int64_t ROWS = 16, P = ROWS * (D + 2);  // 16 running requests: D + 1 slots each, then 16 scratch slots
  std::vector<float> pool(size_t(P * H * K * V), 0.0f);
  std::vector<int> free_rows;
  for (int r = int(ROWS) - 1; r >= 0; --r) free_rows.push_back(r);
  std::vector<Request> waiting, running;
  std::uniform_int_distribution<int> len(8, 96), gen(8, 40), tok(0, VOCAB - 1);
  std::uniform_real_distribution<float> u(0, 1);
  for (int i = 0; i < 40; ++i) {  // 40 requests arriving over the first 30 steps
    Request q{i, int(u(rng) * 30), gen(rng), {}};
    for (int t = len(rng); t > 0; --t) q.history.push_back(tok(rng));
    waiting.push_back(q);
  }
  auto state = [&] {
    dgps::DecodeState<float> st;
    st.h = dgps::view(pool.data(), {P, H, K, V});
    return st;
  };
  int64_t fed = 0, emitted = 0, drafts = 0, accepted_drafts = 0, finished = 0;
  double worst = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; !waiting.empty() || !running.empty(); ++step) {
    // (1) Admit arrivals while rows are free; one packed prefill (chunkwise for long prompts).
    std::vector<Request> admit;
    for (auto it = waiting.begin(); it != waiting.end();)
      if (it->arrive <= step && !free_rows.empty()) {
        it->row = free_rows.back(), free_rows.pop_back();
        admit.push_back(*it), it = waiting.erase(it);
      } else {
        ++it;
      }
    if (!admit.empty()) {
      std::vector<int> toks;
      std::vector<int64_t> cu{0}, slots, init(admit.size(), 0);
      for (const Request& r : admit) {
        toks.insert(toks.end(), r.history.begin(), r.history.end());
        cu.push_back(int64_t(toks.size()));
        slots.push_back(r.row * (D + 1));
      }
      std::vector<uint8_t> has(admit.size(), 0);  // new requests start from zero whatever the slot holds
      auto st = state();
      st.slots = dgps::view(static_cast<const int64_t*>(slots.data()), {int64_t(slots.size())});
      st.has_initial = dgps::view(static_cast<const uint8_t*>(has.data()), {int64_t(has.size())});
      const std::vector<float> o = run(toy, toks, cu, st);
      for (size_t n = 0; n < admit.size(); ++n) {
        admit[n].next = toy.argmax(o.data() + (cu[n + 1] - 1) * H * V);
        admit[n].accepted = 1;
        ++emitted, ++admit[n].generated;
        running.push_back(admit[n]);
      }
      fed += int64_t(toks.size());
    }
    if (running.empty()) continue;
    // (2) Drafts: the target itself, token by token from the request's state into a scratch slot (slots ->
    // out_slots, the pool row untouched), its greedy token kept with probability 0.7, else a random one.
    const int64_t N = int64_t(running.size());
    std::vector<std::vector<int>> feeds;
    std::vector<int64_t> from, scratch, cu1(size_t(N + 1));
    std::vector<int> cur;
    for (int64_t n = 0; n < N; ++n) {
      const Request& r = running[size_t(n)];
      feeds.push_back({r.next});
      cur.push_back(r.next);
      from.push_back(r.row * (D + 1) + r.accepted - 1);
      scratch.push_back(ROWS * (D + 1) + r.row);
      cu1[size_t(n + 1)] = n + 1;
    }
    for (int d = 0; d < D; ++d) {
      auto st = state();
      st.slots = dgps::view(static_cast<const int64_t*>(d == 0 ? from.data() : scratch.data()), {N});
      st.out_slots = dgps::view(static_cast<const int64_t*>(scratch.data()), {N});
      const std::vector<float> o = run(toy, cur, cu1, st);
      for (int64_t n = 0; n < N; ++n) {
        const int guess = toy.argmax(o.data() + n * H * V);
        cur[size_t(n)] = u(rng) < 0.7f ? guess : tok(rng);
        feeds[size_t(n)].push_back(cur[size_t(n)]);
      }
    }
    // (3) Speculative verification of every running request: its next token plus the D drafts, starting from
    // the slot of its last accepted token; the state after token t goes to row[t].
    std::vector<int> toks;
    std::vector<int64_t> cu{0}, tslots, acc;
    for (int64_t n = 0; n < N; ++n) {
      const Request& r = running[size_t(n)];
      for (int64_t t = 0; t <= D; ++t) tslots.push_back(r.row * (D + 1) + t);
      acc.push_back(r.accepted);
      toks.insert(toks.end(), feeds[size_t(n)].begin(), feeds[size_t(n)].end());
      cu.push_back(int64_t(toks.size()));
    }
    auto st = state();
    st.token_slots = dgps::view(static_cast<const int64_t*>(tslots.data()), {int64_t(running.size()), D + 1});
    st.num_accepted = dgps::view(static_cast<const int64_t*>(acc.data()), {int64_t(running.size())});
    const std::vector<float> o = run(toy, toks, cu, st);
    fed += int64_t(toks.size());
    for (size_t n = 0; n < running.size(); ++n) {
      Request& r = running[n];
      // Accept drafts while they equal the target's greedy token; the first mismatch yields the bonus token.
      int a = 1;
      int bonus = toy.argmax(o.data() + cu[n] * H * V);
      while (a <= D && feeds[n][size_t(a)] == bonus && r.generated + a < r.want) {
        bonus = toy.argmax(o.data() + (cu[n] + a) * H * V);
        ++a;
      }
      drafts += D, accepted_drafts += a - 1;
      r.history.insert(r.history.end(), feeds[n].begin(), feeds[n].begin() + a);
      r.accepted = a;  // rollback: the next step starts from slot row[a - 1]
      r.next = bonus;
      r.generated += a, emitted += a;
    }
    for (auto it = running.begin(); it != running.end();) {
      if (it->generated < it->want) {
        ++it;
        continue;
      }
      // Finished: its state (slot row[accepted - 1]) must equal one forward over its accepted history.
      const int64_t Tn = int64_t(it->history.size());
      const Toy::Batch b = toy.gather(it->history);
      const dgps::Shape s{.batch = 1, .time = Tn, .heads = H, .v_heads = H, .key_dim = K, .value_dim = V};
      std::vector<float> o2(size_t(Tn * H * V)), hT(size_t(H * K * V));
      dgps::forward<Model>(
          dgps::inputs<float>(s, b.q.data(), b.k.data(), b.v.data()).decay(b.g.data()).gain(b.beta.data()),
          dgps::outputs<float>(o2.data()).final_state(hT.data()));
      const float* slot = pool.data() + (it->row * (D + 1) + it->accepted - 1) * H * K * V;
      for (int64_t i = 0; i < H * K * V; ++i) worst = std::max(worst, double(std::fabs(slot[i] - hT[size_t(i)])));
      free_rows.push_back(it->row);
      ++finished;
      it = running.erase(it);
    }
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("serve_loop: %lld requests, %lld tokens fed (prefill + verification), %lld generated in %.3f s: "
              "%.0f tokens/s fed, %.0f generated tokens/s\n",
              static_cast<long long>(finished), static_cast<long long>(fed), static_cast<long long>(emitted), sec,
              double(fed) / sec, double(emitted) / sec);
  std::printf("serve_loop: %lld of %lld drafts accepted; max |pool state - forward over the accepted history| = %.2e\n",
              static_cast<long long>(accepted_drafts), static_cast<long long>(drafts), worst);
  return worst < 1e-3 ? 0 : 1;
}
