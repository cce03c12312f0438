/// @brief SPEC §3.5 varlen == separate calls and §3.6 GVA == repetition, forward and gradients.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

const char* const kPerToken[] = {"q", "k", "v", "g", "beta", "g_p", "beta_p", "do"};
const char* const kPerSeq[] = {"h0", "a0", "dhT", "daT"};

/// Sequence n of the packed case `c` as a case of its own (B = 1, T = its length). A zero-length
/// sequence keeps a one-element dummy buffer per token input so that no pointer is null.
Case sequence_of(const Case& c, int64_t n) {
  Case s = c;
  s.cu.clear();
  s.N = 1;
  const int64_t t0 = c.cu[n], L = c.cu[n + 1] - c.cu[n];
  s.shape.time = L;
  for (const char* name : kPerToken) {
    if (!c.has(name)) continue;
    auto dims = c.shapes.at(name);
    const int64_t per = product(dims) / dims[1];
    const auto& src = c.arr.at(name);
    s.arr[name] = L == 0 ? std::vector<double>(1, 0.0)
                         : std::vector<double>(src.begin() + t0 * per, src.begin() + (t0 + L) * per);
    dims[1] = L;
    s.shapes[name] = dims;
  }
  for (const char* name : kPerSeq) {
    if (!c.has(name)) continue;
    auto dims = c.shapes.at(name);
    const int64_t per = product(dims) / dims[0];
    const auto& src = c.arr.at(name);
    s.arr[name] = std::vector<double>(src.begin() + n * per, src.begin() + (n + 1) * per);
    dims[0] = 1;
    s.shapes[name] = dims;
  }
  return s;
}

/// Elements [a, b) of v.
std::vector<double> part(const std::vector<double>& v, int64_t a, int64_t b) {
  return std::vector<double>(v.begin() + a, v.begin() + b);
}

void check_varlen(const char* label, const dgps::ModelSpec& spec, uint64_t seed) {
  // Lengths {0, 1, 63, 64, 65, 130}: empty, single-token, around and across the chunk size 64.
  const std::vector<int64_t> cu{0, 0, 1, 64, 128, 193, 323};
  const int64_t H = 2, HV = 4, K = 8, V = 4;
  const dgps::Shape shape{.batch = 1, .time = cu.back(), .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  const Case c = random_case(spec, shape, cu, seed);
  const dgps::Options ref = on(dgps::Backend::reference), cpu = on(dgps::Backend::cpu);
  const Arrays f = run_forward<double>(c, ref), g = run_backward<double>(c, ref);
  const Arrays fc = run_forward<float>(c, cpu);
  std::vector<double> dcenter_sum(static_cast<size_t>(H), 0.0);
  for (int64_t n = 0; n + 1 < static_cast<int64_t>(cu.size()); ++n) {
    const Case s = sequence_of(c, n);
    const Arrays fs = run_forward<double>(s, ref), gs = run_backward<double>(s, ref);
    const Arrays fsc = run_forward<float>(s, cpu);
    const int64_t t0 = cu[n], t1 = cu[n + 1];
    INFO(label << " sequence " << n << " (length " << t1 - t0 << ")");
    // Reference: bitwise.
    CHECK(part(f.at("o"), t0 * HV * V, t1 * HV * V) == fs.at("o"));
    CHECK(part(f.at("hT"), n * HV * K * V, (n + 1) * HV * K * V) == fs.at("hT"));
    if (f.count("aT")) {
      const int64_t per = static_cast<int64_t>(fs.at("aT").size());
      CHECK(part(f.at("aT"), n * per, (n + 1) * per) == fs.at("aT"));
    }
    // CPU float32: within 1e-6 of the separate CPU call (max|diff| / max|separate|).
    if (t1 > t0) CHECK(rel_err(part(fc.at("o"), t0 * HV * V, t1 * HV * V), fsc.at("o")) < 1e-6);
    CHECK(rel_err(part(fc.at("hT"), n * HV * K * V, (n + 1) * HV * K * V), fsc.at("hT")) < 1e-6);
    // Gradients, reference: bitwise per token and per sequence state; dcenter is summed.
    for (const char* name : kPerToken) {
      const std::string dn = std::string("d") + name;
      if (!g.count(dn) || t1 == t0) continue;
      const int64_t per = static_cast<int64_t>(gs.at(dn).size()) / (t1 - t0);
      INFO(dn);
      CHECK(part(g.at(dn), t0 * per, t1 * per) == gs.at(dn));
    }
    for (const char* dn : {"dh0", "da0"}) {
      if (!g.count(dn)) continue;
      const int64_t per = static_cast<int64_t>(gs.at(dn).size());
      INFO(dn);
      CHECK(part(g.at(dn), n * per, (n + 1) * per) == gs.at(dn));
    }
    if (g.count("dcenter"))
      for (int64_t h = 0; h < H; ++h) dcenter_sum[h] += gs.at("dcenter")[h];
  }
  if (g.count("dcenter")) {
    INFO(label << " dcenter err " << rel_err(g.at("dcenter"), dcenter_sum));
    CHECK(rel_err(g.at("dcenter"), dcenter_sum) < 1e-13);
  }
}

/// The GVA case `c` (HV = r H) with q, k, g_p, beta_p, center and a0 repeated r times along heads
/// (H' = HV). daT is put on the first copy of each group (the others get 0), so the loss is equal.
Case repeated(const Case& c) {
  Case rc = c;
  const int64_t H = c.shape.heads, HV = c.shape.v_heads, r = HV / H, K = c.shape.key_dim;
  rc.shape.heads = HV;
  auto rep = [&](const char* name, int64_t per, bool first_only, size_t head_dim) {
    if (!c.has(name)) return;
    const auto& src = c.arr.at(name);
    const int64_t outer = static_cast<int64_t>(src.size()) / (H * per);
    std::vector<double> out(static_cast<size_t>(outer * HV * per), 0.0);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t hv = 0; hv < HV; ++hv)
        if (!first_only || hv % r == 0)
          for (int64_t i = 0; i < per; ++i) out[(o * HV + hv) * per + i] = src[(o * H + hv / r) * per + i];
    rc.arr[name] = out;
    auto dims = c.shapes.at(name);
    dims[head_dim] = HV;
    rc.shapes[name] = dims;
  };
  const int64_t ps = is_exact(c.spec) ? K * K : K;
  rep("q", K, false, 2);
  rep("k", K, false, 2);
  rep("g_p", 1, false, 2);
  rep("beta_p", 1, false, 2);
  rep("center", 1, false, 0);
  rep("a0", ps, false, 1);
  rep("daT", ps, true, 1);
  return rc;
}

/// Sums groups of r consecutive heads: [outer, HV, per] -> [outer, H, per].
std::vector<double> group_sum(const std::vector<double>& x, int64_t H, int64_t r, int64_t per) {
  const int64_t outer = static_cast<int64_t>(x.size()) / (H * r * per);
  std::vector<double> out(static_cast<size_t>(outer * H * per), 0.0);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t hv = 0; hv < H * r; ++hv)
      for (int64_t i = 0; i < per; ++i) out[(o * H + hv / r) * per + i] += x[(o * H * r + hv) * per + i];
  return out;
}

void check_gva(const char* label, const dgps::ModelSpec& spec, uint64_t seed) {
  const int64_t H = 2, r = 3, HV = H * r, K = 5, V = 4;
  const dgps::Shape shape{.batch = 2, .time = 20, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  const Case c = random_case(spec, shape, {}, seed);
  const Case rc = repeated(c);
  const dgps::Options ref = on(dgps::Backend::reference);
  const Arrays f = run_forward<double>(c, ref), fr = run_forward<double>(rc, ref);
  INFO(label << ": o err " << rel_err(f.at("o"), fr.at("o")));
  // Forward, reference: the same arithmetic per value head, so bitwise.
  CHECK(f.at("o") == fr.at("o"));
  CHECK(f.at("hT") == fr.at("hT"));
  if (f.count("aT")) {
    const int64_t ps = is_exact(spec) ? K * K : K;
    for (int64_t j = 0; j < r; ++j) {  // every copy of the group holds the key head's state
      std::vector<double> copy;
      for (int64_t n = 0; n < 2; ++n)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < ps; ++i) copy.push_back(fr.at("aT")[((n * HV) + h * r + j) * ps + i]);
      CHECK(copy == f.at("aT"));
    }
  }
  // Gradients: value-head tensors equal; key-head tensors are the sums over each group
  // (tolerance 1e-12 relative, summation order differs).
  const Arrays g = run_backward<double>(c, ref), gr = run_backward<double>(rc, ref);
  for (const char* dn : {"dv", "dg", "dbeta", "dh0"}) {
    if (!g.count(dn)) continue;
    INFO(dn << " err " << rel_err(g.at(dn), gr.at(dn)));
    CHECK(rel_err(g.at(dn), gr.at(dn)) < 1e-12);
  }
  const int64_t ps = is_exact(spec) ? K * K : K;
  const std::pair<const char*, int64_t> keyed[] = {{"dq", K},      {"dk", K},      {"dg_p", 1},
                                                   {"dbeta_p", 1}, {"dcenter", 1}, {"da0", ps}};
  for (const auto& kv : keyed) {
    const auto& dn = kv.first;  // (not a structured binding: INFO captures it, Clang 14 cannot)
    const auto& per = kv.second;
    if (!g.count(dn)) continue;
    const auto summed = group_sum(gr.at(dn), H, r, per);
    INFO(dn << " err " << rel_err(g.at(dn), summed));
    CHECK(max_abs(summed) > 0);
    CHECK(rel_err(g.at(dn), summed) < 1e-12);
  }
}

}  // namespace

TEST_CASE("varlen == separate calls (lengths 0, 1, 63, 64, 65, 130), forward and gradients") {
  check_varlen("pgdn", dgps::spec_of<dgps::PGDN>(), 601);
  check_varlen("kda", dgps::spec_of<dgps::KDA>(), 602);
  check_varlen("mesa", dgps::spec_of<dgps::MesaLayer>(), 603);
  check_varlen("pmamba2", dgps::spec_of<dgps::PMamba2>(), 604);
}

TEST_CASE("GVA (HV = 3 H) == repeating q, k, g_p, beta_p, center, a0 along heads, forward and gradients") {
  check_gva("gdn", dgps::spec_of<dgps::GDN>(), 701);
  check_gva("pgdn", dgps::spec_of<dgps::PGDN>(), 702);
  check_gva("pkda", dgps::spec_of<dgps::PKDA>(), 703);
  check_gva("pmamba2", dgps::spec_of<dgps::PMamba2>(), 704);
  check_gva("mesa", dgps::spec_of<dgps::MesaLayer>(), 705);
  check_gva("ridge", dgps::spec_of<dgps::RidgeReadout>(), 706);
}
