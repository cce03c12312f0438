/// @brief Options::check_finite: non-finite inputs rejected at validation, naming the tensor and the first bad index.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support.hpp"

using namespace dgps_test;

TEST_CASE("check_finite: NaN / Inf in any input throws dgps::Error naming the tensor and index; off by default") {
  const dgps::ModelSpec spec = dgps::model_by_name("pgdn");
  const Case clean =
      random_case(spec, {.batch = 1, .time = 10, .heads = 2, .v_heads = 2, .key_dim = 8, .value_dim = 8}, {}, 5);
  for (const char* name : {"q", "k", "v", "g", "beta", "g_p", "beta_p", "center", "h0", "a0"}) {
    Case c = clean;
    c.arr[name][c.arr[name].size() - 1] = std::string(name) == "k" ? INFINITY : NAN;
    dgps::Options o = on(dgps::Backend::cpu);
    CHECK_NOTHROW(run_forward<float>(c, o));  // off: no check
    o.check_finite = true;
    INFO("tensor " << std::string(name));
    try {
      run_forward<float>(c, o);
      FAIL("no error");
    } catch (const dgps::Error& e) {
      const std::string msg = e.what();
      CHECK(msg.find("'" + std::string(name) + "'") != std::string::npos);
      CHECK(msg.find("non-finite") != std::string::npos);
    }
    o.backend = dgps::Backend::reference;
    CHECK_THROWS_AS(run_backward<float>(c, o), dgps::Error);
  }
  Case c = clean;
  c.arr["do"][0] = NAN;
  dgps::Options o = on(dgps::Backend::cpu);
  o.check_finite = true;
  CHECK_NOTHROW(run_forward<float>(c, o));
  CHECK_THROWS_WITH_AS(run_backward<float>(c, o), doctest::Contains("'do'"), dgps::Error);
}
