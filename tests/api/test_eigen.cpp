/// @brief dgps/eigen.hpp: views of Eigen matrices, maps, refs, blocks and tensors, without copies.
#include <doctest/doctest.h>

#if DGPS_TEST_EIGEN

#include <dgps/eigen.hpp>

#include <type_traits>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ColMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

std::vector<float> random_vec(int64_t n, Rng& rng, double lo, double hi) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.uniform(lo, hi));
  return v;
}

}  // namespace

TEST_CASE("eigen: PGDN forward from Eigen views equals the forward from plain arrays, bitwise") {
  const int64_t B = 2, T = 7, H = 2, HV = 4, K = 3, V = 5, N = B;
  const dgps::Shape shape{.batch = B, .time = T, .heads = H, .v_heads = HV, .key_dim = K, .value_dim = V};
  Rng rng(99);
  const auto q = random_vec(B * T * H * K, rng, -1, 1), k = random_vec(B * T * H * K, rng, -1, 1);
  const auto v = random_vec(B * T * HV * V, rng, -1, 1), g = random_vec(B * T * HV, rng, -0.5, 0);
  const auto beta = random_vec(B * T * HV, rng, 0, 1), g_p = random_vec(B * T * H, rng, -0.5, 0);
  const auto beta_p = random_vec(B * T * H, rng, 0, 1), center = random_vec(H, rng, -1, 0);
  const auto h0 = random_vec(N * HV * K * V, rng, -1, 1), a0 = random_vec(N * H * K, rng, 0, 2);

  // q: row-major (B*T*H) x K, rows = vectors.
  RowMat eq(B * T * H, K);
  for (int64_t r = 0; r < B * T * H; ++r)
    for (int64_t c = 0; c < K; ++c) eq(r, c) = q[r * K + c];
  // k: a K x (B*T*H) block of a larger column-major matrix, columns = vectors (outer stride K + 2).
  ColMat big(K + 2, B * T * H + 3);
  big.setConstant(NAN);
  for (int64_t col = 0; col < B * T * H; ++col)
    for (int64_t c = 0; c < K; ++c) big(1 + c, 2 + col) = k[col * K + c];
  // v: row-major 4-D tensor (B, T, HV, V).
  Eigen::Tensor<float, 4, Eigen::RowMajor> ev(B, T, HV, V);
  std::copy(v.begin(), v.end(), ev.data());
  // g: column-major 3-D tensor with reversed dims (HV, T, B).
  Eigen::Tensor<float, 3> eg(HV, T, B);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < HV; ++h) eg(h, t, b) = g[(b * T + t) * HV + h];
  // beta: a read-only Map of a row-major (B*T) x HV matrix over the plain array itself.
  Eigen::Map<const RowMat> ebeta(beta.data(), B * T, HV);
  // g_p: a Ref to a row-major (B*T) x H matrix.
  RowMat gp_store(B * T, H);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < H; ++c) gp_store(r, c) = g_p[r * H + c];
  Eigen::Ref<const RowMat> egp(gp_store);
  // beta_p: a TensorMap over the plain array, dims (B, T, H).
  Eigen::TensorMap<Eigen::Tensor<const float, 3, Eigen::RowMajor>> ebp(beta_p.data(), B, T, H);
  // center: a vector.
  Eigen::VectorXf ecenter = Eigen::Map<const Eigen::VectorXf>(center.data(), H);
  // h0: the left (N*HV*K) x V block of a wider row-major matrix (outer stride V + 3).
  RowMat h0_big(N * HV * K, V + 3);
  h0_big.setConstant(NAN);
  for (int64_t r = 0; r < N * HV * K; ++r)
    for (int64_t c = 0; c < V; ++c) h0_big(r, c) = h0[r * V + c];
  // a0: column-major tensor (K, H, N).
  Eigen::Tensor<float, 3> ea0(K, H, N);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < K; ++c) ea0(c, h, n) = a0[(n * H + h) * K + c];
  // Outputs: o row-major matrix, hT column-major tensor (V, K, HV, N), aT column-major K x (N*H).
  RowMat eo(B * T * HV, V);
  eo.setConstant(NAN);
  Eigen::Tensor<float, 4> ehT(V, K, HV, N);
  ehT.setConstant(NAN);
  ColMat eaT(K, N * H);
  eaT.setConstant(NAN);

  for (dgps::Backend backend : {dgps::Backend::reference, dgps::Backend::cpu}) {
    const dgps::Options opt = on(backend);
    std::vector<float> o(static_cast<size_t>(B * T * HV * V), NAN), hT(static_cast<size_t>(N * HV * K * V), NAN),
        aT(static_cast<size_t>(N * H * K), NAN);
    auto plain = dgps::inputs<float>(shape, q.data(), k.data(), v.data())
                     .decay(g.data())
                     .gain(beta.data())
                     .precond(g_p.data(), beta_p.data(), center.data())
                     .initial_state(h0.data(), a0.data());
    dgps::forward<dgps::PGDN>(plain, dgps::outputs<float>(o.data()).final_state(hT.data(), aT.data()), opt);

    namespace de = dgps::eigen;
    auto viewed = dgps::inputs<float>(shape, de::view(eq, {B, T, H, K}),
                                      de::view(big.block(1, 2, K, B * T * H), {B, T, H, K}), de::view(ev))
                      .decay(de::view(eg))
                      .gain(de::view(ebeta, {B, T, HV}))
                      .precond(de::view(egp, {B, T, H}), de::view(ebp), de::view(ecenter, {H}))
                      .initial_state(de::view(h0_big.leftCols(V), {N, HV, K, V}), de::view(ea0));
    dgps::forward<dgps::PGDN>(
        viewed, dgps::outputs<float>(de::view(eo, {B, T, HV, V})).final_state(de::view(ehT), de::view(eaT, {N, H, K})),
        opt);

    INFO("backend " << dgps::to_string(backend));
    CHECK(std::vector<float>(eo.data(), eo.data() + eo.size()) == o);
    CHECK(std::vector<float>(ehT.data(), ehT.data() + ehT.size()) == hT);
    CHECK(std::vector<float>(eaT.data(), eaT.data() + eaT.size()) == aT);
  }
}

TEST_CASE("eigen: strides, constness and element addresses") {
  RowMat big(12, 9);
  auto blk = big.block(2, 1, 6, 4);  // 6 rows of length 4, outer stride 9
  const auto t = dgps::eigen::view(blk, {2, 3, 4});
  static_assert(std::is_same_v<decltype(t), const dgps::TensorView<float>>);
  CHECK(t.rank == 3);
  CHECK(t.stride[2] == 1);
  CHECK(t.stride[1] == 9);
  CHECK(t.stride[0] == 27);
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 4; ++c) CHECK(&t(a, b, c) == &big(2 + a * 3 + b, 1 + c));

  ColMat cm(5, 8);
  auto cblk = cm.middleCols(2, 6);  // columns = vectors of length 5
  const auto ct = dgps::eigen::view(cblk, {3, 2, 5});
  for (int64_t a = 0; a < 3; ++a)
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t c = 0; c < 5; ++c) CHECK(&ct(a, b, c) == &cm(c, 2 + a * 2 + b));

  const RowMat& cref = big;
  static_assert(std::is_same_v<decltype(dgps::eigen::view(cref, {12, 9})), dgps::TensorView<const float>>);
  const std::vector<double> buf(24, 1.0);
  Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> cmap(buf.data(), 6, 4);
  static_assert(std::is_same_v<decltype(dgps::eigen::view(cmap, {6, 4})), dgps::TensorView<const double>>);

  // A column-major tensor (K, H, T, B) is [B, T, H, K] in C order; a reshape keeps the inner dim.
  Eigen::Tensor<float, 4> ten(3, 2, 5, 4);
  const auto tv4 = dgps::eigen::view(ten);
  CHECK(tv4.size == std::array<int64_t, 4>{4, 5, 2, 3});
  CHECK(&tv4(1, 2, 1, 2) == &ten(2, 1, 2, 1));
  Eigen::Tensor<float, 2, Eigen::RowMajor> flat(40, 3);
  const auto r4 = dgps::eigen::view(flat, {4, 5, 2, 3});
  CHECK(&r4(3, 4, 1, 2) == &flat(39, 2));
}

TEST_CASE("eigen: inner stride != 1 and size mismatches throw dgps::Error") {
  ColMat cm(4, 6);
  // A row of a column-major matrix: elements 4 apart.
  CHECK_THROWS_WITH_AS(dgps::eigen::view(cm.row(1), {6}), doctest::Contains("inner stride 4"), dgps::Error);
  Eigen::Map<RowMat, 0, Eigen::Stride<Eigen::Dynamic, 2>> strided(cm.data(), 3, 4,
                                                                  Eigen::Stride<Eigen::Dynamic, 2>(8, 2));
  CHECK_THROWS_WITH_AS(dgps::eigen::view(strided, {3, 4}), doctest::Contains("inner stride 2"), dgps::Error);
  RowMat rm(6, 3);
  CHECK_THROWS_WITH_AS(dgps::eigen::view(rm, {2, 2, 2, 3}), doctest::Contains("needs 8 vectors of length 3"),
                       dgps::Error);
  CHECK_THROWS_WITH_AS(dgps::eigen::view(rm, {6, 4}), doctest::Contains("holds 6 vectors of length 3"), dgps::Error);
  // (B*T*H) x K stored column-major: its vectors are columns, so [.., K] does not fit.
  ColMat wrong(20, 3);
  CHECK_THROWS_WITH_AS(dgps::eigen::view(wrong, {2, 5, 2, 3}), doctest::Contains("column-major"), dgps::Error);
  CHECK_THROWS_AS(dgps::eigen::view(rm, {1, 1, 1, 6, 3}), dgps::Error);
  Eigen::Tensor<float, 3, Eigen::RowMajor> ten(2, 3, 4);
  CHECK_THROWS_WITH_AS(dgps::eigen::view(ten, {6, 5}), doctest::Contains("element count"), dgps::Error);
  CHECK_THROWS_AS(dgps::eigen::view(ten, {2, 4, 3}), dgps::Error);
  CHECK_NOTHROW(dgps::eigen::view(ten, {6, 4}));
}

#else

TEST_CASE("eigen: skipped, Eigen 3.4 was not found at configure time") { MESSAGE("Eigen tests skipped"); }

#endif
