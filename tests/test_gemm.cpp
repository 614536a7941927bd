// The projections' GEMM (module/linear.hpp): single-threaded calls over blocks that depend on the
// shape alone, of oneDNN's float32 matmul where the CPU has AVX-512, else of sgemm. Both against
// float64 products for every transpose, for shapes that split rows, columns (fewer than 8 blocks
// of 256 rows), both or neither, and one to four rows (one sgemv per row); and the same bits on
// every thread count. The float32 Linear (y = x W^T + b) through
// oneDNN's matmul on weights packed by our own code, and through sgemm. Fresh seed each run
// (printed; MHA_TEST_SEED replays).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "module/linear.hpp"
#include "module/onednn_matmul.hpp"
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
  for (const bool onednn : {true, false}) {
    if (onednn && !mha::detail::f32_matmul_available()) continue;
    mha::detail::disable_f32_matmul(!onednn);
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
                     " transpose_a=" + std::to_string(ta) + " transpose_b=" + std::to_string(tb) +
                     " onednn=" + std::to_string(onednn));
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
  mha::detail::disable_f32_matmul(false);
}

// y = x W^T + b over [N, L, in] views: oneDNN's float32 matmul where the CPU has AVX-512 and x has
// at least 512 rows (blocks of 256 rows; a weight alone in its call cut into two column parts
// from 512 columns where it has fewer than 4 row blocks, whole otherwise; more than 1024 columns
// in parts of at most 1024; each part's weight packed once in 64-column slices), else sgemm. Both within the float32 bound of the float64 sums, the same
// bits on 1, 2 and 3 threads; rows of x and y in either order or apart (one product per batch
// entry), k off the packing's blocks of 16, no bias; and fewer rows, on sgemm either way.
TEST(Gemm, Float32LinearThroughOneDnnAndSgemm) {
  std::mt19937_64 rng(mha_test::test_seed());
  struct Case {
    int64_t N, L, in, out;
    bool seq_first, bias;
  };
  const Case cases[] = {{2, 300, 64, 700, false, true}, {3, 201, 37, 1300, true, true}, {1, 520, 130, 64, false, false},
                        {4, 130, 96, 200, true, true}, {2, 5, 33, 48, false, true},
                        {1, 1100, 40, 600, false, true}};  // (600 and 700 columns: a lone product whole, and cut in two)
  for (const Case& c : cases) {
    for (const bool onednn : {true, false}) {
      if (onednn && !mha::detail::f32_matmul_available()) continue;
      mha::detail::disable_f32_matmul(!onednn);
      SCOPED_TRACE("N=" + std::to_string(c.N) + " L=" + std::to_string(c.L) + " in=" + std::to_string(c.in) +
                   " out=" + std::to_string(c.out) + " seq_first=" + std::to_string(c.seq_first) +
                   " onednn=" + std::to_string(onednn));
      const mha::Tensor x = mha_test::randn(c.seq_first ? mha::Shape{c.L, c.N, c.in} : mha::Shape{c.N, c.L, c.in}, rng);
      const mha::Tensor w = mha_test::randn({c.out, c.in + 3}, rng);  // rows wider than used
      const mha::Tensor b = mha_test::randn({c.out}, rng);
      const mha::TensorView xv = c.seq_first ? x.view().transpose(0, 1) : x.view(), wv = w.view().slice(1, 0, c.in);
      const float* bias = c.bias ? b.data<float>() : nullptr;
      // y batch-first whatever x is: seq-first x then takes one product per batch entry.
      auto project = [&](int threads) {
        mha::Tensor y = mha::Tensor::empty({c.N, c.L, c.out});
        mha::detail::linear(xv, wv, bias, y.view(), threads);
        return y;
      };
      const mha::Tensor y = project(2);
      double worst = 0;
      for (int64_t n = 0; n < c.N; ++n) {
        for (int64_t l = 0; l < c.L; ++l) {
          for (int64_t o = 0; o < c.out; o += 3) {
            double sum = bias ? bias[o] : 0.0, magnitude = std::abs(sum);
            for (int64_t i = 0; i < c.in; ++i) {
              const double p = static_cast<double>(xv.data_as<float>()[n * xv.strides[0] + l * xv.strides[1] + i]) *
                                static_cast<double>(w.data<float>()[o * (c.in + 3) + i]);
              sum += p, magnitude += std::abs(p);
            }
            // float32 sums of in + 1 terms: within (in + 1) * 2^-24 of the sum of their magnitudes
            const double got = y.data<float>()[(n * c.L + l) * c.out + o];
            worst = std::max(worst, std::abs(got - sum) / ((c.in + 1) * 0x1p-24 * magnitude));
          }
        }
      }
      EXPECT_LE(worst, 1.0);
      EXPECT_TRUE(mha_test::same_bits(project(1), y));
      EXPECT_TRUE(mha_test::same_bits(project(3), y));
    }
    mha::detail::disable_f32_matmul(false);
  }
}

}  // namespace
