// The fused SDPA forward against the float64 reference, on every ISA this CPU runs: randomized
// shapes and options (fresh seed each run, printed; MHA_TEST_SEED replays), awkward sizes around
// the kernel's tiles, strided views, every mask kind and rank, both causal alignments, GQA,
// Lq != Lk, Dk != Dv, scale, dropout; plus the behaviours the API documents.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/mask_only_rows.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::max_abs;
using mha_test::rel_error;
using mha_test::test_seed;

// fp32 against float64: the kernel's sums run over at most a few hundred O(1) terms here, so
// rounding stays near 1e-6; 1e-5 is the bound.
constexpr double kTolerance = 1e-5;

// ...unless the scores are large. A score s = scale q.k carries an fp32 rounding error of about
// u * scale * |q| |k| (u = 2^-24), and exp turns that absolute error into the same relative error
// of every weight and of the output, whatever the kernel does. With Dk = 139 and scale 1.9 the
// scores reach about 270 and the error 1.3e-5 (seed 9329449468414563686). An additive mask adds
// its own magnitude to the score before the rounding: a ramp mask reaching -270 on a row's last
// visible key gave 1.1e-5 with scores near 1 (seed 1654355620999808818). The bound is 4x the
// estimate u * (scale |q| |k| + max finite |mask|), or 1e-5, whichever is larger.
double score_tolerance(const mha::TensorView& q, const mha::TensorView& k, double scale,
                       const mha::TensorView* mask = nullptr) {
  auto max_row_norm = [](const mha::TensorView& t) {
    const mha::Tensor c = mha::Tensor::copy_of(t, mha::DType::f64);
    const int64_t d = c.sizes().back(), rows = d == 0 ? 0 : c.numel() / d;
    double m = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += c.data<double>()[r * d + i] * c.data<double>()[r * d + i];
      m = std::max(m, std::sqrt(s));
    }
    return m;
  };
  double mask_max = 0;
  if (mask != nullptr) {
    const mha::Tensor m = mha::Tensor::copy_of(*mask, mha::DType::f64);
    for (int64_t i = 0; i < m.numel(); ++i)
      if (std::isfinite(m.data<double>()[i])) mask_max = std::max(mask_max, std::abs(m.data<double>()[i]));
  }
  return std::max(kTolerance, 4.0 * std::ldexp(1.0, -24) * (scale * max_row_norm(q) * max_row_norm(k) + mask_max));
}

// Sizes around the kernel's tiles and odd ones: 48 queries per task; 64 keys per step in 8-row
// calls (AVX-512, portable), 72 keys in 12-row calls (AVX2).
const int64_t kLengths[] = {1, 2, 3, 7, 8, 9, 11, 12, 13, 15, 16, 17, 47, 48, 49, 63, 64, 65, 71, 72, 73, 113, 130};
constexpr int64_t kLastLength = static_cast<int64_t>(std::size(kLengths)) - 1;

struct Case {
  mha::Tensor q_store, k_store, v_store, mask;
  mha::TensorView q, k, v;
  mha::SdpaOptions options;
  std::string what;
};

Case draw(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  Case c;
  const int rank = static_cast<int>(pick(2, 4));
  const int64_t B = rank == 4 ? pick(1, 2) : 1;
  const int64_t Hkv = rank >= 3 ? pick(1, 3) : 1;
  const int64_t Hq = rank >= 3 && coin(0.4) ? Hkv * pick(2, 3) : Hkv;
  const int64_t Lq = kLengths[pick(0, kLastLength)], Lk = coin(0.3) ? Lq : kLengths[pick(0, kLastLength)];
  const int64_t Dk = coin(0.2) ? pick(65, 160) : pick(1, 64), Dv = coin(0.5) ? Dk : pick(1, 96);
  auto shape = [&](int64_t h, int64_t l, int64_t d) {
    mha::Shape full{B, h, l, d};
    return mha::Shape(full.end() - rank, full.end());
  };
  // Sometimes [B, L, H, D] storage viewed as [B, H, L, D]; sometimes a slice of a wider buffer.
  auto make = [&](mha::Tensor& store, int64_t h, int64_t l, int64_t d) -> mha::TensorView {
    if (rank == 4 && coin(0.3)) {
      store = randn({B, l, h, d}, rng);
      return store.view().transpose(1, 2);
    }
    if (coin(0.2)) {
      mha::Shape s = shape(h, l, d);
      s.back() += 5;
      store = randn(s, rng);
      return store.view().slice(-1, 2, 2 + d);
    }
    store = randn(shape(h, l, d), rng);
    return store.view();
  };
  c.q = make(c.q_store, Hq, Lq, Dk);
  c.k = make(c.k_store, Hkv, Lk, Dk);
  c.v = make(c.v_store, Hkv, Lk, Dv);
  c.options.enable_gqa = Hq != Hkv;
  c.options.is_causal = coin(0.3);
  c.options.causal_alignment = coin(0.5) ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (coin(0.2)) c.options.scale = std::uniform_real_distribution<double>(0.01, 2.0)(rng);
  if (coin(0.15)) {
    c.options.dropout_p = std::uniform_real_distribution<double>(0.05, 0.9)(rng);
    c.options.dropout_seed = rng();
  }
  const int mask_kind = static_cast<int>(pick(0, 2));
  if (mask_kind > 0) {
    const mha::Shape full = {B, Hq, Lq, Lk};
    const int mrank = static_cast<int>(pick(1, 4));
    mha::Shape ms(full.end() - mrank, full.end());
    for (auto& s : ms)
      if (coin(0.3)) s = 1;  // broadcast dimensions
    if (mask_kind == 1) {
      c.mask = mha::Tensor::empty(ms, mha::DType::boolean);
      for (int64_t i = 0; i < c.mask.numel(); ++i) c.mask.data<bool>()[i] = coin(0.75);
    } else {
      c.mask = randn(ms, rng);
      for (int64_t i = 0; i < c.mask.numel(); ++i)
        if (coin(0.1)) c.mask.data<float>()[i] = -INFINITY;
    }
    c.options.attn_mask = c.mask.view();
  }
  c.what = "q " + c.q.shape_str() + " k " + c.k.shape_str() + " v " + c.v.shape_str() + " causal " +
           std::to_string(c.options.is_causal) + (c.options.causal_alignment == mha::CausalAlignment::TopLeft ? " TL" : " BR") +
           " mask " + std::to_string(mask_kind) + (c.mask.defined() ? c.mask.shape_str() : "") + " dropout " +
           std::to_string(c.options.dropout_p) + " scale " + std::to_string(c.options.scale.value_or(0));
  return c;
}

class EveryIsa : public ::testing::TestWithParam<mha::detail::Isa> {
 protected:
  void SetUp() override { mha::detail::force_isa(GetParam()); }
  void TearDown() override { mha::detail::force_isa(std::nullopt); }
};

TEST_P(EveryIsa, RandomizedAgainstReference) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 150; ++n) {
    const Case c = draw(rng);
    SCOPED_TRACE(c.what);
    const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    const auto fused = mha::scaled_dot_product_attention_with_weights(c.q, c.k, c.v, c.options);
    const double scale = c.options.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.q.sizes().back())));
    const double tolerance = score_tolerance(c.q, c.k, scale);
    EXPECT_LT(rel_error(fused.output, ref.output), tolerance);
    EXPECT_LT(rel_error(fused.weights, ref.weights), tolerance);
    const mha::Tensor plain = mha::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    EXPECT_LT(rel_error(plain, ref.output), tolerance);
  }
}

// Writes into a strided view of a larger buffer: every element of the view is written (it was
// NaN before), and nothing outside it is touched.
TEST_P(EveryIsa, IntoStridedViewWritesExactlyTheView) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 3, 37, 24}, rng), k = randn({2, 3, 50, 24}, rng), v = randn({2, 3, 50, 16}, rng);
  mha::Tensor buffer = mha::Tensor::empty({2, 37, 3, 20});  // [B, L, H, Dv + 4]
  for (int64_t i = 0; i < buffer.numel(); ++i) buffer.data<float>()[i] = NAN;
  const mha::TensorView out = buffer.view().transpose(1, 2).slice(-1, 2, 18);
  mha::Tensor wbuf = mha::Tensor::empty({2, 3, 37, 53});
  for (int64_t i = 0; i < wbuf.numel(); ++i) wbuf.data<float>()[i] = 12345.0f;
  const mha::TensorView weights = wbuf.view().slice(-1, 1, 51);
  mha::scaled_dot_product_attention_into(q, k, v, out, {.is_causal = true}, weights);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, {.is_causal = true});
  EXPECT_LT(rel_error(out, ref.output), kTolerance);
  EXPECT_LT(rel_error(weights, ref.weights), kTolerance);
  for (int64_t i = 0; i < buffer.numel(); ++i) {
    const int64_t d = i % 20;
    EXPECT_EQ(std::isnan(buffer.data<float>()[i]), d < 2 || d >= 18) << i;
  }
  for (int64_t i = 0; i < wbuf.numel(); ++i) {
    const int64_t j = i % 53;
    if (j == 0 || j >= 51) EXPECT_EQ(wbuf.data<float>()[i], 12345.0f) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Sdpa, EveryIsa, ::testing::ValuesIn(mha::detail::supported_isas()),
                         [](const auto& info) { return std::string(mha::detail::isa_name(info.param)); });

TEST(Sdpa, FullyMaskedRowsAreZero) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 5, 8}, rng), k = randn({2, 6, 8}, rng), v = randn({2, 6, 8}, rng);
  mha::Tensor mask = mha::Tensor::empty({5, 6}, mha::DType::boolean);
  for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = i / 6 != 2;  // row 2 sees nothing
  const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v, {.attn_mask = mask.view()});
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t d = 0; d < 8; ++d) {
      EXPECT_EQ(r.output.at({h, 2, d}), 0.0);
      EXPECT_NE(r.output.at({h, 1, d}), 0.0);
    }
  for (int64_t j = 0; j < 6; ++j) EXPECT_EQ(r.weights.at({0, 2, j}), 0.0);
  // Bottom-right causality with Lq > Lk hides every key from the first Lq - Lk queries.
  const mha::Tensor q2 = randn({1, 9, 4}, rng), k2 = randn({1, 4, 4}, rng);
  const mha::Tensor o2 = mha::scaled_dot_product_attention(
      q2, k2, k2, {.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight});
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(o2.at({0, i, 0}), 0.0) << i;
  EXPECT_NE(o2.at({0, 5, 0}), 0.0);
}

TEST(Sdpa, DropoutIsReproducibleAndHasTheRightStatistics) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 64, 16}, rng), k = randn({2, 4, 96, 16}, rng), v = randn({2, 4, 96, 16}, rng);
  const double p = 0.3;
  mha::SdpaOptions o{.dropout_p = p, .dropout_seed = 17};
  const auto a = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
  const auto b = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
  EXPECT_EQ(std::memcmp(a.output.data<float>(), b.output.data<float>(), a.output.numel() * 4), 0);
  const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(mha_test::same_bits(plain, a.output));  // the weights come from the same softmax pass
  for (int threads : {1, 3}) {
    o.num_threads = threads;
    const mha::Tensor t = mha::scaled_dot_product_attention(q, k, v, o);
    EXPECT_EQ(std::memcmp(t.data<float>(), plain.data<float>(), t.numel() * 4), 0) << threads;
  }
  o.num_threads = 0;
  o.dropout_seed = 18;
  const mha::Tensor c = mha::scaled_dot_product_attention(q, k, v, o);
  EXPECT_NE(std::memcmp(c.data<float>(), plain.data<float>(), c.numel() * 4), 0);
  // Dropped fraction: n = 2*4*64*96 = 49152 Bernoulli(p) draws; 5 sigma is about 0.01.
  int64_t dropped = 0;
  for (int64_t i = 0; i < a.weights.numel(); ++i) dropped += a.weights.data<float>()[i] == 0.0f;
  const double n = static_cast<double>(a.weights.numel());
  EXPECT_NEAR(dropped / n, p, 5 * std::sqrt(p * (1 - p) / n));
  // Kept weights are the softmax scaled by 1/(1-p), so dropout is unbiased: over many seeds each
  // output's mean is within a few standard errors (sample standard deviation / sqrt(seeds)) of
  // the output without dropout.
  const mha::Tensor clean = mha::scaled_dot_product_attention(q, k, v);
  const int seeds = 300;
  std::vector<double> sum(clean.numel(), 0.0), sum_sq(clean.numel(), 0.0);
  for (int s = 0; s < seeds; ++s) {
    const mha::Tensor t = mha::scaled_dot_product_attention(q, k, v, {.dropout_p = p, .dropout_seed = 1000u + s});
    for (int64_t i = 0; i < t.numel(); ++i) {
      sum[i] += t.data<float>()[i];
      sum_sq[i] += static_cast<double>(t.data<float>()[i]) * t.data<float>()[i];
    }
  }
  int64_t outside = 0;
  for (int64_t i = 0; i < clean.numel(); ++i) {
    const double mean = sum[i] / seeds, var = std::max(sum_sq[i] / seeds - mean * mean, 0.0);
    outside += std::abs(mean - clean.data<float>()[i]) > 5 * std::sqrt(var / seeds) + 1e-5;
  }
  EXPECT_LE(outside, clean.numel() / 1000) << "outputs whose mean is more than 5 standard errors off";
  // p = 1 drops everything.
  const mha::Tensor none = mha::scaled_dot_product_attention(q, k, v, {.dropout_p = 1.0, .dropout_seed = 1});
  for (int64_t i = 0; i < none.numel(); ++i) ASSERT_EQ(none.data<float>()[i], 0.0f);
}

// Six groups (batch entry, head): on 1, 2 and 3 threads a task is a whole group, on 4 and 5 four
// or five are and the rest run in blocks of 48 queries that the threads share, on 7 every task
// is a block of queries (flash_forward.hpp: whole_groups); in bfloat16 (pair products where the
// CPU has them) short heads copy their values as pairs per task, long ones (300 queries) per
// chunk of groups. Every schedule gives the same bits.
TEST(Sdpa, ThreadCountsGiveIdenticalBits) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    for (const int64_t lq : {200, 300}) {
      const mha::Tensor q = randn({2, 3, lq, 40}, rng, dtype), k = randn({2, 3, 150, 40}, rng, dtype),
                        v = randn({2, 3, 150, 24}, rng, dtype);
      const mha::Tensor one = mha::scaled_dot_product_attention(q, k, v, {.is_causal = true, .num_threads = 1});
      for (int threads : {2, 3, 4, 5, 7}) {
        const mha::Tensor t = mha::scaled_dot_product_attention(q, k, v, {.is_causal = true, .num_threads = threads});
        EXPECT_TRUE(mha_test::same_bits(t, one)) << mha::dtype_name(dtype) << " Lq=" << lq << " threads " << threads;
      }
    }
  }
}

TEST(Sdpa, LongSequenceAgainstSampledReferenceRows) {
  std::mt19937_64 rng(test_seed());
  const int64_t L = 4096, D = 64;
  const mha::Tensor q = randn({1, 1, L, D}, rng), k = randn({1, 1, L, D}, rng), v = randn({1, 1, L, D}, rng);
  const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, {.is_causal = true});
  for (int64_t start : {int64_t{0}, int64_t{1500}, L - 7}) {
    const mha::TensorView rows = q.view().slice(2, start, start + 7);
    // Bottom-right alignment with Lk = L makes these 7 queries the rows start..start+6 of the full problem
    // only when they end at L; otherwise give the reference exactly the keys they see.
    const int64_t keys = start + 7;
    const auto ref = mha::reference::scaled_dot_product_attention(
        rows, k.view().slice(2, 0, keys), v.view().slice(2, 0, keys),
        {.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight});
    EXPECT_LT(rel_error(out.view().slice(2, start, start + 7), ref.output), kTolerance) << start;
  }
}

// bfloat16 and float16 inputs give outputs of their dtype, within their rounding of the float64
// reference on the same (rounded) inputs: the output is rounded once (2^-8 relative for bf16,
// 2^-11 for fp16) and the AMX kernel also rounds P to bf16 before P V (another 2^-8, averaging
// down over the keys); bounds 1e-2 (bf16) and 2e-3 (fp16) of the largest output. bfloat16 head
// dims of 16 and more take the AMX kernel where the CPU has it (24 padded to 32), others the
// float32 path; both run on every ISA.
TEST_P(EveryIsa, LowPrecisionInputs) {
  std::mt19937_64 rng(test_seed());
  for (const auto& [dtype, tolerance] : {std::pair{mha::DType::bf16, 1e-2}, std::pair{mha::DType::f16, 2e-3}}) {
    for (const auto& [dk, dv] : {std::pair{int64_t{64}, int64_t{32}}, std::pair{int64_t{32}, int64_t{24}}}) {
      for (int variant = 0; variant < 3; ++variant) {
        const int64_t lq = 70 + 13 * variant, lk = variant == 2 ? 5 : 90 + 7 * variant;
        const mha::Tensor q = randn({2, 4, lq, dk}, rng, dtype), k = randn({2, 2, lk, dk}, rng, dtype),
                          v = randn({2, 2, lk, dv}, rng, dtype);
        const mha::Tensor mask = randn({lq, lk}, rng);
        mha::SdpaOptions o{.is_causal = variant != 1, .enable_gqa = true};
        if (variant == 0) o.attn_mask = mask.view();
        if (variant == 1) o.dropout_p = 0.2, o.dropout_seed = rng();
        if (variant == 2) o.causal_alignment = mha::CausalAlignment::BottomRight;
        SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + " dk=" + std::to_string(dk) + " variant " + std::to_string(variant));
        const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, o);
        EXPECT_EQ(out.dtype(), dtype);
        const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
        EXPECT_LT(rel_error(out, ref.output), tolerance);
        EXPECT_GT(rel_error(out, ref.output), 0.0);  // it really is rounded
        const auto with_weights = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
        EXPECT_EQ(with_weights.weights.dtype(), dtype);
        EXPECT_LT(rel_error(with_weights.weights, ref.weights), tolerance);
      }
    }
    const mha::Tensor q = randn({1, 2, 8, 32}, rng, dtype);
    const mha::Tensor k32 = mha::Tensor::copy_of(q, mha::DType::f32);
    EXPECT_THROW(mha::scaled_dot_product_attention(q, k32, q), mha::Error);  // mixed dtypes
  }
}

// Without the AMX kernel (float16, bfloat16 on other ISAs, or rows without unit stride), bfloat16 and
// float16 inputs run the float32 kernel, widened inside it block by block (up to 512 queries) or
// into float32 copies first (longer): either way exactly the float32 kernel on widened copies
// with its output rounded once, bit for bit, whatever the views' strides (rows without unit
// stride are copied in their own dtype first), masks, causality, dropout and grouped heads, and
// with the weights too.
TEST_P(EveryIsa, LowPrecisionIsTheFloat32KernelOnWidenedInputs) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
    for (int variant = 0; variant < 5; ++variant) {
      // Variant 4 is long (keys and values widened per chunk of heads, in several row tasks).
      const int64_t lq = variant == 4 ? 530 : 37 + 59 * variant;
      const int64_t lk = variant == 3 ? 7 : variant == 4 ? 300 : 150 - 31 * variant;
      const int64_t dk = variant % 2 ? 40 : 24, dv = variant % 2 ? 8 : 72;
      // [B, L, H, D] storage seen as [B, H, L, D]; variant 1 also reads every other feature.
      const int64_t step = variant == 1 ? 2 : 1;
      const mha::Tensor qs = randn({2, lq, 4, dk * step}, rng, dtype), ks = randn({2, lk, 2, dk * step}, rng, dtype),
                        vs = randn({2, lk, 2, dv * step}, rng, dtype);
      auto heads_view = [&](const mha::Tensor& t, int64_t d) {
        mha::TensorView v = t.view().transpose(1, 2);
        if (step > 1) v = mha::TensorView(v.data, v.dtype, {v.shape[0], v.shape[1], v.shape[2], d},
                                          {v.strides[0], v.strides[1], v.strides[2], step});
        return v;
      };
      const mha::TensorView q = heads_view(qs, dk), k = heads_view(ks, dk), v = heads_view(vs, dv);
      const mha::Tensor mask = randn({lq, lk}, rng);
      mha::SdpaOptions o{.is_causal = variant != 1, .enable_gqa = true};
      if (variant == 0) o.attn_mask = mask.view();
      if (variant == 1) o.dropout_p = 0.3, o.dropout_seed = rng();
      if (variant == 3) o.causal_alignment = mha::CausalAlignment::BottomRight;
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + " variant " + std::to_string(variant));
      const mha::Tensor q32 = mha::Tensor::copy_of(q, mha::DType::f32), k32 = mha::Tensor::copy_of(k, mha::DType::f32),
                        v32 = mha::Tensor::copy_of(v, mha::DType::f32);
      const auto wide = mha::scaled_dot_product_attention_with_weights(q32, k32, v32, o);
      const auto narrow = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
      // bfloat16 products (AVX512-BF16) round P to bfloat16 for P V: the output within bfloat16
      // rounding of the float32 kernel's; the weights are the float32 P's, rounded once.
      const bool pairs = mha_test::pair_products_forward(dtype, lq, dk);
      if (pairs) {
        EXPECT_LT(rel_error(narrow.output, wide.output), 1e-2);
        EXPECT_LT(rel_error(narrow.weights, wide.weights), 1e-2);
      } else {
        EXPECT_TRUE(mha_test::same_bits(narrow.output, mha::Tensor::copy_of(wide.output, dtype)));
        EXPECT_TRUE(mha_test::same_bits(narrow.weights, mha::Tensor::copy_of(wide.weights, dtype)));
      }
      // Without weights the kernel runs its one-pass online softmax: compared with its own float32
      // run, but where the AMX kernel takes the call (bfloat16 rows of unit stride on the AMX ISA).
      const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, o);
      const mha::Tensor plain32 = mha::scaled_dot_product_attention(q32, k32, v32, o);
      const bool tile_unit = (GetParam() == mha::detail::Isa::amx && dtype == mha::DType::bf16 && step == 1) || pairs;
      if (tile_unit) EXPECT_LT(rel_error(plain, plain32), 1e-2);
      else EXPECT_TRUE(mha_test::same_bits(plain, mha::Tensor::copy_of(plain32, dtype)));
      // Into a strided view ([B, L, H, Dv] storage), each row rounded as the kernel stores it.
      const mha::Tensor into = mha::Tensor::empty({2, lq, 4, dv}, dtype);
      mha::scaled_dot_product_attention_into(q, k, v, into.view().transpose(1, 2), o);
      EXPECT_TRUE(mha_test::same_bits(mha::Tensor::copy_of(into.view().transpose(1, 2), dtype), plain));
      if (lq > 512) {  // long: keys and values widened per chunk of heads; here one head per chunk
        std::atomic<int64_t>& chunk = mha::detail::widened_chunk_floats();
        const int64_t saved = chunk.exchange(1);
        const mha::Tensor chunked = mha::scaled_dot_product_attention(q, k, v, o);
        chunk = saved;
        EXPECT_TRUE(mha_test::same_bits(chunked, plain));
      }
      const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
      EXPECT_LT(rel_error(plain, ref.output), dtype == mha::DType::bf16 ? 1e-2 : 2e-3);
    }
  }
}

// float32 keys and values whose rows are not packed ([B, L, H, D] storage, a packed QKV
// projection) are copied packed once per head when enough query tasks share them (6; here 7 tasks
// of one head, 9 of a group of three, or 2: read in place). The arithmetic is the same, so are
// the bits of the kernel on packed copies: with masks, causality, dropout, grouped heads and the
// weights, in one chunk of heads or one head per chunk.
TEST_P(EveryIsa, UnpackedFloat32RowsGiveTheBitsOfPackedCopies) {
  std::mt19937_64 rng(test_seed());
  for (int variant = 0; variant < 4; ++variant) {
    const int64_t group = variant == 1 ? 3 : 1, hkv = 2, hq = hkv * group;
    const int64_t lq = variant == 0 ? 300 : variant == 1 ? 100 : variant == 2 ? 60 : 333, lk = variant == 3 ? 7 : 150;
    const int64_t dk = variant % 2 ? 24 : 40, dv = variant % 2 ? 8 : 40;
    // Queries from [B, Lq, Hq, Dk] storage; keys and values side by side in one [B, Lk, Hkv, Dk + Dv].
    const mha::Tensor qs = randn({2, lq, hq, dk}, rng), kvs = randn({2, lk, hkv, dk + dv}, rng);
    const mha::TensorView q = qs.view().transpose(1, 2), k = kvs.view().slice(3, 0, dk).transpose(1, 2),
                          v = kvs.view().slice(3, dk, dk + dv).transpose(1, 2);
    const mha::Tensor qc = mha::Tensor::copy_of(q), kc = mha::Tensor::copy_of(k), vc = mha::Tensor::copy_of(v);
    const mha::Tensor mask = randn({lq, lk}, rng);
    mha::SdpaOptions o{.is_causal = variant != 1, .enable_gqa = true};
    if (variant == 0) o.attn_mask = mask.view();
    if (variant == 1) o.dropout_p = 0.3, o.dropout_seed = rng();
    if (variant == 3) o.causal_alignment = mha::CausalAlignment::BottomRight;
    SCOPED_TRACE("variant " + std::to_string(variant));
    const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, o);
    EXPECT_TRUE(mha_test::same_bits(out, mha::scaled_dot_product_attention(qc, kc, vc, o)));
    const auto with_weights = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    const auto packed = mha::scaled_dot_product_attention_with_weights(qc, kc, vc, o);
    EXPECT_TRUE(mha_test::same_bits(with_weights.output, packed.output));
    EXPECT_TRUE(mha_test::same_bits(with_weights.weights, packed.weights));
    std::atomic<int64_t>& chunk = mha::detail::widened_chunk_floats();
    const int64_t saved = chunk.exchange(1);  // one head per chunk
    const mha::Tensor chunked = mha::scaled_dot_product_attention(q, k, v, o);
    chunk = saved;
    EXPECT_TRUE(mha_test::same_bits(chunked, out));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    EXPECT_LT(rel_error(out, ref.output), score_tolerance(q, k, 1.0 / std::sqrt(static_cast<double>(dk))));
  }
}

// The head-averaged weights (the module's default) come from the kernel directly: summed inside
// tasks that take every head of their query rows (here on 1 thread), or, with too few such tasks
// for the threads (here 7), from per-head weights averaged afterwards. Both give the same bits,
// the mean of the reference's weights within tolerance, and the output of a call without weights
// bit for bit (weights are kept from the one softmax pass, not recomputed). Cases: grouped heads,
// masks, both causal alignments with rows that see no key, dropout, a score ramp that raises the
// max by hundreds across key blocks (the first blocks' weights flush to zero, as they should) or
// rows whose first key block is masked out, unpacked rows copied in chunks of whole batch
// entries, bfloat16 inputs, and decoding (2 queries of 2 heads per key/value head, dot mode, over
// 1500 keys in runs: per-head weights averaged afterwards whatever the threads).
TEST_P(EveryIsa, HeadAveragedWeightsAreTheMeanOfTheHeadsOnEitherSchedule) {
  std::mt19937_64 rng(test_seed());
  for (int variant = 0; variant < 6; ++variant) {
    const int64_t group = variant == 0 || variant == 5 ? 2 : 1, hkv = variant == 4 ? 3 : 2, hq = hkv * group;
    const int64_t b = variant == 4 ? 1 : variant == 3 ? 2 : 3;
    const int64_t lq = variant == 3 ? 300 : variant == 4 ? 530 : variant == 2 ? 90 : variant == 5 ? 2 : 100;
    const int64_t lk = variant == 2 ? 200 : variant == 3 ? 150 : variant == 5 ? 1500 : 70;
    const int64_t dk = variant % 2 ? 24 : 40, dv = variant % 2 ? 16 : 40;
    const mha::DType dtype = variant == 4 ? mha::DType::bf16 : mha::DType::f32;
    const mha::Tensor qs = randn({b, lq, hq, dk}, rng, dtype), ks = randn({b, lk, hkv, dk}, rng, dtype),
                      vs = randn({b, lk, hkv, dv}, rng, dtype);
    // [B, L, H, D] storage: rows that are not packed (copied packed in chunks for variant 3).
    const mha::TensorView q = qs.view().transpose(1, 2), k = ks.view().transpose(1, 2), v = vs.view().transpose(1, 2);
    mha::Tensor mask = randn({lq, lk}, rng);
    mha::SdpaOptions o{.enable_gqa = true};
    if (variant == 0) o.is_causal = true, o.attn_mask = mask.view();
    if (variant == 1) o.dropout_p = 0.3, o.dropout_seed = rng();
    if (variant == 2) {  // bottom-right, Lq < Lk; a ramp up to the last key, or no key in the first block
      o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) mask.data<float>()[i * lk + j] = i % 3 == 0 ? 3.0f * (j - lk) : j < 64 ? -INFINITY : 0.0f;
      o.attn_mask = mask.view();
    }
    if (variant == 3) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;  // Lq > Lk: empty rows
    if (variant == 5) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight, o.attn_mask = mask.view();
    SCOPED_TRACE("variant " + std::to_string(variant));
    mha::detail::AttentionProblem p = mha::detail::make_sdpa_problem(q, k, v, o, mha::detail::InputDtypes::fused);

    auto run = [&](int threads, bool average, mha::Tensor& weights) {
      mha::Tensor out = mha::Tensor::empty({b, hq, lq, dv}, dtype);
      mha::detail::ForwardOutputs fo;
      fo.out = out.view().data;
      fo.out_dtype = dtype;
      for (int d = 0; d < 4; ++d) fo.out_strides[d] = out.view().strides[d];
      weights = average ? mha::Tensor::empty({b, lq, lk}) : mha::Tensor::empty({b, hq, lq, lk});
      float* poison = weights.data<float>();
      std::fill_n(poison, weights.numel(), NAN);
      if (average) {
        fo.average_weights = weights.data<float>();
      } else {
        fo.weights = weights.data<float>();
        for (int d = 0; d < 4; ++d) fo.weights_strides[d] = weights.view().strides[d];
      }
      p.num_threads = threads;
      mha::detail::run_attention(p, fo);
      return out;
    };
    mha::Tensor in_tasks, afterwards, per_head;
    const mha::Tensor out = run(1, true, in_tasks);
    EXPECT_TRUE(mha_test::same_bits(run(7, true, afterwards), out));
    EXPECT_TRUE(mha_test::same_bits(afterwards, in_tasks));
    std::atomic<int64_t>& chunk = mha::detail::widened_chunk_floats();
    const int64_t saved = chunk.exchange(1);  // a chunk of one head rounds up to one batch entry
    mha::Tensor chunked;
    run(1, true, chunked);
    chunk = saved;
    EXPECT_TRUE(mha_test::same_bits(chunked, in_tasks));
    EXPECT_TRUE(mha_test::same_bits(run(2, false, per_head), out));
    o.num_threads = 2;
    const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, o);
    if ((GetParam() == mha::detail::Isa::amx && dtype == mha::DType::bf16) || mha_test::pair_products_forward(dtype, lq, dk)) {
      // Without weights, bfloat16 runs the AMX kernel, or the pair products with the exponential
      // sized for bfloat16 (with them, the float32 one).
      EXPECT_LT(rel_error(plain, out), 1e-2);
    } else {
      EXPECT_TRUE(mha_test::same_bits(out, plain));
    }

    // The mean over the heads of the reference's weights, in float64.
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const mha::Tensor rw = mha::Tensor::copy_of(ref.weights, mha::DType::f64);
    mha::Tensor mean = mha::Tensor::zeros({b, lq, lk}, mha::DType::f64);
    for (int64_t n = 0; n < b; ++n)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t e = 0; e < lq * lk; ++e)
          mean.data<double>()[n * lq * lk + e] += rw.data<double>()[(n * hq + h) * lq * lk + e] / static_cast<double>(hq);
    // bfloat16 inputs widen exactly: the weights keep float32's tolerance; the output is rounded.
    const double tolerance = score_tolerance(q, k, 1.0 / std::sqrt(static_cast<double>(dk)), o.attn_mask ? &*o.attn_mask : nullptr);
    EXPECT_LT(rel_error(in_tasks, mean), tolerance);
    EXPECT_LT(rel_error(per_head, ref.weights), tolerance);
    EXPECT_LT(rel_error(out, ref.output), dtype == mha::DType::bf16 ? 1e-2 : tolerance);
  }
}

// A bfloat16 output is the float32 output of the same call rounded once, bfloat16(x), bit for bit
// (the kernels that round O^T as pairs of dims, and those that round element by element): every
// Dv parity and tail of a 16-word block, rows of unit stride and strided views, partial query
// panels, outputs in bfloat16's subnormal range (values scaled by 2^-124, outputs below 2^-126:
// the conversion must keep them, not flush them) and NaN rows (a NaN value, seen by the causal rows after it).
TEST_P(EveryIsa, BfloatOutputIsTheFloat32OutputRounded) {
  std::mt19937_64 rng(test_seed());
  for (int variant = 0; variant < 6; ++variant) {
    const int64_t b = 2, hkv = 2, hq = variant % 2 ? 4 : 2, lq = std::vector<int64_t>{100, 48, 130, 37, 200, 64}[variant];
    const int64_t lk = variant < 3 ? 70 : 150, dk = variant % 3 ? 64 : 40;
    const int64_t dv = std::vector<int64_t>{1, 7, 33, 64, 72, 40}[variant];
    const mha::Tensor q = randn({b, hq, lq, dk}, rng, mha::DType::bf16), k = randn({b, hkv, lk, dk}, rng, mha::DType::bf16);
    mha::Tensor v64 = randn({b, hkv, lk, dv}, rng, mha::DType::f64);
    double* vd = v64.data<double>();
    for (int64_t i = 0; i < lk * dv; ++i) vd[i] = std::ldexp(vd[i], -124);  // batch 0, head 0: subnormal outputs
    if (variant >= 2) vd[(hkv * lk + 20) * dv] = NAN;  // batch 1, head 0, key 20
    const mha::Tensor v = mha::Tensor::copy_of(v64, mha::DType::bf16);
    const mha::SdpaOptions o{.is_causal = variant >= 2, .enable_gqa = hq != hkv};
    SCOPED_TRACE("variant " + std::to_string(variant));
    const mha::detail::AttentionProblem p = mha::detail::make_sdpa_problem(q, k, v, o, mha::detail::InputDtypes::fused);
    auto run = [&](const mha::TensorView& out) {
      mha::detail::ForwardOutputs fo;
      fo.out = out.data;
      fo.out_dtype = out.dtype;
      for (int d = 0; d < 4; ++d) fo.out_strides[d] = out.strides[d];
      mha::detail::run_attention(p, fo);
    };
    const mha::Tensor out32 = mha::Tensor::empty({b, hq, lq, dv});
    run(out32.view());
    const mha::Tensor want = mha::Tensor::copy_of(out32, mha::DType::bf16);
    const mha::Tensor packed = mha::Tensor::empty({b, hq, lq, dv}, mha::DType::bf16);
    run(packed.view());
    EXPECT_TRUE(mha_test::same_bits(packed, want));
    const mha::Tensor rows = mha::Tensor::empty({b, lq, hq, dv + 3}, mha::DType::bf16);  // [B, L, H, Dv] rows with a gap
    run(rows.view().slice(-1, 0, dv).transpose(1, 2));
    EXPECT_TRUE(mha_test::same_bits(mha::Tensor::copy_of(rows.view().slice(-1, 0, dv).transpose(1, 2)), want));
    const mha::Tensor columns = mha::Tensor::empty({b, hq, dv, lq}, mha::DType::bf16);  // element stride Lq
    run(columns.view().transpose(2, 3));
    EXPECT_TRUE(mha_test::same_bits(mha::Tensor::copy_of(columns.view().transpose(2, 3)), want));
    // The cases are what they say: subnormal outputs, and NaN rows where a NaN value is seen.
    const auto* w = static_cast<const uint16_t*>(want.view().data);
    int64_t subnormal = 0, nan = 0;
    for (int64_t i = 0; i < want.numel(); ++i) subnormal += (w[i] & 0x7f80) == 0 && (w[i] & 0x7f) != 0, nan += (w[i] & 0x7fff) > 0x7f80;
    EXPECT_GT(subnormal, 0);
    if (variant >= 2) EXPECT_GT(nan, 0);
  }
}

// A mask that varies along the queries is copied transposed once per call, where the copy fits
// (mha::detail::transposed_mask_floats), a chunk of batch entries at a time where one entry's
// does, and read in place otherwise: all give the same bits,
// with and without weights, and the reference's values. Masks of every kind and broadcast: one
// [Lq, Lk] for all, one per batch entry, one per head, a transposed view, a tiny one; partial
// query and key blocks; causality and dropout on top; masks that exclude whole blocks (a causal
// mask given as a tensor, padding), which the copy lets tasks skip, and rows excluded entirely.
TEST_P(EveryIsa, TransposedMaskCopiesGiveTheBitsOfMasksReadInPlace) {
  std::mt19937_64 rng(test_seed());
  for (int variant = 0; variant < 9; ++variant) {
    const int64_t b = 2, hkv = 2, hq = 4, dk = 24, dv = 40;
    const int64_t lq = variant == 3 ? 37 : variant == 4 ? 130 : 100, lk = variant == 3 ? 7 : variant == 1 ? 200 : 150;
    const mha::Tensor q = randn({b, hq, lq, dk}, rng), k = randn({b, hkv, lk, dk}, rng), v = randn({b, hkv, lk, dv}, rng);
    mha::Tensor mask;
    mha::TensorView mask_view;
    if (variant == 0 || variant == 4) {  // additive, [Lq, Lk]
      mask = randn({lq, lk}, rng);
      mask_view = mask.view();
    } else if (variant == 1 || variant == 3) {  // bool (true attends), [B, 1, Lq, Lk] / [Lq, Lk]
      mask = variant == 1 ? mha::Tensor::empty({b, 1, lq, lk}, mha::DType::boolean) : mha::Tensor::empty({lq, lk}, mha::DType::boolean);
      std::bernoulli_distribution keep(0.7);
      for (int64_t i = 0; i < mask.numel(); ++i) mask.data<uint8_t>()[i] = keep(rng);
      mask_view = mask.view();
    } else if (variant == 2) {  // additive, one per head, as a transposed view of [B, Hq, Lk, Lq] storage
      mask = randn({b, hq, lk, lq}, rng);
      mask_view = mask.view().transpose(2, 3);
    } else if (variant == 5) {  // additive [Lq, Lk], -inf above the diagonal (a causal mask as a tensor)
      mask = randn({lq, lk}, rng);
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = i + 1; j < lk; ++j) mask.data<float>()[i * lk + j] = -std::numeric_limits<float>::infinity();
      mask_view = mask.view();
    } else if (variant == 8) {  // bool padding [B, Hq, 1, Lk] (read in place, its key blocks mapped): keys
                                // past 40 padded but one per head, the first or last of a block of
                                // 64 or 72 keys; against the same mask materialised [B, Hq, Lq, Lk]
      mask = mha::Tensor::empty({b, hq, 1, lk}, mha::DType::boolean);
      const int64_t lone[] = {64, 127, 72, 143};
      for (int64_t n = 0; n < b; ++n)
        for (int64_t hh = 0; hh < hq; ++hh)
          for (int64_t j = 0; j < lk; ++j) mask.data<uint8_t>()[(n * hq + hh) * lk + j] = j < 40 || j == lone[hh % 4];
      mask_view = mask.view();
    } else if (variant == 7) {  // bool [B, Hq, Lq, Lk]: causal, and per head one key every query sees,
                                // alone in key blocks causality excludes (first or last of a block
                                // of 64 or 72 keys, kBlockK on each ISA)
      mask = mha::Tensor::empty({b, hq, lq, lk}, mha::DType::boolean);
      const int64_t lone[] = {64, 127, 72, 143};
      for (int64_t n = 0; n < b; ++n)
        for (int64_t hh = 0; hh < hq; ++hh)
          for (int64_t i = 0; i < lq; ++i)
            for (int64_t j = 0; j < lk; ++j)
              mask.data<uint8_t>()[((n * hq + hh) * lq + i) * lk + j] = j <= i || j == lone[hh % 4];
      mask_view = mask.view();
    } else {  // bool [B, 1, Lq, Lk]: causal, keys past a per-batch length padded, a few rows with
              // no key, and rows that see every key, alone in their block of 48 queries (the
              // first of each in batch entry 0, the last in 1) where the others see none
      mask = mha::Tensor::empty({b, 1, lq, lk}, mha::DType::boolean);
      auto sees_all = [](int64_t n, int64_t i) { return n == 0 ? i % 48 == 0 : (i % 48 == 47 || i == 99); };
      for (int64_t n = 0; n < b; ++n)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = 0; j < lk; ++j)
            mask.data<uint8_t>()[(n * lq + i) * lk + j] =
                sees_all(n, i) || (j <= i && j < lk - 70 * n && !(n == 1 && i % 50 == 3));
      mask_view = mask.view();
    }
    mha::SdpaOptions o{.attn_mask = mask_view, .enable_gqa = true};
    if (variant == 0 || variant == 3) o.is_causal = true;
    if (variant == 4) o.dropout_p = 0.2, o.dropout_seed = rng();
    SCOPED_TRACE("variant " + std::to_string(variant));
    const mha::Tensor copied = mha::scaled_dot_product_attention(q, k, v, o);
    const auto copied_w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    std::atomic<int64_t>& cap = mha::detail::transposed_mask_floats();
    // A cap of one batch entry's copy (its heads' slices of 144 x Lk floats: Lq = 100 in 48-query
    // blocks): a mask that varies along the batch is copied one entry at a time, the others read in place.
    const int64_t per_entry = (mask_view.strides[1] != 0 && mask_view.shape[1] > 1 ? hq : 1) * 144 * lk;
    const int64_t saved = cap.exchange(per_entry);
    const mha::Tensor chunked = mha::scaled_dot_product_attention(q, k, v, o);
    const auto chunked_w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    cap = 0;  // every mask read in place
    mha::SdpaOptions unmapped = o;  // (a padding mask materialised: read in place, no block skipped)
    mha::Tensor materialised;
    if (variant == 8) {
      const mha::TensorView& m = mask_view;
      materialised = mha::Tensor::copy_of(
          mha::TensorView(m.data, m.dtype, {b, hq, lq, lk}, {m.strides[0], m.strides[1], 0, m.strides[3]}));
      unmapped.attn_mask = materialised.view();
    }
    const mha::Tensor in_place = mha::scaled_dot_product_attention(q, k, v, unmapped);
    const auto in_place_w = mha::scaled_dot_product_attention_with_weights(q, k, v, unmapped);
    mha::detail::skips_excluded_blocks() = false;  // and every block computed
    const mha::Tensor computed = mha::scaled_dot_product_attention(q, k, v, o);
    mha::detail::skips_excluded_blocks() = true;
    cap = saved;
    EXPECT_TRUE(mha_test::same_bits(copied, computed));
    EXPECT_TRUE(mha_test::same_bits(in_place, computed));
    EXPECT_TRUE(mha_test::same_bits(copied, in_place));
    EXPECT_TRUE(mha_test::same_bits(chunked, computed));
    EXPECT_TRUE(mha_test::same_bits(chunked_w.weights, in_place_w.weights));
    EXPECT_TRUE(mha_test::same_bits(copied_w.weights, in_place_w.weights));
    EXPECT_TRUE(mha_test::same_bits(copied_w.output, copied));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const double tolerance = score_tolerance(q, k, 1.0 / std::sqrt(static_cast<double>(dk)));
    EXPECT_LT(rel_error(copied, ref.output), tolerance);
    EXPECT_LT(rel_error(copied_w.weights, ref.weights), tolerance);
  }
}

// The query rows per key/value head up to which the decoding kernel scores by dot products of
// whole rows (few_queries.hpp's kDotRows): 32 where rows share each key vector loaded (AVX-512),
// 8 where partial sums are added in registers (AVX2), else 4 (the AMX level: 4 too, where its
// tile kernel takes 16-bit calls of more queries).
int64_t dot_mode_rows(mha::detail::Isa isa) {
  switch (isa) {
    case mha::detail::Isa::avx512:
    case mha::detail::Isa::avx512_bf16: return 32;
    case mha::detail::Isa::avx2: return 8;
    default: return 4;
  }
}

// Up to 32 queries per head (decoding, speculative decoding, short prompt chunks) run their own
// kernel: queries as rows, lanes over 48 keys, the query heads of a group in one task, long caches
// in runs of 1008 keys merged afterwards, a group's rows split into chunks where tasks are few.
// Against the reference on every ISA: 1-32 queries, groups of 1-8 heads, caches from 1 key to 3 runs, head
// dimensions that are not whole vectors, float32/bfloat16/float16, every mask kind and broadcast,
// both causal alignments, dropout, [B, L, H, D] views; the same bits on 1 and 3 threads; the log-sum-exp
// through the backward's gradients; fully masked rows give zeros; a NaN query gives a NaN row.
// Outputs are judged against the larger of their largest element and their terms' size
// (mha_test::terms_magnitude: a lone query's few outputs can all cancel).
TEST_P(EveryIsa, FewQueriesPerHeadAgainstReference) {
  std::mt19937_64 rng(test_seed());
  // Rows per key/value head in dot mode (few_queries.hpp: kDotRows), where the weights are
  // computed with the output (the same output bits as without them); past it, the tile kernel.
  const int64_t dot_rows = dot_mode_rows(GetParam());
  // Up to 32 queries per head: register blocks of every height, a run of keys split over tasks
  // (Lk > 1008) and short key blocks (Lk % 48, or a run's last vector of scores in dot mode, up to
  // 32, 8 or 4 queries per key/value head), key rows transposed in place (Dk % 8 == 0) and copied (20), rows
  // prefetched (128), value rows of 1 to 5 vectors.
  const int64_t key_lengths[] = {1, 5, 16, 17, 100, 1008, 1025, 2100};
  const int64_t query_lengths[] = {1, 2, 3, 4, 5, 7, 13, 32};
  const int64_t dims[] = {8, 24, 64, 72, 20, 128};  // 128: rows prefetched
  const int64_t value_dims[] = {16, 40, 48, 80};
  for (int n = 0; n < 64; ++n) {
    const int64_t lq = query_lengths[(n + n / 8) % 8], group = n % 3 == 0 ? 1 : n % 3 == 1 ? 3 : 8, hkv = 1 + n % 2,
                  hq = hkv * group;
    const int64_t b = 1 + (n / 2) % 2, lk = key_lengths[n % 8], dk = dims[(n / 3) % 6], dv = value_dims[(n / 5) % 4];
    const mha::DType dtype = n % 6 == 4 ? mha::DType::bf16 : n % 6 == 5 ? mha::DType::f16 : mha::DType::f32;
    const mha::Tensor qs = randn({b, lq, hq, dk}, rng, dtype), ks = randn({b, lk, hkv, dk}, rng, dtype),
                      vs = randn({b, lk, hkv, dv}, rng, dtype);
    const mha::TensorView q = qs.view().transpose(1, 2), k = ks.view().transpose(1, 2), v = vs.view().transpose(1, 2);
    mha::Tensor mask;
    mha::SdpaOptions o{.enable_gqa = true};
    const int kind = (n / 4) % 4;
    std::bernoulli_distribution keep(0.8);
    if (kind == 1) mask = randn({lq, lk}, rng);
    if (kind == 2) mask = mha::Tensor::empty({b, 1, 1, lk}, mha::DType::boolean);
    if (kind == 3) mask = mha::Tensor::empty({b, hq, lq, lk}, mha::DType::boolean);
    if (kind >= 2) for (int64_t e = 0; e < mask.numel(); ++e) mask.data<uint8_t>()[e] = keep(rng);
    if (kind > 0) o.attn_mask = mask.view();
    if (n % 5 == 1) o.is_causal = true;
    if (n % 5 == 2) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
    if (n % 5 == 3 || n % 9 == 2) o.dropout_p = 0.3, o.dropout_seed = rng();  // the reference draws the same mask
    SCOPED_TRACE("case " + std::to_string(n) + ": Lq=" + std::to_string(lq) + " group=" + std::to_string(group) +
                 " Lk=" + std::to_string(lk) + " Dk=" + std::to_string(dk) + " " + std::string(mha::dtype_name(dtype)) +
                 " mask=" + std::to_string(kind) + " dropout=" + std::to_string(o.dropout_p));
    const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, o);
    o.num_threads = 1;
    const mha::Tensor one = mha::scaled_dot_product_attention(q, k, v, o);
    o.num_threads = 3;
    EXPECT_TRUE(mha_test::same_bits(one, mha::scaled_dot_product_attention(q, k, v, o)));
    EXPECT_TRUE(mha_test::same_bits(one, out));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const double tolerance = dtype == mha::DType::bf16   ? 1e-2
                             : dtype == mha::DType::f16 ? 2e-3
                                                        : score_tolerance(q, k, 1.0 / std::sqrt(static_cast<double>(dk)));
    EXPECT_LT(rel_error(out, ref.output, mha_test::terms_magnitude(q, k, v, o)), tolerance);
    if (dtype == mha::DType::f32 && n % 2 == 0) {  // the saved log-sum-exp, through the backward
      const mha::Tensor go = randn({b, hq, lq, dv}, rng);
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      EXPECT_TRUE(mha_test::same_bits(saved.output, out));
      const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o);
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, go, o);
      const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
      EXPECT_LT(rel_error(g.query, r.query, floor), 1e-4);
      EXPECT_LT(rel_error(g.key, r.key, floor), 1e-4);
      EXPECT_LT(rel_error(g.value, r.value, floor), 1e-4);
    }
  }
  // Dot mode (up to 32 queries per key/value head on AVX-512, 8 on AVX2, 4 elsewhere; all of them
  // here, or two fewer per head: rows in blocks of 4 and the rest) where the
  // rows of a task see different keys: bottom-right causal rows with fewer keys than queries (rows
  // that see none, one key, and more), and a cache split into runs; prefetched and copied key rows;
  // 16-bit rows of whole vectors read in place (float16 keys and values, bfloat16 values) and
  // widened first (bfloat16 keys of 20).
  for (int n = 0; n < 8; ++n) {
    const int64_t lq = n % 2 == 0 ? dot_rows : std::max<int64_t>(dot_rows / 2 - 1, 1), hkv = 2, group = n % 2 == 0 ? 1 : 2, lk = n < 4 ? 3 : 1500;
    const int64_t dk = n % 4 < 2 ? 64 : n % 4 == 2 ? 128 : 20;
    const mha::DType dtype = n == 3 ? mha::DType::bf16 : n == 5 ? mha::DType::f16 : mha::DType::f32;
    const mha::Tensor q = randn({1, hkv * group, lq, dk}, rng, dtype), k = randn({1, hkv, lk, dk}, rng, dtype),
                      v = randn({1, hkv, lk, 48}, rng, dtype), mask = randn({lq, lk}, rng);
    mha::SdpaOptions o{.attn_mask = mask.view(), .is_causal = true, .enable_gqa = true};
    // Top-left in cases 3, 6 and 7: the rows see the first Lq keys only, so a run has keys no row
    // of it sees, and with 1500 keys the second run none at all.
    if (n % 4 != 3 && n != 6) o.causal_alignment = mha::CausalAlignment::BottomRight;
    // Dropout in cases 2, 5 and 7: the weights returned are the dropped ones, as PyTorch's are.
    if (n == 2 || n == 5 || n == 7) o.dropout_p = 0.25, o.dropout_seed = rng();
    SCOPED_TRACE("dot mode case " + std::to_string(n));
    const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, o);
    o.num_threads = 1;
    EXPECT_TRUE(mha_test::same_bits(out, mha::scaled_dot_product_attention(q, k, v, o)));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const double tolerance = dtype == mha::DType::bf16   ? 1e-2
                             : dtype == mha::DType::f16 ? 2e-3
                                                        : score_tolerance(q, k, 1.0 / std::sqrt(double(dk)));
    const double terms = mha_test::terms_magnitude(q, k, v, o);
    EXPECT_LT(rel_error(out, ref.output, terms), tolerance);
    // The weights come from dot mode too (the same output bits as without them, unless without
    // them bfloat16 pair products take the call): each run's probabilities scaled once the row's
    // statistics are final, rows that see no key all zero.
    // Odd cases write them through a view with the keys' stride not 1 ([B, Lk, Hq, Lq] storage).
    const bool pairs = mha_test::pair_products_forward(dtype, lq, dk);
    if (n % 2 == 0) {
      const mha::AttentionWithWeights w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
      if (!pairs) EXPECT_TRUE(mha_test::same_bits(w.output, out));
      EXPECT_LT(rel_error(w.output, ref.output, terms), tolerance);
      EXPECT_LT(rel_error(w.weights, ref.weights), tolerance);
    } else {
      const int64_t hq = hkv * group;
      const mha::Tensor storage = mha::Tensor::empty({1, lk, hq, lq}, dtype), got = mha::Tensor::empty({1, hq, lq, 48}, dtype);
      const mha::TensorView weights = storage.view().permute({0, 2, 3, 1});
      mha::Tensor nan = mha::Tensor::empty({1, lk, hq, lq});
      std::fill_n(nan.data<float>(), nan.numel(), NAN);
      std::memcpy(storage.view().data, mha::Tensor::copy_of(nan.view(), dtype).view().data,
                  storage.numel() * mha::dtype_size(dtype));  // so that every weight must be written
      mha::scaled_dot_product_attention_into(q, k, v, got.view(), o, weights);
      if (!pairs) EXPECT_TRUE(mha_test::same_bits(got, out));
      EXPECT_LT(rel_error(got, ref.output, terms), tolerance);
      EXPECT_LT(rel_error(weights, ref.weights), tolerance);
    }
  }
  // Rows with no visible key are zeros with an infinite log-sum-exp; a NaN query makes its row NaN.
  mha::Tensor q = randn({2, 3, 2, 24}, rng), k = randn({2, 1, 1500, 24}, rng), v = randn({2, 1, 1500, 16}, rng);
  mha::Tensor none = mha::Tensor::empty({2, 1, 1, 1500}, mha::DType::boolean);
  for (int64_t j = 0; j < 1500; ++j) none.data<uint8_t>()[j] = 0, none.data<uint8_t>()[1500 + j] = j % 7 == 0;
  q.data<float>()[(1 * 3 + 2) * 2 * 24 + 24 + 5] = NAN;  // batch 1, head 2, query 1
  const mha::SdpaOptions o{.attn_mask = none.view(), .enable_gqa = true};
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  for (int64_t e = 0; e < 3 * 2 * 16; ++e) EXPECT_EQ(saved.output.data<float>()[e], 0.0f) << e;
  for (int64_t e = 0; e < 3 * 2; ++e) EXPECT_EQ(saved.lse.data<float>()[e], INFINITY) << e;
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t d = 0; d < 16; ++d) {
        const float x = saved.output.at({1, h, i, d});
        EXPECT_EQ(std::isnan(x), h == 2 && i == 1) << h << " " << i << " " << d;
      }
  // Their weights likewise: zero rows, and a NaN row (in dot mode where the ISA takes 6 rows).
  const mha::AttentionWithWeights w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
  if (3 * 2 <= dot_rows) EXPECT_TRUE(mha_test::same_bits(w.output, saved.output));
  for (int64_t e = 0; e < 3 * 2 * 1500; ++e) EXPECT_EQ(w.weights.data<float>()[e], 0.0f) << e;
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 1500; j += 7) {
        const float x = w.weights.at({1, h, i, j});
        EXPECT_EQ(std::isnan(x), h == 2 && i == 1) << h << " " << i << " " << j;
      }
}

// Dot mode reads bfloat16, float16 and float8 key rows in place, each vector widened as it is
// loaded, and where a task has several rows (grouped heads, a few tokens) scores several of them
// against each key vector widened (few_queries.hpp: dot_scores_grid, on AVX2): the same chains and
// sums as one row at a time, so the bits of the float32 call on widened keys and values, its
// output rounded once. Every row count up to the ISA's dot mode (blocks of 4 and 2 rows and one
// left), head dims of whole vectors (read in place) and not (widened first), caches of one key
// to two runs, causal rows that see none.
TEST_P(EveryIsa, FewQueriesOfLowPrecisionRowsAreTheFloat32KernelOnWidenedRows) {
  std::mt19937_64 rng(test_seed());
  const int64_t dot_rows = dot_mode_rows(GetParam());
  const int64_t key_lengths[] = {1, 19, 300, 1500};
  const int64_t dims[] = {64, 128, 40};
  const mha::DType kv_dtypes[] = {mha::DType::bf16, mha::DType::f16, mha::DType::f8e4m3};
  for (int64_t rows = 1; rows <= dot_rows; ++rows) {
    const int n = static_cast<int>(rows);
    const int64_t group = rows % 2 == 0 && n % 4 != 0 ? 2 : 1, lq = rows / group, hkv = 2;
    const int64_t lk = key_lengths[n % 4], dk = dims[n % 3], dv = dims[(n + 1) % 3];
    const mha::DType kv_dtype = kv_dtypes[n % 3];
    // 16-bit keys and values come with queries of their dtype; float8 ones with float32 queries.
    const mha::DType dtype = kv_dtype == mha::DType::f8e4m3 ? mha::DType::f32 : kv_dtype;
    const mha::Tensor q = randn({2, hkv * group, lq, dk}, rng, dtype), k = randn({2, hkv, lk, dk}, rng, kv_dtype),
                      v = randn({2, hkv, lk, dv}, rng, kv_dtype);
    mha::SdpaOptions o{.is_causal = n % 2 == 1, .enable_gqa = true};
    if (n % 4 == 1) o.causal_alignment = mha::CausalAlignment::BottomRight;
    SCOPED_TRACE("rows per key/value head " + std::to_string(rows) + ": Lq=" + std::to_string(lq) + " group=" +
                 std::to_string(group) + " Lk=" + std::to_string(lk) + " Dk=" + std::to_string(dk) + " Dv=" +
                 std::to_string(dv) + " " + std::string(mha::dtype_name(kv_dtype)));
    const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, o);
    const mha::Tensor wide = mha::scaled_dot_product_attention(mha::Tensor::copy_of(q.view(), mha::DType::f32),
                                                               mha::Tensor::copy_of(k.view(), mha::DType::f32),
                                                               mha::Tensor::copy_of(v.view(), mha::DType::f32), o);
    // (bfloat16 pair products, on AVX512-BF16, round P for P V: within bfloat16 rounding there)
    if (mha_test::pair_products_forward(dtype, lq, dk)) EXPECT_LT(rel_error(out, wide), 1e-2);
    else EXPECT_TRUE(mha_test::same_bits(out, mha::Tensor::copy_of(wide.view(), dtype)));
  }
}

// A cache whose heads lie side by side at each position ([B, S, H, D], FlashAttention's layout)
// is read in dot mode by tasks of several heads sweeping the keys in order (few_queries.hpp:
// heads_per_task); every row's arithmetic is that of its head alone, so the output, weights and
// log-sum-exp are the bits of the same call on packed [B, H, S, D] copies (one head per task), on
// 1 to 3 threads: head counts that do and do not divide into the tasks, caches of one key to
// three runs, per-head masks whose excluded blocks differ between heads (skipped per head),
// causal rows that see no key, dropout, grouped heads, 16-bit rows, rows of 80 to 512 bytes.
TEST_P(EveryIsa, FewQueriesWithHeadsSideBySideGiveTheBitsOfPackedHeads) {
  std::mt19937_64 rng(test_seed());
  const int64_t dot_rows = dot_mode_rows(GetParam());
  const int64_t key_lengths[] = {1, 47, 300, 1008, 2100};
  for (int n = 0; n < 20; ++n) {
    const int64_t hkv = n % 4 == 0 ? 2 : n % 4 == 1 ? 3 : n % 4 == 2 ? 5 : 16, group = n % 3 == 2 ? 2 : 1;
    // (bf16 cases 5 and 17 take 3 queries: 6 rows, dot mode in pair products where the ISA has them)
    const int64_t lq = n % 2 == 0 ? 1 : n % 6 == 5 && n % 4 == 1 ? 3 : dot_rows / group, hq = hkv * group,
                  b = 1 + n % 3, lk = key_lengths[n % 5];
    // (rows of 256 and 512 bytes: a sweep over heads side by side takes 8 and 4 keys of a head at a time)
    const int64_t dk = n % 5 == 3 ? 20 : n % 4 == 3 || n % 6 == 5 ? 128 : 64, dv = n % 7 == 2 ? 40 : n % 7 == 5 ? 128 : 64;
    const mha::DType dtype = n % 6 == 5 ? mha::DType::bf16 : n % 6 == 4 ? mha::DType::f16 : mha::DType::f32;
    const mha::Tensor ks = randn({b, lk, hkv, dk}, rng, dtype), vs = randn({b, lk, hkv, dv}, rng, dtype);
    const mha::Tensor q = randn({b, hq, lq, dk}, rng, dtype);
    const mha::TensorView k = ks.view().transpose(1, 2), v = vs.view().transpose(1, 2);
    const mha::Tensor k_packed = mha::Tensor::copy_of(k), v_packed = mha::Tensor::copy_of(v);
    mha::SdpaOptions o{.enable_gqa = group > 1};
    mha::Tensor mask;
    if (n % 4 == 1) {  // per head: head h keeps keys from 100 h on (whole blocks skipped for some heads only)
      mask = mha::Tensor::empty({b, hq, lq, lk}, mha::DType::boolean);
      for (int64_t x = 0; x < mask.numel(); ++x) {
        const int64_t j = x % lk, h = x / (lq * lk) % hq;
        mask.data<uint8_t>()[x] = j >= std::min(100 * h, lk - 1);
      }
      o.attn_mask = mask.view();
    }
    // top-left: rows past key 0 see few keys, a second run none (not bf16 case 17: its 300 keys are
    // the pair scores' steps of 8 keys over heads side by side)
    if (n % 5 == 2 && n != 17) o.is_causal = true;
    if (n % 5 == 4) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
    if (n % 7 == 3) o.dropout_p = 0.2, o.dropout_seed = rng();
    SCOPED_TRACE("case " + std::to_string(n) + ": Hkv=" + std::to_string(hkv) + " group=" + std::to_string(group) +
                 " Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk) + " " + std::string(mha::dtype_name(dtype)));
    for (int threads : {1, 2, 3}) {
      o.num_threads = threads;
      const auto side = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto packed = mha::scaled_dot_product_attention_for_training(q, k_packed, v_packed, o);
      EXPECT_TRUE(mha_test::same_bits(side.output, packed.output)) << threads << " threads";
      EXPECT_TRUE(mha_test::same_bits(side.lse, packed.lse)) << threads << " threads";
      if (dtype != mha::DType::f16) {
        const auto side_w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
        const auto packed_w = mha::scaled_dot_product_attention_with_weights(q, k_packed, v_packed, o);
        EXPECT_TRUE(mha_test::same_bits(side_w.weights, packed_w.weights)) << threads << " threads";
        EXPECT_TRUE(mha_test::same_bits(side_w.output, packed_w.output)) << threads << " threads";
        // and the output bits of the call without weights where dot mode takes both (unless
        // bfloat16 pair products take that one)
        if (lq * group <= dot_rows && !mha_test::pair_products_forward(dtype, lq, dk))
          EXPECT_TRUE(mha_test::same_bits(side_w.output, packed.output)) << threads << " threads";
      }
    }
  }
}

// The few-queries kernel skips key blocks (48 keys) a mask excludes for every row of a task: the
// left padding of a batch of generations, a query-varying mask with -inf blocks. Skipping changes
// no bit of the output, the weights or the log-sum-exp (against every block computed, 1 thread
// against 3) and keeps the reference's values: panel and dot mode, one query and several, groups
// of heads whose rows differ (one head sees a lone key where the others see none), a lone
// visible key at either edge of a block, caches split into runs (runs with every block skipped),
// dropout, and rows with no visible key at all.
TEST_P(EveryIsa, FewQueriesSkipWhatAMaskExcludes) {
  std::mt19937_64 rng(test_seed());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int n = 0; n < 12; ++n) {
    const int64_t lq = n % 4 == 0 ? 1 : n % 4 == 1 ? 2 : n % 4 == 2 ? 8 : 32, hkv = 2, group = n % 3 == 0 ? 1 : 4;
    const int64_t hq = hkv * group, b = 3, lk = n < 6 ? 2100 : 300, dk = n % 2 == 0 ? 64 : 20, dv = 40;
    const mha::DType dtype = n == 5 ? mha::DType::bf16 : mha::DType::f32;
    const mha::Tensor q = randn({b, hq, lq, dk}, rng, dtype), k = randn({b, hkv, lk, dk}, rng, dtype),
                      v = randn({b, hkv, lk, dv}, rng, dtype);
    // Entry 0 sees every key, entry 1 the last third and 60 more per query, entry 2 the last 5 keys and one lone key:
    // the first key of a block (n even) or the last (n odd), in head 1 only (n % 3 == 2).
    const int64_t lone = n % 2 == 0 ? 96 : 143;
    auto visible = [&](int64_t e, int64_t h, int64_t i, int64_t j) {
      if (e == 0) return n % 6 != 4 || j <= lk - lq + i;  // (n % 6 == 4: causal from the bottom right as well)
      if (e == 1) return j >= 2 * lk / 3 - 60 * i;  // (later queries see blocks earlier ones do not)
      return j >= lk - 5 || (j == lone && (n % 3 != 2 || h == 1));
    };
    mha::Tensor mask;
    if (n % 3 == 0) {  // bool [B, 1, 1, Lk]: a key padding mask, per key block (one row per query)
      mask = mha::Tensor::empty({b, 1, 1, lk}, mha::DType::boolean);
      for (int64_t e = 0; e < b; ++e)
        for (int64_t j = 0; j < lk; ++j) mask.data<uint8_t>()[e * lk + j] = visible(e, 0, lq - 1, j);
    } else {  // additive [B, Hq, Lq, Lk]: random values where visible, -inf elsewhere
      mask = randn({b, hq, lq, lk}, rng);
      for (int64_t e = 0; e < b; ++e)
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t i = 0; i < lq; ++i)
            for (int64_t j = 0; j < lk; ++j)
              if (!visible(e, h, i, j)) mask.data<float>()[((e * hq + h) * lq + i) * lk + j] = neg_inf;
    }
    mha::SdpaOptions o{.attn_mask = mask.view(), .enable_gqa = group > 1};
    if (n % 5 == 3) o.dropout_p = 0.2, o.dropout_seed = rng();
    SCOPED_TRACE("case " + std::to_string(n) + ": Lq=" + std::to_string(lq) + " group=" + std::to_string(group) +
                 " Lk=" + std::to_string(lk) + " Dk=" + std::to_string(dk));
    const auto skipped = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto skipped_w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    o.num_threads = 3;
    const mha::Tensor three = mha::scaled_dot_product_attention(q, k, v, o);
    o.num_threads = 1;
    mha::detail::skips_excluded_blocks() = false;  // and every block computed
    const auto computed = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto computed_w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    mha::detail::skips_excluded_blocks() = true;
    EXPECT_TRUE(mha_test::same_bits(skipped.output, computed.output));
    EXPECT_TRUE(mha_test::same_bits(skipped.lse, computed.lse));
    EXPECT_TRUE(mha_test::same_bits(skipped_w.weights, computed_w.weights));
    EXPECT_TRUE(mha_test::same_bits(skipped_w.output, computed_w.output));
    EXPECT_TRUE(mha_test::same_bits(three, skipped.output));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const double tolerance = dtype == mha::DType::bf16 ? 1e-2 : score_tolerance(q, k, 1.0 / std::sqrt(double(dk)));
    EXPECT_LT(rel_error(skipped.output, ref.output, mha_test::terms_magnitude(q, k, v, o)), tolerance);
    EXPECT_LT(rel_error(skipped_w.weights, ref.weights), dtype == mha::DType::bf16 ? 1e-2 : tolerance);
  }
}

// Hugging Face's float masks put finfo.min, not -inf, where a key is hidden. Blocks of such
// values (kSwamped in src/cpu/excluded_keys.hpp) are skipped only for tasks whose rows all see an
// ordinary key, where they weigh exactly nothing; rows that see none (a left-padded prompt's
// padding) give uniform weight to those keys (leading ones are written from the mask, the others
// computed whole). The same bits as every block computed, on the tile kernel (mask copied whole, per batch entry, in place) and the
// few-queries kernel (one and several queries, a cache split into runs), 1 and 3 threads: causal
// masks left-padded and right-padded, values between the thresholds (-1e35: neither swamped nor
// ordinary), -3e38 (which overflows once scaled), and ordinary keys alone at block edges.
TEST_P(EveryIsa, SwampedBlocksAreSkippedOnlyWhereExact) {
  std::mt19937_64 rng(test_seed());
  const float lowest = std::numeric_limits<float>::lowest();
  for (int n = 0; n < 8; ++n) {
    const int64_t lq = n < 2 ? 1 : n < 4 ? 4 : n < 6 ? 100 : 130, lk = n < 4 ? (n % 2 == 0 ? 1100 : 150) : lq + 20;
    const int64_t b = 3, hq = 4, hkv = 2, dk = 24, dv = 16;
    const mha::Tensor q = randn({b, hq, lq, dk}, rng), k = randn({b, hkv, lk, dk}, rng), v = randn({b, hkv, lk, dv}, rng);
    // Causal from the bottom right; entry 1 left-padded (its first 60 keys and query rows that see
    // only those), entry 2 right-padded (keys past lk - 50) or, where n % 4 == 1, entirely.
    mha::Tensor mask = mha::Tensor::zeros({b, 1, lq, lk});
    for (int64_t e = 0; e < b; ++e)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          float& x = mask.data<float>()[(e * lq + i) * lk + j];
          const bool hidden = j > i + lk - lq || (e == 1 && j < 60) || (e == 2 && (j >= lk - 50 || n % 4 == 1));
          if (hidden) x = j % 5 == 0 && e < 2 ? -3e38f : lowest;
          if (n % 3 == 2 && e == 0 && j >= 48 && j < 96) x = -1e35f;  // a block between the thresholds
          if (e == 1 && j == (n % 2 == 0 ? 48 : 47) && i >= lq / 2) x = 0.0f;  // a lone ordinary key at a block edge
          if (e == 0 && i == (n % 2 == 0 ? 47 : 48)) x = lowest;  // a row with no ordinary key, last or first of its block
        }
    SCOPED_TRACE("case " + std::to_string(n) + ": Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk));
    mha::SdpaOptions o{.attn_mask = mask.view(), .enable_gqa = true};
    std::atomic<int64_t>& cap = mha::detail::transposed_mask_floats();
    const int64_t saved = cap.load();
    std::vector<mha::Tensor> outs, lses;
    for (const int64_t c : {saved, 144 * lk, int64_t{0}}) {  // copied whole, per batch entry, read in place
      cap = c;
      for (const int threads : {1, 3}) {
        o.num_threads = threads;
        const auto r = mha::scaled_dot_product_attention_for_training(q, k, v, o);
        outs.push_back(mha::Tensor::copy_of(r.output.view())), lses.push_back(mha::Tensor::copy_of(r.lse.view()));
      }
    }
    mha::detail::skips_excluded_blocks() = false;  // and every block computed
    const auto computed = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    mha::detail::skips_excluded_blocks() = true;
    cap = saved;
    // Leading rows that see no ordinary key (entry 1's first rows, entry 2 when entirely padded)
    // come from the mask, the mean of the values in double (mask_only_rows.hpp): within float32
    // rounding of the kernel's online softmax there; every other row has the kernel's bits.
    auto from_the_mask = [&](int64_t e, int64_t i) { return (e == 2 && n % 4 == 1) || (e == 1 && i + lk - lq < 60); };
    for (size_t c = 0; c < outs.size(); ++c) {
      EXPECT_TRUE(mha_test::same_bits(lses[c], computed.lse)) << c;
      for (int64_t e = 0; e < b; ++e)
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t i = 0; i < lq; ++i)
            for (int64_t d = 0; d < dv; ++d) {
              const float got = outs[c].at({e, h, i, d}), want = computed.output.at({e, h, i, d});
              if (from_the_mask(e, i)) ASSERT_NEAR(got, want, 1e-6) << c << " " << e << " " << i;
              else ASSERT_EQ(got, want) << c << " " << e << " " << h << " " << i << " " << d;
            }
    }
    // The entirely padded entry's rows: the mean of the values (uniform weights), not zeros.
    if (n % 4 == 1)
      for (int64_t d = 0; d < dv; ++d) {
        double mean = 0;
        for (int64_t j = 0; j < lk; ++j) mean += v.at({2, 0, j, d}) / static_cast<double>(lk);
        EXPECT_NEAR(computed.output.at({2, 0, 0, d}), mean, 1e-5) << d;
      }
  }
}

// Leading query rows whose scores are their mask values (a left-padded batch's padding under
// Hugging Face's finfo.min masks) are written from the mask, the mask's weighted mean of the
// values, and the kernel runs on the other rows of each batch entry (mask_only_rows.hpp). Against
// the float64 reference: padding of none, some, all and all but one row, per entry; the causal
// part of the mask at finfo.min too, or left to is_causal (bottom-right) as -inf; masks shared by
// the heads or one per head; a padded row mixing -1e38 and -2e38 (the weight on -1e38 alone);
// GQA; 1 to 130 queries (the few-queries kernel on what is left); bfloat16 inputs; an output
// written through a transposed view, and the training forward's log-sum-exp against the kernel's
// for every row. The prefixes are those expected, so the rows do come from the mask. float32
// within 1e-5 of the largest value; bfloat16 1e-2 (the output's rounding).
TEST_P(EveryIsa, MaskOnlyRowsComeFromTheMask) {
  std::mt19937_64 rng(test_seed());
  const float lowest = std::numeric_limits<float>::lowest();
  for (int n = 0; n < 6; ++n) {
    const int64_t lq = n < 2 ? 130 : n < 4 ? 37 : 3, lk = lq + (n % 2 == 0 ? 0 : 11);
    const int64_t b = 4, hq = 4, hkv = 2, dk = 24, dv = 16;
    const bool per_head = n % 3 == 1, with_is_causal = n % 2 == 1;
    const mha::DType dtype = n == 2 ? mha::DType::bf16 : mha::DType::f32;
    const mha::Tensor q = randn({b, hq, lq, dk}, rng, dtype), k = randn({b, hkv, lk, dk}, rng, dtype),
                      v = randn({b, hkv, lk, dv}, rng, dtype);
    const int64_t mask_heads = per_head ? hq : 1, shift = lk - lq;  // causal from the bottom right
    const int64_t pads[b] = {0, lk / 3, lk, std::max<int64_t>(lk - 1, 1)};  // entry e's first pads[e] keys
    mha::Tensor mask = mha::Tensor::zeros({b, mask_heads, lq, lk});
    for (int64_t e = 0; e < b; ++e)
      for (int64_t mh = 0; mh < mask_heads; ++mh)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = 0; j < lk; ++j) {
            float& x = mask.data<float>()[((e * mask_heads + mh) * lq + i) * lk + j];
            if (j < pads[e]) x = e == 1 && (j + mh) % 4 == 0 ? -1e38f : e == 1 ? -2e38f : lowest;
            else if (j > i + shift && !with_is_causal) x = lowest;
          }
    SCOPED_TRACE("case " + std::to_string(n) + ": Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk));
    mha::SdpaOptions o{.attn_mask = mask.view(), .enable_gqa = true};
    if (with_is_causal) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
    // Rows that see padding keys alone (with is_causal the future keys are excluded, not finfo.min).
    const mha::detail::AttentionProblem problem =
        mha::detail::make_sdpa_problem(q, k, v, o, mha::detail::InputDtypes::fused);
    const std::vector<int64_t> prefixes = mha::detail::mask_only_prefixes(problem, mha::detail::ForwardOutputs{});
    ASSERT_EQ(prefixes.size(), static_cast<size_t>(b));
    for (int64_t e = 0; e < b; ++e) {
      const int64_t expected = pads[e] >= lk ? lq : std::clamp<int64_t>(pads[e] - shift, 0, lq);
      EXPECT_EQ(prefixes[e], expected) << e;
    }
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const double tolerance = dtype == mha::DType::f32 ? 1e-5 : 1e-2, terms = mha_test::terms_magnitude(q, k, v, o);
    EXPECT_LE(rel_error(mha::scaled_dot_product_attention(q, k, v, o), ref.output, terms), tolerance);
    const auto trained = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    EXPECT_LE(rel_error(trained.output, ref.output, terms), tolerance);
    mha::Tensor storage = mha::Tensor::zeros({b, lq, hq, dv}, dtype);  // batch-first storage, viewed [B, H, L, D]
    mha::scaled_dot_product_attention_into(q, k, v, storage.view().transpose(1, 2), o);
    EXPECT_LE(rel_error(storage.view().transpose(1, 2), ref.output, terms), tolerance);
    mha::detail::skips_excluded_blocks() = false;  // every row through the kernel
    const auto computed = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    mha::detail::skips_excluded_blocks() = true;
    // (The rows after a prefix may run another kernel than all of them together: a last row
    // alone runs the few-queries kernel. Its rounding differs.)
    EXPECT_LE(rel_error(trained.lse, computed.lse), 1e-6);
  }
}

TEST(Sdpa, FlopCount) {
  EXPECT_DOUBLE_EQ(mha::attention_flops(4, 16, 2048, 2048, 64, 64, false), 4.0 * 4 * 16 * 2048.0 * 2048 * 64);
  // Causal top-left on a square problem keeps L(L+1)/2 pairs.
  EXPECT_DOUBLE_EQ(mha::attention_flops(1, 1, 10, 10, 8, 8, true), 2.0 * 55 * 16);
  EXPECT_DOUBLE_EQ(mha::attention_flops(1, 1, 4, 10, 8, 8, true, mha::CausalAlignment::BottomRight),
                   2.0 * (7 + 8 + 9 + 10) * 16);
}

}  // namespace
