// The exponential of every softmax (S::exp2 of each SIMD layer) against double precision, on
// every ISA this CPU runs: its maximum relative error, and the edge cases the kernels rely on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/amx.hpp"
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

// The soft-capping tanh (cpu/softcap.hpp) and its derivative against double precision: every
// float in [-1, 1] at a 2^-16 step (both branches and the switch at 0.4), a sweep of [-12, 12]
// where both saturate, and random points. tanh's error is relative (its worst just above the
// switch at 0.4, where 1 - e loses a bit); the slope's too, down to where exp2 flushes e to 0
// (|x| > 34.7, a slope under 3.2e-30, given as 0), measured per (1 + |x|) as e's rounded
// argument makes it grow with |x|.
TEST(VectorTanh, MaximumErrorOnEveryIsa) {
  std::mt19937_64 rng(mha_test::test_seed());
  std::vector<float> x;
  for (int i = -(1 << 16); i <= (1 << 16); ++i) x.push_back(static_cast<float>(i) / (1 << 16));
  for (double v = -12.0; v <= 12.0; v += 1.0 / 4096) x.push_back(static_cast<float>(v));
  std::uniform_real_distribution<float> anywhere(-40.0f, 40.0f);
  for (int i = 0; i < 100000; ++i) x.push_back(anywhere(rng));
  for (float tiny : {1e-30f, -1e-20f, 1e-8f, 0.39999998f, 0.4f, -0.4f}) x.push_back(tiny);
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    std::vector<float> y(x.size()), slope(x.size());
    mha::detail::vector_tanh(isa, x.data(), y.data(), slope.data(), static_cast<int64_t>(x.size()));
    double worst = 0, worst_slope = 0;
    float at = 0, at_slope = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double t = std::tanh(static_cast<double>(x[i])), c = std::cosh(static_cast<double>(x[i]));
      const double d = 1 / (c * c);  // 1 - t^2 without its cancellation
      const double e = t == 0 ? std::fabs(y[i]) : std::fabs(y[i] - t) / std::fabs(t);
      if (!(e <= worst)) worst = e, at = x[i];
      if (d > 1e-29) {
        // e's argument, -2 log2(e) x, is rounded to float: a relative error growing with |x|.
        const double es = std::fabs(slope[i] - d) / d / (1 + std::fabs(static_cast<double>(x[i])));
        if (!(es <= worst_slope)) worst_slope = es, at_slope = x[i];
      }
    }
    std::printf("tanh on %s: maximum relative error %.3g (at x = %.9g), slope %.3g x (1 + |x|) (at x = %.9g)\n",
                std::string(mha::detail::isa_name(isa)).c_str(), worst, at, worst_slope, at_slope);
    EXPECT_LT(worst, 4 * 0x1p-24) << mha::detail::isa_name(isa) << " at x = " << at;
    EXPECT_LT(worst_slope, 2e-7) << mha::detail::isa_name(isa) << " at x = " << at_slope;
  }
}

// The cap as the kernels take it (Softcap::rows, a column of a tile at a time): c tanh(x / c)
// and its derivative against double precision, for caps from one too small for the folded
// coefficients (1e-4) to 1e6, on columns whose scores lie within 0.1 of the cap (the polynomial
// to u^3), within 0.4 (to u^5), across the bend (both forms of tanh per lane), and near ones with
// a single bent score, high or low (the column must take the whole map). The polynomials' error
// is their float rounding, ~1e-7 relative; the bend adds the rounding of x / c to tanh's own
// 2.1e-7, and the slope's error grows with |x| / c as tanh's does above.
TEST(SoftcapMap, MaximumErrorOfEveryRangeOnEveryIsa) {
  std::mt19937_64 rng(mha_test::test_seed());
  constexpr int64_t kColumn = 64 * 16;  // a tile's 64 key rows of 16 queries
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    double worst = 0, worst_slope = 0;
    std::string at;
    for (double c : {1e-4, 0.7, 5.0, 72.1, 1e6}) {
      for (double spread : {0.099, 0.399, 3.0, -1.0, -2.0}) {  // negative: near scores, one bent lane (+, -)
        std::uniform_real_distribution<double> pick(-std::abs(spread) * c, std::abs(spread) * c);
        std::vector<float> x(kColumn), y(kColumn), slope(kColumn);
        for (float& v : x) v = static_cast<float>(spread < 0 ? 0.09 * pick(rng) : pick(rng));
        if (spread < 0) x[kColumn / 2 + 3] = static_cast<float>((spread == -1.0 ? 2.5 : -2.5) * c);
        mha::detail::vector_softcap(isa, c, x.data(), y.data(), slope.data(), kColumn);
        for (int64_t i = 0; i < kColumn; ++i) {
          const double r = static_cast<double>(x[i]) / c, t = std::tanh(r), ch = std::cosh(r);
          const double expected = c * t, expected_slope = 1 / (ch * ch);
          const double e = expected == 0 ? std::fabs(y[i]) : std::fabs(y[i] - expected) / std::fabs(expected);
          const double es = std::fabs(slope[i] - expected_slope) / expected_slope / (1 + std::fabs(r));
          if (!(e <= worst) || !(es <= worst_slope)) {
            at = "cap " + std::to_string(c) + " spread " + std::to_string(spread) + " x " + std::to_string(x[i]);
          }
          if (!(e <= worst)) worst = e;
          if (!(es <= worst_slope)) worst_slope = es;
        }
      }
    }
    std::printf("soft-cap on %s: maximum relative error %.3g, slope %.3g x (1 + |x| / c) (last worst: %s)\n",
                std::string(mha::detail::isa_name(isa)).c_str(), worst, worst_slope, at.c_str());
    EXPECT_LT(worst, 6 * 0x1p-24) << mha::detail::isa_name(isa) << " " << at;
    EXPECT_LT(worst_slope, 4e-7) << mha::detail::isa_name(isa) << " " << at;
  }
}

TEST(VectorTanh, EdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {-inf, -1e30f, -50.0f, 0.0f, -0.0f, 50.0f, 1e30f, inf, nan};
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)));
    std::vector<float> y(x.size()), slope(x.size());
    mha::detail::vector_tanh(isa, x.data(), y.data(), slope.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i + 1 < x.size(); ++i) {
      // Saturated: exactly +-1 with a zero slope (an infinite score is capped, not NaN); 0 stays 0.
      const float expected = x[i] == 0 ? 0.0f : std::copysign(1.0f, x[i]);
      EXPECT_EQ(y[i], expected) << "x = " << x[i];
      EXPECT_EQ(slope[i], x[i] == 0 ? 1.0f : 0.0f) << "x = " << x[i];
    }
    EXPECT_TRUE(std::isnan(y.back()));
  }
}

// The bfloat16 kernels' exponential (AMX and AVX512-BF16 pairs: their probabilities are rounded to
// bfloat16, 2^-9 relative, before they are multiplied): the degree-3 minimax polynomial, 7.48e-5 in exact arithmetic,
// plus float rounding; arguments from -100 to the 8 its lazy rescaling allows, and what it must
// give for -inf (a masked score), below -100 and NaN.
TEST(Bf16Exp2, MaximumRelativeErrorAndEdgeCases) {
  const auto isas = mha::detail::supported_isas();
  if (std::find(isas.begin(), isas.end(), mha::detail::Isa::avx512_bf16) == isas.end()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937_64 rng(mha_test::test_seed());
  std::vector<float> x;
  for (int i = -(1 << 17); i <= (1 << 17); ++i) x.push_back(static_cast<float>(i) / (1 << 17));
  for (double v = -100.0; v <= 8.0; v += 1.0 / 4096) x.push_back(static_cast<float>(v));
  std::uniform_real_distribution<float> anywhere(-100.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) x.push_back(anywhere(rng));
  std::vector<float> y(x.size());
  mha::detail::exp2_bf16_of(x.data(), y.data(), static_cast<int64_t>(x.size()));
  const WorstError w = worst_error(x, y);
  std::printf("exp2_bf16: maximum relative error %.3g (at x = %.9g) over %zu inputs\n", w.relative, w.at, x.size());
  EXPECT_LT(w.relative, 7.6e-5) << "at x = " << w.at;
  EXPECT_GT(w.relative, 7.0e-5);  // it is the degree-3 polynomial, not a more accurate one
  const float edge[] = {-std::numeric_limits<float>::infinity(), -100.5f, -1e30f, std::numeric_limits<float>::quiet_NaN(), 0.0f};
  float out[5];
  mha::detail::exp2_bf16_of(edge, out, 5);  // (5 lanes: the masked tail of a vector too)
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_NEAR(out[4], 1.0f, 7.6e-5);
}

}  // namespace
