// The float64 softmax's exponential (vector_exp_f64) on every ISA this CPU runs: its error in
// units in the last place against long double, and the edge cases the float64 kernel relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "cpu/vector_exp_f64.hpp"
#include "test_support.hpp"

namespace {

std::vector<double> exp_on(mha::detail::Isa isa, std::vector<double> x) {
  mha::detail::vector_exp_f64(isa, x.data(), static_cast<int64_t>(x.size()));
  return x;
}

// |y - e^x| in units in the last place of e^x (long double's e^x, 11 more bits than double).
double ulps(double x, double y) {
  const long double exact = std::exp(static_cast<long double>(x));
  const double rounded = static_cast<double>(exact);
  const double ulp = std::nextafter(rounded, std::numeric_limits<double>::infinity()) - rounded;
  return static_cast<double>(std::fabs(static_cast<long double>(y) - exact) / ulp);
}

TEST(VectorExpF64, ErrorInUnitsInTheLastPlaceOnEveryIsa) {
  // The reduced argument's range densely, softmax arguments (x - max <= 0) down to -708, and
  // random points over the whole normal range.
  std::mt19937_64 rng(mha_test::test_seed());
  std::vector<double> x;
  for (int i = -(1 << 16); i <= (1 << 16); ++i) x.push_back(0.35 * i / (1 << 16));
  std::uniform_real_distribution<double> softmax(-708.0, 0.0), anywhere(-708.0, 709.78);
  for (int i = 0; i < 200000; ++i) x.push_back(softmax(rng));
  for (int i = 0; i < 100000; ++i) x.push_back(anywhere(rng));
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    const std::vector<double> y = exp_on(isa, x);
    double worst = 0, at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = ulps(x[i], y[i]);
      if (!(e <= worst)) worst = e, at = x[i];  // a NaN compares false and is kept
    }
    std::printf("exp (float64) on %s: at most %.3f ulp (at x = %.17g) over %zu inputs\n",
                std::string(mha::detail::isa_name(isa)).c_str(), worst, at, x.size());
    EXPECT_LT(worst, 2.0) << mha::detail::isa_name(isa) << " at x = " << at;
  }
}

TEST(VectorExpF64, EdgeCasesTheKernelRelies) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  // -inf (a masked score) and anything below -708 give +0; 0 gives exactly 1 (a row's largest
  // term); overflow gives +inf; NaN stays NaN.
  const std::vector<double> x = {-inf, -1e300, -745.2, -708.5, -708.0, -1.0, 0.0, 1.0, 709.7, 709.8, 1e300, nan};
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)));
    for (size_t n = 1; n <= x.size(); ++n) {  // every length: the vector loop's tail too
      const std::vector<double> head(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
      const std::vector<double> y = exp_on(isa, head);
      for (size_t i = 0; i < n; ++i) {
        const double xi = head[i];
        if (std::isnan(xi)) {
          EXPECT_TRUE(std::isnan(y[i]));
        } else if (xi < -708.0) {
          EXPECT_EQ(y[i], 0.0) << "x = " << xi;
          EXPECT_FALSE(std::signbit(y[i]));
        } else if (xi > 709.79) {
          EXPECT_EQ(y[i], inf) << "x = " << xi;
        } else if (xi == 0.0) {
          EXPECT_EQ(y[i], 1.0);
        } else {
          EXPECT_LT(ulps(xi, y[i]), 2.0) << "x = " << xi;
        }
      }
    }
  }
}

}  // namespace
