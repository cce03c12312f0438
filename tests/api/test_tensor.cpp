/// @brief TensorView construction: contiguous views from initializer lists and from run-time sizes.
#include <doctest/doctest.h>

#include <vector>

#include <dgps/tensor.hpp>

TEST_CASE("tensor: view from run-time sizes equals the initializer-list view (C-order strides)") {
  std::vector<float> buf(2 * 3 * 4 * 5);
  const auto a = dgps::view(buf.data(), {2, 3, 4, 5});
  const auto b = dgps::view(buf.data(), std::vector<int64_t>{2, 3, 4, 5});
  CHECK(b.data == buf.data());
  CHECK(b.rank == 4);
  CHECK(b.size == a.size);
  CHECK(b.stride == a.stride);
  CHECK(b.stride[0] == 60);
  CHECK(b.stride[1] == 20);
  CHECK(b.stride[2] == 5);
  CHECK(b.stride[3] == 1);
  CHECK(b.contiguous());
  CHECK(&b(1, 2, 3, 4) == &buf.back());
  const auto c = dgps::view(buf.data(), std::vector<int64_t>{7});
  CHECK(c.rank == 1);
  CHECK(c.numel() == 7);
  CHECK(c.stride[0] == 1);
}
