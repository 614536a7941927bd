// The projections' GEMM (module/linear.hpp): single-threaded sgemm calls over blocks that depend
// on the shape alone. Against float64 products for every transpose, for shapes that split rows,
// columns (fewer than 8 blocks of 256 rows), both or neither, and one to four rows (one sgemv per
// row); and the same bits on every thread count. Fresh seed each run (printed; MHA_TEST_SEED replays).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "module/linear.hpp"
#include "test_support.hpp"

namespace {

struct Shape {
  int64_t m, n, k;
};

TEST(Gemm, BlocksAgainstFloat64OnEveryThreadCount) {
  std::mt19937_64 rng(mha_test::test_seed());
  std::normal_distribution<float> normal;
  // 300 x 700: 2 row blocks, columns in 4 parts; 100 x 1000: 1 row block, 4 parts; 2100 x 40: 9
  // row blocks, no column split; 3 x 900: one sgemv per row; 257 x 1: a single column.
  const Shape shapes[] = {{300, 700, 37}, {100, 1000, 64}, {2100, 40, 19}, {3, 900, 50}, {257, 1, 5}};
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 4; ++variant) {
      const bool ta = variant & 1, tb = variant & 2;
      // Leading dimensions past the row lengths, as a view of wider rows gives them.
      const int64_t lda = (ta ? s.m : s.k) + 3, ldb = (tb ? s.k : s.n) + 5, ldc = s.n + 2;
      std::vector<float> a((ta ? s.k : s.m) * lda), b((tb ? s.n : s.k) * ldb), c0(s.m * ldc);
      for (float& x : a) x = normal(rng);
      for (float& x : b) x = normal(rng);
      for (float& x : c0) x = normal(rng);
      const float beta = variant == 3 ? 0.0f : 1.0f;
      SCOPED_TRACE("m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
                   " transpose_a=" + std::to_string(ta) + " transpose_b=" + std::to_string(tb));
      std::vector<float> first;
      for (int threads : {1, 2, 3, 8}) {
        std::vector<float> c = c0;
        mha::detail::gemm(ta, tb, s.m, s.n, s.k, a.data(), lda, b.data(), ldb, beta, c.data(), ldc, threads);
        if (threads == 1) {
          first = c;
          double worst = 0;
          for (int64_t i = 0; i < s.m; ++i) {
            for (int64_t j = 0; j < s.n; ++j) {
              double sum = beta * static_cast<double>(c0[i * ldc + j]), magnitude = std::abs(sum);
              for (int64_t l = 0; l < s.k; ++l) {
                const double p = static_cast<double>(ta ? a[l * lda + i] : a[i * lda + l]) *
                                 static_cast<double>(tb ? b[j * ldb + l] : b[l * ldb + j]);
                sum += p;
                magnitude += std::abs(p);
              }
              // float32 sums of k + 1 terms are within (k + 1) * 2^-24 of the sum of their magnitudes.
              worst = std::max(worst, std::abs(c[i * ldc + j] - sum) / ((s.k + 1) * 0x1p-24 * magnitude));
            }
          }
          EXPECT_LE(worst, 1.0);
          // Padding between rows of C is never written.
          for (int64_t i = 0; i < s.m; ++i)
            for (int64_t j = s.n; j < ldc; ++j) EXPECT_EQ(c[i * ldc + j], c0[i * ldc + j]);
          continue;
        }
        EXPECT_TRUE(c == first) << threads << " threads";
      }
    }
  }
}

}  // namespace
