/// @brief dgps::distributed (context parallelism, ranks = threads): a sequence split over 1-4 ranks, forward and
/// backward, against the single call, for every chunkwise model; validation on every rank.
#include <doctest/doctest.h>

#include <dgps/distributed.hpp>

#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

const char* const kPerToken[] = {"q", "k", "v", "g", "beta", "g_p", "beta_p", "do"};

/// Tokens [t0, t1) of every sequence of `c` (B rows of T tokens). An empty segment keeps a one-element dummy
/// buffer per token input so that no pointer is null.
Case segment_of(const Case& c, int64_t t0, int64_t t1) {
  Case s = c;
  const int64_t B = c.shape.batch, T = c.shape.time, L = t1 - t0;
  s.shape.time = L;
  for (const char* name : kPerToken) {
    if (!c.has(name)) continue;
    auto dims = c.shapes.at(name);
    const int64_t per = product(dims) / (B * T);
    const auto& src = c.arr.at(name);
    std::vector<double> dst;
    for (int64_t b = 0; b < B; ++b)
      dst.insert(dst.end(), src.begin() + (b * T + t0) * per, src.begin() + (b * T + t1) * per);
    if (dst.empty()) dst.assign(1, 0.0);
    s.arr[name] = std::move(dst);
    dims[1] = L;
    s.shapes[name] = dims;
  }
  return s;
}

/// Runs case `c` split into segments of `lens` tokens over a ThreadGroup (one thread per rank): the forward
/// (o concatenated over ranks; hT, aT from every rank, checked equal) and the backward (token gradients
/// concatenated, dcenter summed, dh0 / da0 from rank 0, checked zero on the others).
template <class R, class T>
std::pair<Arrays, Arrays> run_split(const Case& c, const std::vector<int64_t>& lens, const dgps::Options& opt) {
  using S = dgps::state_t<T>;
  const int Rn = static_cast<int>(lens.size());
  dgps::distributed::ThreadGroup group(Rn);
  std::vector<Arrays> fwd(static_cast<size_t>(Rn)), bwd(static_cast<size_t>(Rn));
  std::vector<std::exception_ptr> err(static_cast<size_t>(Rn));
  std::vector<std::thread> threads;
  int64_t t0 = 0;
  for (int r = 0; r < Rn; ++r) {
    const int64_t a = t0, b = t0 + lens[static_cast<size_t>(r)];
    t0 = b;
    threads.emplace_back([&, r, a, b] {
      try {
        const Case s = segment_of(c, a, b);
        const int64_t B = s.shape.batch, L = s.shape.time, H = s.shape.heads, HV = s.shape.v_heads, K = s.shape.key_dim,
                      V = s.shape.value_dim;
        CaseTensors<T> ct(s);
        std::vector<T> o(std::max<size_t>(static_cast<size_t>(B * L * HV * V), 1), T(NAN));
        std::vector<S> hT(static_cast<size_t>(c.N * HV * K * V), S(NAN));
        const auto adims = precond_state_dims(c.spec, c.N, H, K);
        std::vector<S> aT(static_cast<size_t>(adims.empty() ? 0 : product(adims)), S(NAN));
        auto in = ct.inputs(s);
        auto out = dgps::outputs<T>(o.data()).final_state(hT.data(), aT.empty() ? nullptr : aT.data());
        auto& comm = group.member(r);
        const auto ran = dgps::distributed::forward<R>(comm, in, out, opt);
        CHECK(ran.impl.rfind("distributed/" + std::to_string(Rn) + "/", 0) == 0);
        Arrays f;
        f["o"] = std::vector<double>(o.begin(), o.begin() + B * L * HV * V);
        f["hT"] = std::vector<double>(hT.begin(), hT.end());
        if (!aT.empty()) f["aT"] = std::vector<double>(aT.begin(), aT.end());
        fwd[static_cast<size_t>(r)] = std::move(f);

        GradBuffers<T> gb(s);
        auto gi = dgps::grads_in<T>(ct.p("do"), ct.ps("dhT"), ct.ps("daT"));
        dgps::distributed::backward<R>(comm, in, gi, gb.g, opt);
        Arrays d = gb.arrays();
        if (L == 0)  // an empty segment's token gradients are its one-element dummies
          for (auto& [n, v] : d)
            if (n != "dcenter" && n != "dh0" && n != "da0") v.clear();
        bwd[static_cast<size_t>(r)] = std::move(d);
      } catch (...) {
        err[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);

  // Token tensors: rank segments interleaved back into [B, T, ...].
  const int64_t B = c.shape.batch, Tt = c.shape.time;
  auto join = [&](const std::vector<Arrays>& parts, const std::string& name, const std::string& src) {
    const int64_t per = product(c.shapes.at(src)) / (B * Tt);
    std::vector<double> all;
    for (int64_t b = 0; b < B; ++b)
      for (int r = 0; r < Rn; ++r) {
        const auto& v = parts[static_cast<size_t>(r)].at(name);
        const int64_t L = lens[static_cast<size_t>(r)];
        all.insert(all.end(), v.begin() + b * L * per, v.begin() + (b + 1) * L * per);
      }
    return all;
  };
  Arrays f, g;
  f["o"] = join(fwd, "o", "do");
  for (const char* st : {"hT", "aT"}) {
    if (!fwd[0].count(st)) continue;
    f[st] = fwd[0].at(st);
    for (int r = 1; r < Rn; ++r)
      CHECK(fwd[static_cast<size_t>(r)].at(st) == f[st]);  // every rank: the same final state
  }
  for (const char* name : kPerToken) {
    const std::string dn = std::string("d") + name;
    if (std::string(name) != "do" && bwd[0].count(dn)) g[dn] = join(bwd, dn, name);
  }
  if (bwd[0].count("dcenter")) {
    g["dcenter"] = bwd[0].at("dcenter");
    for (int r = 1; r < Rn; ++r)
      for (size_t i = 0; i < g["dcenter"].size(); ++i) g["dcenter"][i] += bwd[static_cast<size_t>(r)].at("dcenter")[i];
  }
  for (const char* st : {"dh0", "da0"}) {
    if (!bwd[0].count(st)) continue;
    g[st] = bwd[0].at(st);
    for (int r = 1; r < Rn; ++r) CHECK(max_abs(bwd[static_cast<size_t>(r)].at(st)) == 0.0);  // zero off rank 0
  }
  return {f, g};
}

/// Model R split over each rank layout, against the single call: float64 on the reference backend within
/// 1e-10, float32 on the CPU backend within 2e-5 (max |diff| / max |single|, per tensor).
template <class R>
void check_model(const char* label) {
  const dgps::ModelSpec spec = dgps::spec_of<R>();
  const dgps::Shape shape{.batch = 2, .time = 150, .heads = 2, .v_heads = 4, .key_dim = 8, .value_dim = 6};
  const Case c = random_case(spec, shape, {}, 4100 + uint64_t(spec.decay) * 7 + uint64_t(spec.precond) * 3);
  const std::vector<std::vector<int64_t>> layouts{{150}, {64, 86}, {40, 0, 110}, {1, 63, 65, 21}};
  const dgps::Options ref = on(dgps::Backend::reference), cpu = on(dgps::Backend::cpu);
  const Arrays f64 = run_forward<double, R>(c, ref), g64 = run_backward<double, R>(c, ref);
  const Arrays f32 = run_forward<float, R>(c, cpu), g32 = run_backward<float, R>(c, cpu);
  for (const auto& lens : layouts) {
    INFO(label << " split into " << lens.size() << " ranks, first " << lens[0]);
    const auto [fd, gd] = run_split<R, double>(c, lens, ref);
    const auto [ff, gf] = run_split<R, float>(c, lens, cpu);
    for (const auto& [name, v] : f64) {
      const std::string n = name;  // a structured binding cannot be captured by INFO (Clang 14)
      INFO(n);
      CHECK(rel_err(fd.at(n), v) < 1e-10);
      CHECK(rel_err(ff.at(n), f32.at(n)) < 2e-5);
    }
    for (const auto& [name, v] : g64) {
      const std::string n = name;
      INFO("gradient " << n);
      CHECK(rel_err(gd.at(n), v) < 1e-10);
      CHECK(rel_err(gf.at(n), g32.at(n)) < 2e-5);
    }
  }
}

}  // namespace

TEST_CASE("distributed: a split sequence equals the single call, forward and backward, every chunkwise model") {
  check_model<dgps::LinearAttention>("LinearAttention");
  check_model<dgps::Mamba2>("Mamba2");
  check_model<dgps::GLA>("GLA");
  check_model<dgps::DeltaNet>("DeltaNet");
  check_model<dgps::GDN>("GDN");
  check_model<dgps::KDA>("KDA");
  check_model<dgps::PDN>("PDN");
  check_model<dgps::PGDN>("PGDN");
  check_model<dgps::PKDA>("PKDA");
  check_model<dgps::PMamba2>("PMamba2");
}

TEST_CASE("distributed: a bad call on one rank throws the same error on every rank and writes nothing") {
  const dgps::ModelSpec spec = dgps::spec_of<dgps::GDN>();
  const dgps::Shape shape{.batch = 1, .time = 32, .heads = 1, .v_heads = 1, .key_dim = 4, .value_dim = 4};
  const Case c = random_case(spec, shape, {}, 7);
  dgps::distributed::ThreadGroup group(2);
  // Rank 1 omits its decay (its own validation fails), then describes its keys as 5-wide (the ranks disagree).
  for (int bad = 0; bad < 2; ++bad) {
    std::vector<std::string> what(2);
    std::vector<float> o0(64, -7.f), o1(64, -7.f);
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r)
      th.emplace_back([&, r] {
        Case s = segment_of(c, r * 16, r * 16 + 16);
        if (r == 1 && bad == 1) s.shape.key_dim = 5;
        CaseTensors<float> ct(s);
        auto in = ct.inputs(s);
        if (r == 1 && bad == 0) in.g = {};
        try {
          dgps::distributed::forward<dgps::GDN>(group.member(r), in, dgps::outputs<float>(r ? o1.data() : o0.data()),
                                                on(dgps::Backend::cpu));
        } catch (const dgps::Error& e) {
          what[static_cast<size_t>(r)] = e.what();
        }
      });
    for (auto& t : th) t.join();
    INFO(what[0]);
    CHECK(what[0] == what[1]);
    CHECK(what[0].find(bad == 0 ? "distributed::forward: rank 1: "
                                : "rank 1's sizes [B, H, HV, K, V] = [1, 1, 1, 5, 4]") != std::string::npos);
    CHECK(o0 == std::vector<float>(64, -7.f));
    CHECK(o1 == std::vector<float>(64, -7.f));
  }

  // Packed batches and the exact preconditioners are refused (one rank suffices to see the message).
  dgps::distributed::ThreadGroup one(1);
  CaseTensors<float> ct(c);
  std::vector<int64_t> cu{0, 32};
  auto in = ct.inputs(c);
  in.varlen(cu.data(), 1);
  std::vector<float> o(64);
  CHECK_THROWS_WITH_AS(dgps::distributed::forward<dgps::GDN>(one.member(0), in, dgps::outputs<float>(o.data())),
                       doctest::Contains("cu_seqlens"), dgps::Error);
  CHECK_THROWS_AS(dgps::distributed::ThreadGroup(0), dgps::Error);
}
