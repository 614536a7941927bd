// The exponential of every softmax (S::exp2 of each SIMD layer) against double precision, on
// every ISA this CPU runs: its maximum relative error, and the edge cases the kernels rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "cpu/vector_exp2.hpp"
#include "test_support.hpp"

namespace {

std::vector<float> exp2_on(mha::detail::Isa isa, const std::vector<float>& x) {
  std::vector<float> y(x.size());
  mha::detail::vector_exp2(isa, x.data(), y.data(), static_cast<int64_t>(x.size()));
  return y;
}

// The largest |y - 2^x| / 2^x over the inputs, and where.
struct WorstError {
  double relative = 0;
  float at = 0;
};
WorstError worst_error(const std::vector<float>& x, const std::vector<float>& y) {
  WorstError w;
  for (size_t i = 0; i < x.size(); ++i) {
    const double exact = std::exp2(static_cast<double>(x[i]));
    const double e = std::fabs(static_cast<double>(y[i]) - exact) / exact;
    if (!(e <= w.relative)) w = {e, x[i]};  // a NaN error compares false: it is taken...
    if (std::isnan(w.relative)) break;      // ...and kept, the worst there is
  }
  return w;
}

TEST(VectorExp2, MaximumRelativeErrorOnEveryIsa) {
  // Every float in [-1, 1] at a 2^-17 step (the reduced argument's whole range, several times
  // over), a dense sweep of [-100, 127.5) and random points there: results are normal floats.
  // (The AVX2 layer builds 2^round(x) from exponent bits, so from 127.5 up it gives +inf, a factor
  // of at most 1.42 early; softmax arguments are never above 0.) 2^-23 is one unit in the last
  // place at the bottom of a binade.
  std::mt19937_64 rng(mha_test::test_seed());
  std::vector<float> x;
  for (int i = -(1 << 17); i <= (1 << 17); ++i) x.push_back(static_cast<float>(i) / (1 << 17));
  for (double v = -100.0; v < 127.5; v += 1.0 / 1024) x.push_back(static_cast<float>(v));
  std::uniform_real_distribution<float> anywhere(-100.0f, 127.49f);
  for (int i = 0; i < 100000; ++i) x.push_back(anywhere(rng));
  x.push_back(0.0f);
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    const WorstError w = worst_error(x, exp2_on(isa, x));
    std::printf("exp2 on %s: maximum relative error %.3g (at x = %.9g) over %zu inputs\n",
                std::string(mha::detail::isa_name(isa)).c_str(), w.relative, w.at, x.size());
    EXPECT_LT(w.relative, 0x1p-23) << mha::detail::isa_name(isa) << " at x = " << w.at;
  }
}

TEST(VectorExp2, EdgeCasesTheKernelsRelyOn) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // A masked score (-inf) and anything below 2^-100 give exactly 0 (no subnormal reaches the
  // products); integers give exact powers of two; a NaN score stays NaN; overflow is +inf.
  const std::vector<float> x = {-inf, -1e30f, -150.0f, -100.5f, -100.0f, -5.0f, 0.0f, 1.0f, 7.0f, 127.0f, 128.0f,
                                1000.0f, nan};
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)));
    // Every length up to two vectors, so that the partial last vector is covered too.
    for (size_t n = 1; n <= x.size(); ++n) {
      const std::vector<float> head(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
      const std::vector<float> y = exp2_on(isa, head);
      for (size_t i = 0; i < n; ++i) {
        const float xi = head[i];
        if (std::isnan(xi)) {
          EXPECT_TRUE(std::isnan(y[i]));
        } else if (xi < -100.0f) {
          EXPECT_EQ(y[i], 0.0f) << "x = " << xi;
          EXPECT_FALSE(std::signbit(y[i]));
        } else if (xi >= 128.0f) {
          EXPECT_EQ(y[i], inf) << "x = " << xi;
        } else {
          EXPECT_EQ(y[i], std::ldexp(1.0f, static_cast<int>(xi))) << "x = " << xi;
        }
      }
    }
  }
}

}  // namespace
