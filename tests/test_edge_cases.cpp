// Numerical edge cases, each with the behaviour the library documents (docs/RELIABILITY.md).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

class EdgeIsa : public ::testing::TestWithParam<mha::detail::Isa> {
 protected:
  void SetUp() override { mha::detail::force_isa(GetParam()); }
  void TearDown() override { mha::detail::force_isa(std::nullopt); }
};

// NaN or Inf in an input reaches the outputs it touches; it is never silently dropped.
TEST_P(EdgeIsa, NanAndInfPropagate) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::Tensor q = mha_test::randn({1, 2, 70, 16}, rng), k = mha_test::randn({1, 2, 90, 16}, rng),
              v = mha_test::randn({1, 2, 90, 16}, rng);
  v.data<float>()[(0 * 90 + 40) * 16 + 3] = NAN;  // head 0, key 40, column 3
  q.data<float>()[(1 * 70 + 5) * 16 + 0] = INFINITY;  // head 1, query 5
  // ...and key 0, which it sees, has a positive column 0: its score is +inf, so the row is NaN.
  // (Were every visible key's column 0 negative, all its scores would be -inf: a fully masked row,
  // zero, as one seed in 64 drew.)
  float& k0 = k.data<float>()[(1 * 90 + 0) * 16 + 0];
  k0 = std::fabs(k0) + 0.5f;
  const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, {.is_causal = true});
  const auto at = [&](int64_t h, int64_t i, int64_t d) { return out.data<float>()[(h * 70 + i) * 16 + d]; };
  // Head 0: queries that see key 40 (i >= 40 under top-left causality) have NaN in column 3, and
  // the other columns stay finite. (A query that does not see key 40 may still get NaN there, as
  // with PyTorch's P @ V: its zero weight times NaN is NaN. That is not asserted either way.)
  EXPECT_TRUE(std::isnan(at(0, 40, 3)));
  EXPECT_TRUE(std::isnan(at(0, 69, 3)));
  EXPECT_FALSE(std::isnan(at(0, 69, 2)));
  EXPECT_FALSE(std::isnan(at(1, 69, 3)));  // nothing leaks into another head
  // Head 1: the query with an infinite component gives a non-finite row; its neighbours do not.
  EXPECT_FALSE(std::isfinite(at(1, 5, 0)) && std::isfinite(at(1, 5, 1)) && std::isfinite(at(1, 5, 7)));
  EXPECT_TRUE(std::isfinite(at(1, 6, 0)));
}

// Scores of magnitude 1e4 (fp32) neither overflow nor lose the softmax: the max is subtracted first.
TEST_P(EdgeIsa, HugeScores) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::Tensor q = mha_test::randn({1, 1, 33, 8}, rng), k = mha_test::randn({1, 1, 70, 8}, rng);
  const mha::Tensor v = mha_test::randn({1, 1, 70, 8}, rng);
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] *= 100.0f;  // scores ~ 1e4
  for (int64_t i = 0; i < k.numel(); ++i) k.data<float>()[i] *= 100.0f;
  const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v);
  // The fp32 scores themselves carry a relative rounding of ~1e-7, i.e. ~1e-3 absolute at 1e4:
  // weights are compared with that slack, and the output likewise.
  EXPECT_LT(mha_test::rel_error(r.weights, ref.weights), 2e-2);
  EXPECT_LT(mha_test::rel_error(r.output, ref.output), 2e-2);
  for (int64_t i = 0; i < r.output.numel(); ++i) ASSERT_TRUE(std::isfinite(r.output.data<float>()[i]));
  // bf16 inputs of large magnitude, likewise finite.
  const mha::Tensor qb = mha::Tensor::copy_of(q, mha::DType::bf16), kb = mha::Tensor::copy_of(k, mha::DType::bf16),
                    vb = mha::Tensor::copy_of(v, mha::DType::bf16);
  const mha::Tensor ob = mha::scaled_dot_product_attention(qb, kb, vb);
  const mha::Tensor ob32 = mha::Tensor::copy_of(ob, mha::DType::f32);
  for (int64_t i = 0; i < ob32.numel(); ++i) ASSERT_TRUE(std::isfinite(ob32.data<float>()[i]));
}

// A NaN anywhere in a query row makes that whole output row NaN (every score of the row is NaN);
// a NaN in a key makes NaN the rows of every query that attends it; an infinite value makes the
// outputs that weigh it non-finite. Rows that do not involve them stay finite.
TEST_P(EdgeIsa, NanInQueriesAndKeysPropagatesToTheRowsThatUseThem) {
  std::mt19937_64 rng(mha_test::test_seed());
  const int64_t L = 50, S = 80, D = 24;
  mha::Tensor q = mha_test::randn({2, L, D}, rng), k = mha_test::randn({2, S, D}, rng),
              v = mha_test::randn({2, S, D}, rng);
  q.data<float>()[(0 * L + 17) * D + 5] = NAN;        // head 0, query 17
  k.data<float>()[(1 * S + 33) * D + 0] = NAN;        // head 1, key 33
  v.data<float>()[(0 * S + 60) * D + 2] = INFINITY;   // head 0, key 60, column 2
  for (bool causal : {false, true}) {
    const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, {.is_causal = causal});
    const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, {.is_causal = causal});
    for (const mha::Tensor* out : {&r.output, &plain}) {
      const auto at = [&](int64_t h, int64_t i, int64_t d) { return out->data<float>()[(h * L + i) * D + d]; };
      for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(at(0, 17, d))) << "query row, column " << d;
      for (int64_t i : {int64_t{33}, int64_t{40}, L - 1}) {  // these see key 33 with or without causality
        for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(at(1, i, d))) << "key 33, query " << i << ", column " << d;
      }
      if (!causal) {  // every query of head 0 sees key 60: column 2 is non-finite there
        EXPECT_FALSE(std::isfinite(at(0, 3, 2)));
      }
      // Neighbours of the NaN row, in columns the infinite value does not reach, stay finite. (Rows
      // that do not attend a bad key are not asserted either way: as in PyTorch's P @ V, a weight
      // of exactly zero times NaN or Inf is NaN when the key shares their tile.)
      EXPECT_TRUE(std::isfinite(at(0, 16, 0)) && std::isfinite(at(0, 18, 7)));
    }
    for (int64_t j = 0; j <= 17; ++j) EXPECT_TRUE(std::isnan(r.weights.at({0, 17, j}))) << j;
  }
}

// Rows whose every key is excluded (bool mask, -inf additive mask, causality with Lq > Lk, dropout
// with p = 1) give zero outputs and zero weights, and +inf log-sum-exp, on every path.
TEST_P(EdgeIsa, FullyMaskedRowsAreZero) {
  std::mt19937_64 rng(mha_test::test_seed());
  const int64_t L = 40, S = 70, D = 16;
  const mha::Tensor q = mha_test::randn({2, 3, L, D}, rng), k = mha_test::randn({2, 3, S, D}, rng),
                    v = mha_test::randn({2, 3, S, D}, rng);
  mha::Tensor keep = mha::Tensor::empty({L, S}, mha::DType::boolean);
  mha::Tensor add = mha_test::randn({2, 1, L, S}, rng);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) {
      keep.data<bool>()[i * S + j] = i % 7 != 3;  // rows 3, 10, 17, ... see nothing
      if (i % 5 == 1) add.data<float>()[(1 * L + i) * S + j] = -INFINITY;  // batch 1, rows 1, 6, ...
    }
  const auto zero_rows = [&](const mha::Tensor& out, const mha::Tensor* w, auto masked) {
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t i = 0; i < L; ++i) {
          if (!masked(b, i)) continue;
          for (int64_t d = 0; d < D; ++d) ASSERT_EQ(out.at({b, h, i, d}), 0.0) << b << " " << h << " " << i;
          if (w) {
            for (int64_t j = 0; j < S; ++j) ASSERT_EQ(w->at({b, h, i, j}), 0.0);
          }
        }
  };
  {
    const mha::SdpaOptions o{.attn_mask = keep.view()};
    const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    const auto masked = [](int64_t, int64_t i) { return i % 7 == 3; };
    zero_rows(r.output, &r.weights, masked);
    zero_rows(mha::scaled_dot_product_attention(q, k, v, o), nullptr, masked);
    const auto t = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    zero_rows(t.output, nullptr, masked);
    EXPECT_EQ(t.lse.at({0, 0, 3}), INFINITY);
    EXPECT_LT(mha_test::rel_error(r.output, mha::reference::scaled_dot_product_attention(q, k, v, o).output), 1e-5);
  }
  {
    const mha::SdpaOptions o{.attn_mask = add.view()};
    const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    const auto masked = [](int64_t b, int64_t i) { return b == 1 && i % 5 == 1; };
    zero_rows(r.output, &r.weights, masked);
    EXPECT_NE(r.output.at({0, 0, 1, 0}), 0.0);  // batch 0 keeps those rows
    EXPECT_LT(mha_test::rel_error(r.output, mha::reference::scaled_dot_product_attention(q, k, v, o).output), 1e-5);
  }
  {  // bottom-right causality with Lq > Lk: the first Lq - Lk queries see no key
    const mha::TensorView k2 = k.view().slice(2, 0, 25), v2 = v.view().slice(2, 0, 25);  // strided views
    const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
    const auto r = mha::scaled_dot_product_attention_with_weights(q, k2, v2, o);
    for (int64_t i = 0; i < L; ++i) {
      if (i < L - 25) {
        for (int64_t d = 0; d < D; ++d) ASSERT_EQ(r.output.at({1, 2, i, d}), 0.0) << i;
      } else {
        EXPECT_NE(r.output.at({1, 2, i, 0}), 0.0) << i;
      }
    }
  }
  {  // dropout with p = 1 drops every weight
    const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, {.dropout_p = 1.0, .dropout_seed = 3});
    zero_rows(r.output, &r.weights, [](int64_t, int64_t) { return true; });
  }
}

// A finite mask value too large to scale by log2(e) in float32 (Hugging Face's finfo.min,
// -3.4e38) stays finite, as in PyTorch: a row whose every visible key carries one has each score
// rounded to the mask value, hence uniform weights and the mean of those keys' values (not the
// zeros of a fully masked row); a row with ordinary keys too gives those keys the bits an -inf
// mask gives. On every path: the tile kernel (mask copied and read in place), the few-queries
// kernel in both schedules, with weights; float16-sized values too (-65504 is ordinary).
TEST_P(EdgeIsa, HugeFiniteMaskValuesAreNotInfinite) {
  std::mt19937_64 rng(mha_test::test_seed());
  const float lowest = std::numeric_limits<float>::lowest();
  for (const int64_t L : {int64_t{1}, int64_t{3}, int64_t{40}}) {
    const int64_t S = 70, D = 16, H = 2;
    const mha::Tensor q = mha_test::randn({2, H, L, D}, rng), k = mha_test::randn({2, H, S, D}, rng),
                      v = mha_test::randn({2, H, S, D}, rng);
    mha::Tensor huge = mha_test::randn({2, 1, L, S}, rng), inf = mha::Tensor::copy_of(huge.view());
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j) {
          const int64_t e = (b * L + i) * S + j;
          // Batch 1, row 0: every key swamped (some at -3e38, which overflows once scaled, too).
          // Other rows: keys 20-49 swamped, the rest ordinary.
          const bool swamped = (b == 1 && i == 0) || (j >= 20 && j < 50);
          if (swamped) huge.data<float>()[e] = j % 3 == 0 ? -3e38f : lowest, inf.data<float>()[e] = -INFINITY;
        }
    SCOPED_TRACE("L=" + std::to_string(L));
    for (const int64_t cap : {int64_t{8} << 20, int64_t{0}}) {  // the mask copied, then read in place
      std::atomic<int64_t>& floats = mha::detail::transposed_mask_floats();
      const int64_t saved = floats.exchange(cap);
      const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, {.attn_mask = huge.view()});
      const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, {.attn_mask = huge.view()});
      const auto excluded = mha::scaled_dot_product_attention_with_weights(q, k, v, {.attn_mask = inf.view()});
      floats = saved;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t j = 0; j < S; ++j) EXPECT_NEAR(r.weights.at({1, h, 0, j}), 1.0 / S, 1e-7) << j;
        for (int64_t d = 0; d < D; ++d) {
          double mean = 0;
          for (int64_t j = 0; j < S; ++j) mean += v.at({1, h, j, d}) / S;
          EXPECT_NEAR(plain.at({1, h, 0, d}), mean, 1e-6) << h << " " << d;
          EXPECT_NEAR(r.output.at({1, h, 0, d}), mean, 1e-6) << h << " " << d;
        }
        for (int64_t i = 0; i < L; ++i)
          for (int64_t b = 0; b < 2; ++b) {
            if (b == 1 && i == 0) continue;
            for (int64_t d = 0; d < D; ++d) ASSERT_EQ(plain.at({b, h, i, d}), excluded.output.at({b, h, i, d})) << b << i;
            for (int64_t j = 0; j < S; ++j) ASSERT_EQ(r.weights.at({b, h, i, j}), excluded.weights.at({b, h, i, j}));
          }
      }
    }
  }
}

// 16-bit outputs are stored through a row buffer as many rows at a time as it holds (all of a
// task's at Dv = 40, 3 at Dv = 1000 on AVX-512), and element by element for rows longer than the
// buffer (3072 floats there): each path's output against the float64 reference (bf16 within 2^-7 relative, its rounding plus the
// pair products' rounding of P; fp16 within 2^-9).
TEST_P(EdgeIsa, LowPrecisionOutputsOfLongValueRows) {
  std::mt19937_64 rng(mha_test::test_seed());
  for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16})
    for (const int64_t dv : {40, 1000, 3080}) {
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + " Dv " + std::to_string(dv));
      const mha::Tensor q = mha_test::randn({1, 2, 50, 16}, rng, dtype), k = mha_test::randn({1, 2, 20, 16}, rng, dtype),
                        v = mha_test::randn({1, 2, 20, dv}, rng, dtype);
      const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v);
      const auto ref = mha::reference::scaled_dot_product_attention(q, k, v);
      EXPECT_LT(mha_test::rel_error(out, ref.output), dtype == mha::DType::bf16 ? 0x1p-7 : 0x1p-9);
    }
}

// 16-bit outputs and gradients (rows of unit stride: rounded in vectors as pairs of dims on
// AVX-512) round as the scalar conversion rounds the float32 path's values: to nearest even,
// subnormal halves and bfloat16s kept, NaN quieted with its sign (float16: its payload dropped).
// Values 2^-20 of the usual size put most results among float16's subnormals; a value column
// holds +inf, another -inf and +inf (a NaN output), another a signalling NaN with a payload in
// every third key, and another 65504 (float16's largest) in every key. Head dims
// odd and even, rows past one task of 48 queries, and 3 queries. Not where bfloat16 takes its own
// products (AVX512-BF16's pairs, the tile unit's).
TEST_P(EdgeIsa, SixteenBitRoundingOfOutputsAndGradients) {
  std::mt19937_64 rng(mha_test::test_seed());
  auto wide = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
  for (const mha::DType dtype : {mha::DType::f16, mha::DType::bf16})
    for (const int64_t dv : {37, 64})
      for (const int64_t lq : {70, 3}) {  // (3: the decoding kernels, forward and backward)
        SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + " Dv " + std::to_string(dv) + " Lq " + std::to_string(lq));
        const int64_t B = 4, H = 4, lk = 90, dk = 32;
        mha::Tensor q = mha_test::randn({B, H, lq, dk}, rng), k = mha_test::randn({B, H, lk, dk}, rng);
        mha::Tensor v = mha_test::randn({B, H, lk, dv}, rng), grad = mha_test::randn({B, H, lq, dv}, rng);
        for (int64_t e = 0; e < v.numel(); ++e) v.data<float>()[e] *= 0x1p-20f;
        for (int64_t e = 0; e < grad.numel(); ++e) grad.data<float>()[e] *= 0x1p-20f;
        for (int64_t r = 0; r < B * H * lk; ++r) {
          float* row = v.data<float>() + r * dv;
          row[1] = INFINITY, row[2] = r % 2 ? INFINITY : -INFINITY, row[4] = 65504.0f;
        }
        q = mha::Tensor::copy_of(q, dtype), k = mha::Tensor::copy_of(k, dtype), v = mha::Tensor::copy_of(v, dtype);
        for (int64_t r = 0; r < B * H * lk; r += 3)  // a signalling NaN with a payload and the sign set
          v.data<uint16_t>()[r * dv + 3] = dtype == mha::DType::f16 ? 0xfd01 : 0xff81;
        grad = mha::Tensor::copy_of(grad, dtype);
        const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
        const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
        const auto saved32 = mha::scaled_dot_product_attention_for_training(wide(q), wide(k), wide(v), o);
        if (!mha_test::bf16_products_forward(dtype, lq, lk, dk, dv)) {
          EXPECT_TRUE(mha_test::same_bits(saved.output, mha::Tensor::copy_of(saved32.output, dtype)));
        } else {  // the same infinities and NaNs; finite values within bfloat16 rounding of their column's largest
          const mha::Tensor got = wide(saved.output);
          const float* want = saved32.output.data<float>();
          std::vector<float> largest(dv, 0.0f);
          for (int64_t e = 0; e < got.numel(); ++e)
            if (std::isfinite(want[e])) largest[e % dv] = std::max(largest[e % dv], std::abs(want[e]));
          int64_t wrong = 0;
          for (int64_t e = 0; e < got.numel(); ++e) {
            const float a = got.data<float>()[e];
            wrong += std::isnan(want[e])   ? !std::isnan(a)
                     : std::isinf(want[e]) ? a != want[e]
                                           : !(std::abs(a - want[e]) <= 1e-2f * largest[e % dv]);
          }
          EXPECT_EQ(wrong, 0);
        }
        // Gradients from finite values (the column of a NaN output would make every gradient NaN).
        const mha::Tensor fresh = mha::Tensor::copy_of(mha_test::randn({B * H * lk * 4}, rng), dtype);
        for (int64_t r = 0; r < B * H * lk; ++r)
          for (int64_t d = 1; d <= 4; ++d) v.data<uint16_t>()[r * dv + d] = fresh.data<uint16_t>()[r * 4 + d - 1];
        const auto finite = mha::scaled_dot_product_attention_for_training(q, k, v, o);
        const auto g = mha::scaled_dot_product_attention_backward(q, k, v, finite, grad, o);
        const mha::AttentionForTraining rounded{wide(finite.output), finite.lse};
        const auto g32 = mha::scaled_dot_product_attention_backward(wide(q), wide(k), wide(v), rounded, wide(grad), o);
        if (!mha_test::tile_unit_backward(dtype, lq, lk, dk, dv)) {
          EXPECT_TRUE(mha_test::same_bits(g.query, mha::Tensor::copy_of(g32.query, dtype)));
          EXPECT_TRUE(mha_test::same_bits(g.key, mha::Tensor::copy_of(g32.key, dtype)));
          EXPECT_TRUE(mha_test::same_bits(g.value, mha::Tensor::copy_of(g32.value, dtype)));
        }
        int64_t subnormal = 0;  // (the case is what it says: float16 gradients among the subnormals)
        for (int64_t e = 0; e < g.value.numel(); ++e) subnormal += (g.value.data<uint16_t>()[e] & 0x7c00) == 0;
        if (dtype == mha::DType::f16) EXPECT_GT(subnormal, g.value.numel() / 4);
      }
}

INSTANTIATE_TEST_SUITE_P(Edges, EdgeIsa, ::testing::ValuesIn(mha::detail::supported_isas()),
                         [](const auto& info) { return std::string(mha::detail::isa_name(info.param)); });

TEST(Edges, NegativeInfinityInAdditiveMasksExcludes) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor q = mha_test::randn({3, 6, 8}, rng), k = mha_test::randn({3, 9, 8}, rng),
                    v = mha_test::randn({3, 9, 8}, rng);
  mha::Tensor mask = mha_test::randn({6, 9}, rng);
  for (int64_t j = 0; j < 9; ++j) mask.data<float>()[2 * 9 + j] = j == 4 ? 0.0f : -INFINITY;  // row 2 sees key 4 only
  const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, {.attn_mask = mask.view()});
  for (int64_t h = 0; h < 3; ++h) {
    EXPECT_EQ(r.weights.at({h, 2, 4}), 1.0);
    for (int64_t d = 0; d < 8; ++d) EXPECT_NEAR(r.output.at({h, 2, d}), v.at({h, 4, d}), 1e-6);
  }
}

TEST(Edges, SingleQueryAgainstALongSequence) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor q = mha_test::randn({1, 2, 1, 32}, rng), k = mha_test::randn({1, 2, 100000, 32}, rng),
                    v = mha_test::randn({1, 2, 100000, 32}, rng);
  const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, {.is_causal = true,
                                                                     .causal_alignment = mha::CausalAlignment::BottomRight});
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v);
  // The output averages 1e5 values of size ~1 that nearly cancel (|out| ~ 1e-2), so fp32 rounding
  // of order 1e-7 on the value scale reads as ~1e-5 relative to the output: hence 1e-4.
  EXPECT_LT(mha_test::rel_error(out, ref.output), 1e-4);
  // L = 1 and Lk = 1: the single key's value, exactly.
  const mha::Tensor k1 = mha_test::randn({1, 2, 1, 32}, rng), v1 = mha_test::randn({1, 2, 1, 32}, rng);
  const mha::Tensor o1 = mha::scaled_dot_product_attention(q, k1, v1);
  for (int64_t i = 0; i < o1.numel(); ++i) EXPECT_NEAR(o1.data<float>()[i], v1.data<float>()[i], 1e-6);
}

int64_t peak_rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// L = 65536 runs in memory that stays O(L): the score matrix would be 16 GiB. (Under qemu, where
// its 137 GFLOP took over 20 minutes, and ThreadSanitizer, over 2, L = 8192: a 256 MiB matrix
// against the same 64 MiB bound.)
TEST(Edges, LongestSequenceInLinearMemory) {
  std::mt19937_64 rng(mha_test::test_seed());
#ifdef MHA_TESTS_SLOW_KERNELS
  const int64_t L = 8192, D = 16;
#else
  const int64_t L = 65536, D = 16;
#endif
  const mha::Tensor q = mha_test::randn({1, 1, L, D}, rng), k = mha_test::randn({1, 1, L, D}, rng),
                    v = mha_test::randn({1, 1, L, D}, rng);
  mha::Tensor out = mha::Tensor::zeros({1, 1, L, D});  // touched before the baseline
  const int64_t before = peak_rss_kib();
  mha::scaled_dot_product_attention_into(q, k, v, out, {.is_causal = true});
  const int64_t grown = peak_rss_kib() - before;
  if (before > 0) EXPECT_LT(grown, 64 * 1024) << "peak RSS grew by " << grown << " KiB";  // scratch is O(D) per thread
  // Rows from the start, the middle and the end against the reference on exactly their keys.
  for (int64_t start : {int64_t{0}, L / 2, L - 4}) {
    const auto ref = mha::reference::scaled_dot_product_attention(
        q.view().slice(2, start, start + 4), k.view().slice(2, 0, start + 4), v.view().slice(2, 0, start + 4),
        {.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight});
    // A row's output is a float32 sum over its start + 4 keys: its rounding errors add up like a
    // random walk, about sqrt(keys) * u relative (1.5e-5 at 65536 keys; 1.28e-5 has been seen), so
    // the bound is 1e-5 plus four times that.
    const double bound = 1e-5 + 4.0 * std::sqrt(static_cast<double>(start + 4)) * 0x1p-24;
    EXPECT_LT(mha_test::rel_error(out.view().slice(2, start, start + 4), ref.output), bound) << start;
  }
}

// Element counts beyond 2^31 are indexed with 64 bits: views over a small buffer with huge strides
// (never dereferenced beyond the buffer) keep exact offsets.
TEST(Edges, SixtyFourBitIndexArithmetic) {
  const int64_t big = int64_t{3} << 31;  // 6 Gi elements
  const mha::TensorView v(static_cast<const float*>(nullptr), {4, big}, {big, 1});
  EXPECT_EQ(v.numel(), 4 * big);
  EXPECT_EQ(v.transpose(0, 1).stride(0), 1);
  EXPECT_EQ(v.stride(0) * 3 + (big - 1), 4 * big - 1);  // the last element's offset, exact
  const mha::TensorView s = v.split_dim(1, 3);
  EXPECT_EQ(s.stride(1), big / 3);
  EXPECT_EQ(mha::checked_numel({int64_t{1} << 31, 4}, "shape"), int64_t{1} << 33);
}

}  // namespace

namespace {

// A request whose weights cannot fit in memory is an mha::Error, not an abort: 2 heads of
// 2^17 x 2^17 float weights are 128 GiB.
TEST(Edges, WeightsBeyondMemoryAreAnError) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::MultiheadAttention m(8, 2);
  const mha::Tensor x = mha_test::randn({int64_t{1} << 17, 1, 8}, rng);
  EXPECT_THROW(m(x, x, x, {.need_weights = true, .average_attn_weights = false}), mha::Error);
}

// Large float16 inputs: scores far beyond fp16's range are computed in fp32, and the result is
// finite and accurate.
TEST(Edges, LargeHalfPrecisionInputs) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::Tensor q = mha_test::randn({1, 2, 40, 32}, rng), k = mha_test::randn({1, 2, 50, 32}, rng);
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] *= 200.0f;  // q.k ~ 1e6, fp16 max 65504
  const mha::Tensor qh = mha::Tensor::copy_of(q, mha::DType::f16), kh = mha::Tensor::copy_of(k, mha::DType::f16),
                    vh = mha::Tensor::copy_of(mha_test::randn({1, 2, 50, 32}, rng), mha::DType::f16);
  const mha::Tensor out = mha::scaled_dot_product_attention(qh, kh, vh);
  const auto ref = mha::reference::scaled_dot_product_attention(qh, kh, vh);
  EXPECT_LT(mha_test::rel_error(out, ref.output), 2e-3);
}

}  // namespace

// Queries with no key at all (Lk = 0): the output is zero, so is every query's gradient, on each
// ISA and through each backward schedule (a handful of rows, tiles, a long sequence). The
// gradient's storage was just freed full of NaN, so a gradient the kernels leave unwritten shows.
TEST(Edges, BackwardWithoutKeysGivesZeroQueryGradients) {
  std::mt19937_64 rng(mha_test::test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (const mha::Shape& shape : {mha::Shape{1, 1, 1, 16}, mha::Shape{3, 7, 16}, mha::Shape{2, 2, 100, 32},
                                    mha::Shape{1, 2, 4096, 64}}) {
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + std::to_string(shape[shape.size() - 2]) + " rows");
      mha::Shape kv_shape = shape;
      kv_shape[kv_shape.size() - 2] = 0;
      const mha::Tensor q = mha_test::randn(shape, rng), grad = mha_test::randn(shape, rng);
      const mha::Tensor kv = mha::Tensor::empty(kv_shape);
      const auto saved = mha::scaled_dot_product_attention_for_training(q, kv, kv);
      EXPECT_EQ(mha_test::max_abs(saved.output), 0.0);
      {
        mha::Tensor stale = mha::Tensor::empty(shape);
        std::fill_n(stale.data<float>(), stale.numel(), std::numeric_limits<float>::quiet_NaN());
      }
      const auto g = mha::scaled_dot_product_attention_backward(q, kv, kv, saved, grad);
      EXPECT_EQ(mha_test::max_abs(g.query), 0.0);
      EXPECT_EQ(g.key.numel(), 0);
    }
  }
  mha::detail::force_isa(std::nullopt);
}
