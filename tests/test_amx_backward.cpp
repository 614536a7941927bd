// The bfloat16 backward on the tile unit (cpu/flash_backward_amx.cpp), where this CPU has AMX:
// against the float64 reference backward on the same bfloat16 inputs, the same bits on every
// thread count and for every subset of the gradients, and zeros where no query sees a key.
// Fresh seeds each run (printed; MHA_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cpu/amx.hpp"
#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

struct AmxCase {
  mha::Tensor q, k, v, grad, mask;
  mha::SdpaOptions options;
  std::string describe;
};

// Shapes the kernel takes (bfloat16, head dims from 16, more than 4 queries): lengths around its blocks of 32, head dims
// that are and are not multiples of 32, grouped heads, causality in both alignments, sliding
// windows (some rows then see no key), scales, masks of each kind (additive with -inf entries, bool,
// a key padding mask), dropout.
AmxCase draw_case(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return static_cast<int64_t>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  static const int64_t lengths[] = {5, 17, 31, 32, 33, 64, 70, 97, 130};
  static const int64_t dims[] = {16, 24, 32, 40, 64, 80, 128};
  auto any = [&](const auto& values) { return values[pick(0, static_cast<int>(std::size(values)) - 1)]; };
  const int64_t B = pick(1, 3), Hkv = pick(1, 3), Hq = Hkv * pick(1, 3);
  const int64_t Lq = any(lengths), Lk = coin(0.4) ? Lq : any(lengths);
  const int64_t Dk = any(dims), Dv = coin(0.5) ? Dk : any(dims);
  AmxCase c;
  const mha::DType bf16 = mha::DType::bf16;
  c.q = randn({B, Hq, Lq, Dk}, rng, bf16);
  c.k = randn({B, Hkv, Lk, Dk}, rng, bf16);
  c.v = randn({B, Hkv, Lk, Dv}, rng, bf16);
  c.grad = randn({B, Hq, Lq, Dv}, rng, bf16);
  c.options.enable_gqa = Hq != Hkv;
  c.options.is_causal = coin(0.4);
  c.options.causal_alignment = coin(0.5) ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (coin(0.3)) {
    c.options.window_left = pick(0, 40);
    if (!c.options.is_causal && coin(0.5)) c.options.window_right = pick(0, 40);
  }
  if (coin(0.3)) c.options.scale = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  const int mask_kind = static_cast<int>(pick(0, 3));
  if (mask_kind == 1) {  // additive, per head, broadcast over the batch
    c.mask = randn({Hq, Lq, Lk}, rng);
    for (int64_t e = 0; e < c.mask.numel(); ++e)
      if (coin(0.05)) c.mask.data<float>()[e] = -INFINITY;
  } else if (mask_kind == 2) {
    c.mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
    for (int64_t e = 0; e < c.mask.numel(); ++e) c.mask.data<bool>()[e] = coin(0.8);
  } else if (mask_kind == 3) {  // key padding: the last keys of each batch entry
    c.mask = mha::Tensor::empty({B, 1, 1, Lk}, mha::DType::boolean);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t kept = pick(1, static_cast<int>(Lk));
      for (int64_t j = 0; j < Lk; ++j) c.mask.data<bool>()[b * Lk + j] = j < kept;
    }
  }
  if (mask_kind != 0) c.options.attn_mask = c.mask.view();
  if (coin(0.3)) {
    c.options.dropout_p = std::uniform_real_distribution<double>(0.05, 0.5)(rng);
    c.options.dropout_seed = rng();
  }
  c.describe = "B=" + std::to_string(B) + " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) +
               " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " Dk=" + std::to_string(Dk) +
               " Dv=" + std::to_string(Dv) + " causal=" + std::to_string(c.options.is_causal) +
               (c.options.causal_alignment == mha::CausalAlignment::TopLeft ? " top-left" : " bottom-right") +
               " window=(" + std::to_string(c.options.window_left) + ", " + std::to_string(c.options.window_right) +
               ") scale=" + std::to_string(c.options.scale.value_or(0.0)) + " mask=" + std::to_string(mask_kind) +
               " dropout=" + std::to_string(c.options.dropout_p);
  return c;
}

// Each gradient of g within `bound` of r's, relative to the largest element of the three or 5% of
// it where one cancels to nearly zero.
template <class Ours, class Theirs>
void expect_gradients_near(const Ours& g, const Theirs& r, double bound) {
  const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
  EXPECT_LT(rel_error(g.query, r.query, floor), bound);
  EXPECT_LT(rel_error(g.key, r.key, floor), bound);
  EXPECT_LT(rel_error(g.value, r.value, floor), bound);
}

bool amx_present() {
  const auto isas = mha::detail::supported_isas();
  return std::find(isas.begin(), isas.end(), mha::detail::Isa::amx) != isas.end();
}

// Against the float64 reference on the same bfloat16 inputs, each gradient within 2e-2 of the
// largest of the three (5% of it where a gradient cancels to nearly zero): P and dS enter the
// tile products rounded to bfloat16 (2^-9 relative each), and each gradient is rounded once to
// bfloat16 (2^-9); the float32 path on the same inputs is held to the same bound
// (SdpaBackward.GroupedKeyAndValueHeadCountsThatDiffer). Where that path is itself further off
// (rows that see one or two keys, whose dS = P (dP - D) cancels to the rounding of the saved
// bfloat16 output that D reads, which both paths share), within twice its error; and always
// within 2e-2 of the float32 path's gradients, which share that rounding. Also: the tile unit's
// gradients are not the float32 path's bits (the kernel ran), the same bits on 1, 2 and 3
// threads and when only some gradients are wanted.
TEST(AmxBackward, MatchesFloat64ReferenceAndIsDeterministic) {
  if (!amx_present()) GTEST_SKIP() << "this CPU has no AMX-BF16";
  std::mt19937_64 rng(test_seed());
  double worst = 0, worst32 = 0;
  int differs_from_float32_path = 0;
  for (int n = 0; n < 24; ++n) {
    AmxCase c = draw_case(rng);
    SCOPED_TRACE(c.describe);
    differs_from_float32_path += mha_test::check_bf16_products_backward(c.q, c.k, c.v, c.grad, c.options, worst, worst32);
  }
  mha::detail::force_isa(std::nullopt);  // (the check forces the ISA it found back: the default)
  std::printf("largest relative error against float64: %.3g (the float32 path's on the same cases: %.3g)\n", worst, worst32);
  EXPECT_GT(differs_from_float32_path, 12);
}

// Rows that see no key get zero query gradients, and keys that no query sees zero key and value
// gradients, exactly; the rest within the bound above: bottom-right causality with more queries
// than keys (the first Lq - Lk rows see nothing), and top-left causality with a window of 4 keys
// and more keys than queries (the last Lk - Lq keys are seen by nobody).
TEST(AmxBackward, ZerosWhereNothingIsSeen) {
  if (!amx_present()) GTEST_SKIP() << "this CPU has no AMX-BF16";
  std::mt19937_64 rng(test_seed());
  const mha::DType bf16 = mha::DType::bf16;
  auto zeros = [](const mha::TensorView& t, int64_t rows_from, int64_t rows_to) {
    const mha::Tensor f = mha::Tensor::copy_of(t, mha::DType::f32);
    const int64_t heads = t.shape[0] * t.shape[1], len = t.shape[2], width = t.shape[3];
    for (int64_t bh = 0; bh < heads; ++bh)
      for (int64_t i = rows_from; i < rows_to; ++i)
        for (int64_t d = 0; d < width; ++d)
          if (f.data<float>()[(bh * len + i) * width + d] != 0.0f) return false;
    return true;
  };
  for (const bool more_queries : {true, false}) {
    const int64_t lq = more_queries ? 100 : 70, lk = more_queries ? 70 : 100;
    mha::SdpaOptions o;
    o.is_causal = true;
    o.causal_alignment = more_queries ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
    if (!more_queries) o.window_left = 3;
    SCOPED_TRACE(more_queries ? "Lq 100 Lk 70 bottom-right" : "Lq 70 Lk 100 top-left, window 3");
    const mha::Tensor q = randn({2, 2, lq, 32}, rng, bf16), k = randn({2, 2, lk, 32}, rng, bf16),
                      v = randn({2, 2, lk, 48}, rng, bf16), grad = randn({2, 2, lq, 48}, rng, bf16);
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
    if (more_queries) {
      EXPECT_TRUE(zeros(g.query, 0, lq - lk));
    } else {
      EXPECT_TRUE(zeros(g.key, lq, lk));
      EXPECT_TRUE(zeros(g.value, lq, lk));
    }
    expect_gradients_near(g, r, 2e-2);
  }
}

// Key blocks in spans of 256 (where a head's packed queries outgrow the cache) or one at a time
// give the same bits: each gradient element sums its blocks in one order either way. Lengths
// across several spans, causality with a window (blocks skipped at both ends of a span), dropout.
TEST(AmxBackward, KeySpansGiveTheSameBits) {
  if (!amx_present()) GTEST_SKIP() << "this CPU has no AMX-BF16";
  std::mt19937_64 rng(test_seed());
  const mha::DType bf16 = mha::DType::bf16;
  for (const bool windowed : {false, true}) {
    mha::SdpaOptions o;
    o.is_causal = windowed;
    if (windowed) o.window_left = 300;
    o.dropout_p = 0.2, o.dropout_seed = rng();
    o.enable_gqa = true;
    SCOPED_TRACE(windowed ? "causal, window of 301 keys, dropout" : "dropout");
    const mha::Tensor q = randn({2, 4, 600, 48}, rng, bf16), k = randn({2, 2, 700, 48}, rng, bf16),
                      v = randn({2, 2, 700, 40}, rng, bf16), grad = randn({2, 4, 600, 40}, rng, bf16);
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    std::atomic<int64_t>& span_bytes = mha::detail::amx_backward_span_bytes();
    const int64_t before = span_bytes.load();
    span_bytes = 0;  // spans of 256 keys
    const auto spans = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    span_bytes = int64_t{1} << 62;  // 32 keys at a time
    const auto blocks = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    span_bytes = before;
    EXPECT_TRUE(same_bits(spans.query, blocks.query));
    EXPECT_TRUE(same_bits(spans.key, blocks.key));
    EXPECT_TRUE(same_bits(spans.value, blocks.value));
    mha::detail::force_isa(mha::detail::Isa::avx512);
    const auto g32 = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    mha::detail::force_isa(std::nullopt);
    expect_gradients_near(spans, g32, 2e-2);
  }
}

// Few (batch, key/value head) groups split their keys into chunks of 256 and more, each with a
// dQ of its own, summed in chunk order: against the float64 reference (the bound above), the same
// bits on 1, 2 and 3 threads and when dQ alone is wanted. One group over 700 keys (3 chunks) with
// bottom-right causality and dropout, two groups with a window and a key padding mask.
TEST(AmxBackward, FewGroupsSplitTheirKeys) {
  if (!amx_present()) GTEST_SKIP() << "this CPU has no AMX-BF16";
  std::mt19937_64 rng(test_seed());
  const mha::DType bf16 = mha::DType::bf16;
  for (const int64_t hkv : {int64_t{1}, int64_t{2}}) {
    mha::SdpaOptions o;
    o.enable_gqa = true;
    mha::Tensor mask;
    if (hkv == 1) {
      o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
      o.dropout_p = 0.15, o.dropout_seed = rng();
    } else {
      o.window_left = 200, o.window_right = 100;
      mask = mha::Tensor::empty({1, 1, 1, 700}, mha::DType::boolean);
      for (int64_t j = 0; j < 700; ++j) mask.data<bool>()[j] = j < 650;
      o.attn_mask = mask.view();
    }
    SCOPED_TRACE(hkv == 1 ? "one group, causal, dropout" : "two groups, window, key padding");
    const mha::Tensor q = randn({1, 2 * hkv, 300, 64}, rng, bf16), k = randn({1, hkv, 700, 64}, rng, bf16),
                      v = randn({1, hkv, 700, 32}, rng, bf16), grad = randn({1, 2 * hkv, 300, 32}, rng, bf16);
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
    expect_gradients_near(g, r, 2e-2);
    for (int threads : {1, 3}) {
      mha::SdpaOptions ot = o;
      ot.num_threads = threads;
      const auto gt = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, ot);
      EXPECT_TRUE(same_bits(gt.query, g.query)) << threads << " threads";
      EXPECT_TRUE(same_bits(gt.key, g.key)) << threads << " threads";
      EXPECT_TRUE(same_bits(gt.value, g.value)) << threads << " threads";
    }
    const auto dq = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o, {.query = true, .key = false, .value = false});
    EXPECT_TRUE(same_bits(dq.query, g.query));
    const auto dkv = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o, {.query = false, .key = true, .value = true});
    EXPECT_TRUE(same_bits(dkv.key, g.key));
    EXPECT_TRUE(same_bits(dkv.value, g.value));
  }
}

}  // namespace
