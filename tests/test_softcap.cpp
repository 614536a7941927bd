// Logit soft-capping (SdpaOptions::softcap; Gemma 2's attn_logit_softcapping): against the float64
// reference, which caps each scaled score as softcap * tanh(s / softcap) before the masks, on
// every ISA and dtype and through every kernel the shape picks: the tile forward, the decoding
// kernel's row and dot modes, the one-pass, two-pass and few-row backwards, float64; with masks
// (and the additive mask's gradient, which is not capped), causality, windows, ALiBi, GQA,
// dropout and sinks. A cap far above the scores changes nothing measurable; bad caps are errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::agree;
using mha_test::expect_error;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

struct CapCase {
  mha::Tensor q, k, v, grad, mask, slopes, sinks;
  mha::SdpaOptions options;
  std::string describe;
};

// Shapes that reach each kernel: one query per key/value head (decoding, dot mode), a few (its
// row mode; the few-row backward up to 16), long blocks (the tile kernels), and 16 head groups
// (the one-pass backward). Caps from strongly bending (0.5, scores of about 1 to 3 with the scale
// of 1 drawn half the time) to barely (30).
CapCase draw_case(std::mt19937_64& rng, mha::DType dtype, int n) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  CapCase c;
  const bool many_groups = n % 8 == 0;  // (float32, every other such case; a float mask every third)
  const int64_t b = many_groups ? 4 : 1 + pick(rng) % 2, hkv = many_groups ? 4 : 1 + pick(rng) % 2;
  const int64_t hq = hkv * (1 + pick(rng) % 2);
  const int64_t lqs[] = {1, 5, 20, 60}, lks[] = {1, 9, 40, 100};
  const int64_t lq = lqs[many_groups ? 2 + pick(rng) % 2 : pick(rng) % 4], lk = lks[pick(rng) % 4];
  const int64_t dims[] = {16, 32, 64};
  const int64_t dk = dims[pick(rng) % 3], dv = pick(rng) % 3 == 0 ? dims[pick(rng) % 3] : dk;
  c.q = randn({b, hq, lq, dk}, rng, dtype);
  c.k = randn({b, hkv, lk, dk}, rng, dtype);
  c.v = randn({b, hkv, lk, dv}, rng, dtype);
  c.grad = randn({b, hq, lq, dv}, rng, dtype);
  const double caps[] = {0.5, 2.0, 5.0, 30.0};
  c.options.softcap = caps[pick(rng) % 4];
  if (pick(rng) % 2 == 0) c.options.scale = 0.5;  // scores of several units: the cap bends them
  c.options.enable_gqa = hq != hkv;
  c.options.is_causal = pick(rng) % 2 == 0;
  c.options.causal_alignment = pick(rng) % 2 == 0 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  const mha::DType side = dtype == mha::DType::f64 ? mha::DType::f64 : mha::DType::f32;
  const int masking = n % 3;
  if (masking == 1) {  // bool, with a row that sees no key
    c.mask = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) c.mask.data<uint8_t>()[i * lk + j] = i % 5 != 1 && pick(rng) % 4 != 0;
    c.options.attn_mask = c.mask.view();
  } else if (masking == 2) {  // additive, per head: its gradient is dS before the cap's derivative
    c.mask = randn({hq, lq, lk}, rng, side);
    c.options.attn_mask = c.mask.view();
  }
  if (pick(rng) % 4 == 0) c.options.window_left = pick(rng) % 12;
  if (pick(rng) % 4 == 0) {
    c.slopes = mha::Tensor::empty({hq}, side);
    for (int64_t h = 0; h < hq; ++h) {
      if (side == mha::DType::f64) c.slopes.data<double>()[h] = 0.05 * static_cast<double>(h + 1);
      else c.slopes.data<float>()[h] = 0.05f * static_cast<float>(h + 1);
    }
    c.options.alibi_slopes = c.slopes.view();
  }
  if (pick(rng) % 5 == 0) {
    c.sinks = mha::Tensor::copy_of(randn({hq}, rng), side);
    c.options.sinks = c.sinks.view();
  }
  if (pick(rng) % 5 == 0) {
    c.options.dropout_p = 0.2;
    c.options.dropout_seed = pick(rng);
  }
  c.describe = std::string(mha::dtype_name(dtype)) + " B=" + std::to_string(b) + " Hq=" + std::to_string(hq) +
               " Hkv=" + std::to_string(hkv) + " Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk) +
               " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) + " softcap=" +
               std::to_string(c.options.softcap) + (c.options.scale ? " scale=0.5" : "") +
               (c.options.is_causal ? " causal" : "") + (masking == 1 ? " bool mask" : masking == 2 ? " float mask" : "") +
               " window_left=" + std::to_string(c.options.window_left) + (c.slopes.defined() ? " alibi" : "") +
               (c.sinks.defined() ? " sinks" : "") + (c.options.dropout_p > 0 ? " dropout" : "");
  return c;
}

// Outputs are judged against the larger of their largest element and their terms' size
// (mha_test::terms_magnitude).
// float32: outputs and weights within 2e-5 of the largest, as the SDPA tests (the cap's tanh is
// within 2.1e-7 relative, so a capped base-2 score within about 3 units in its last place),
// gradients 1e-4 judged against 5% of the largest (cancelling sums). bfloat16 / float16: outputs
// 1e-2 (rounded once to 8 / 11 bits), gradients the float32 path's bits. float64: 1e-12 / 1e-10.
TEST(Softcap, MatchesFloat64ReferenceOnEveryKernel) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 24; ++n) {
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f64, mha::DType::f16};
      const mha::DType dtype = dtypes[n % 4];
      const CapCase c = draw_case(rng, dtype, n);
      SCOPED_TRACE(c.describe);
      const bool wide = dtype == mha::DType::f32 || dtype == mha::DType::f64;
      const double out_tol = dtype == mha::DType::f64 ? 1e-12 : wide ? 2e-5 : 1e-2;
      const double grad_tol = dtype == mha::DType::f64 ? 1e-10 : 1e-4;
      const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
      const double terms = mha_test::terms_magnitude(c.q, c.k, c.v, c.options);
      EXPECT_LT(rel_error(mha::scaled_dot_product_attention(c.q, c.k, c.v, c.options), ref.output, terms), out_tol);
      const auto w = mha::scaled_dot_product_attention_with_weights(c.q, c.k, c.v, c.options);
      EXPECT_LT(rel_error(w.output, ref.output, terms), out_tol);
      EXPECT_LT(rel_error(w.weights, ref.weights), out_tol);
      const bool float_mask = c.mask.defined() && c.mask.dtype() != mha::DType::boolean;
      const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, c.options);
      const auto g = mha::scaled_dot_product_attention_backward(c.q, c.k, c.v, saved, c.grad, c.options, float_mask);
      if (!wide) {
        // Gradients from D = rowsum(dO O) on the rounded output, as every 16-bit backward: the
        // float32 path (held to the reference below) on widened copies and that output, rounded once.
        auto f32 = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
        const auto saved32 = mha::scaled_dot_product_attention_for_training(f32(c.q), f32(c.k), f32(c.v), c.options);
        // (AVX512-BF16's bfloat16 products: the output within bfloat16 rounding of that path's.)
        if (mha_test::pair_products_forward(dtype, c.q.size(-2), c.q.size(-1))) {
          EXPECT_LT(rel_error(saved.output, saved32.output, terms), 1e-2);
        } else {
          EXPECT_TRUE(agree(saved.output, mha::Tensor::copy_of(saved32.output, dtype)));
        }
        const mha::AttentionForTraining rounded{f32(saved.output), saved.lse};
        const auto g32 = mha::scaled_dot_product_attention_backward(f32(c.q), f32(c.k), f32(c.v), rounded, f32(c.grad),
                                                                    c.options, float_mask);
        if (mha_test::tile_unit_backward(dtype, c.q.size(-2), c.k.size(-2), c.q.size(-1), c.v.size(-1), float_mask)) {
          mha_test::expect_near_float32_path(g, g32);  // bfloat16 products (AVX512-BF16's pairs)
          continue;
        }
        EXPECT_TRUE(agree(g.query, mha::Tensor::copy_of(g32.query, dtype)));
        EXPECT_TRUE(agree(g.key, mha::Tensor::copy_of(g32.key, dtype)));
        EXPECT_TRUE(agree(g.value, mha::Tensor::copy_of(g32.value, dtype)));
        if (float_mask) EXPECT_TRUE(agree(*g.attn_mask, *g32.attn_mask));
        continue;
      }
      const auto rg = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.grad, c.options);
      const double floor = 0.05 * std::max({max_abs(rg.query), max_abs(rg.key), max_abs(rg.value)});
      EXPECT_LT(rel_error(g.query, rg.query, floor), grad_tol);
      EXPECT_LT(rel_error(g.key, rg.key, floor), grad_tol);
      EXPECT_LT(rel_error(g.value, rg.value, floor), grad_tol);
      if (float_mask) {
        // (With one visible key a row's dS is 0 exactly, and rounding noise in float32.)
        ASSERT_TRUE(g.attn_mask.has_value());
        EXPECT_LT(rel_error(*g.attn_mask, rg.attn_mask, std::max(0.05 * max_abs(rg.attn_mask), floor)), grad_tol);
      }
      if (c.sinks.defined()) {  // (judged against its sums without cancellation, as test_sinks)
        const auto magnitude = mha::reference::scaled_dot_product_attention_backward(
            c.q, c.k, mha_test::abs_of(c.v), mha_test::abs_of(c.grad), c.options);
        EXPECT_LT(rel_error(g.sinks, rg.sinks, 0.05 * max_abs(magnitude.sinks)), grad_tol);
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// The reference's cap against a hand-computed row: one query, keys with scores 0 and 3 under a
// cap of 2: capped scores 0 and 2 tanh(1.5); and its gradient through the tanh by central
// differences of the reference's own forward.
TEST(Softcap, ReferenceFollowsTheDefinition) {
  mha::Tensor q = mha::Tensor::zeros({1, 1, 1, 1}, mha::DType::f64), k = mha::Tensor::zeros({1, 1, 2, 1}, mha::DType::f64);
  mha::Tensor v = mha::Tensor::zeros({1, 1, 2, 1}, mha::DType::f64);
  q.data<double>()[0] = 1.0;
  k.data<double>()[1] = 3.0;
  v.data<double>()[0] = 1.0;
  v.data<double>()[1] = 4.0;
  mha::SdpaOptions o;
  o.scale = 1.0;
  o.softcap = 2.0;
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
  const double s1 = 2.0 * std::tanh(1.5), w1 = std::exp(s1) / (1 + std::exp(s1));
  EXPECT_NEAR(ref.weights.data<double>()[1], w1, 1e-15);
  EXPECT_NEAR(ref.output.data<double>()[0], (1 - w1) + 4 * w1, 1e-14);
  mha::Tensor grad = mha::Tensor::zeros({1, 1, 1, 1}, mha::DType::f64);
  grad.data<double>()[0] = 1.0;
  const auto g = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
  const double h = 1e-6;
  auto out_with_k1 = [&](double x) {
    k.data<double>()[1] = x;
    return mha::reference::scaled_dot_product_attention(q, k, v, o).output.data<double>()[0];
  };
  const double numeric = (out_with_k1(3.0 + h) - out_with_k1(3.0 - h)) / (2 * h);
  EXPECT_NEAR(g.key.data<double>()[1], numeric, 1e-8);
  EXPECT_GT(std::abs(numeric), 1e-3);  // (the cap's slope at 1.5 is 0.18: a real gradient)
}

// A cap far above the scores is the identity to float32 rounding: the capped call agrees with
// the plain one to 1e-6 (forward and gradients); a small cap does not (the test can fail).
TEST(Softcap, FarAboveTheScoresChangesNothing) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 70, 32}, rng), k = randn({2, 4, 90, 32}, rng), v = randn({2, 4, 90, 32}, rng);
  const mha::Tensor grad = randn({2, 4, 70, 32}, rng);
  mha::SdpaOptions plain;
  plain.is_causal = true;
  mha::SdpaOptions capped = plain;
  capped.softcap = 1e4;
  const auto a = mha::scaled_dot_product_attention_for_training(q, k, v, plain);
  const auto b = mha::scaled_dot_product_attention_for_training(q, k, v, capped);
  EXPECT_LT(rel_error(b.output, a.output), 1e-6);
  const auto ga = mha::scaled_dot_product_attention_backward(q, k, v, a, grad, plain);
  const auto gb = mha::scaled_dot_product_attention_backward(q, k, v, b, grad, capped);
  EXPECT_LT(rel_error(gb.query, ga.query), 1e-5);
  EXPECT_LT(rel_error(gb.key, ga.key), 1e-5);
  capped.softcap = 1.0;
  EXPECT_GT(rel_error(mha::scaled_dot_product_attention(q, k, v, capped), a.output), 1e-3);
}

// Variable-length and paged calls run each sequence with the cap: their rows are the sequence's
// own SDPA call's bits.
TEST(Softcap, VarlenAndPagedSequencesAreTheirOwnCalls) {
  std::mt19937_64 rng(test_seed());
  const int64_t hq = 4, hkv = 2, d = 16, page_size = 8;
  mha::SdpaOptions o;
  o.enable_gqa = true;
  o.is_causal = true;
  o.causal_alignment = mha::CausalAlignment::BottomRight;
  o.softcap = 1.5;
  o.scale = 0.6;
  const std::vector<int64_t> cu_q{0, 3, 20}, cu_k{0, 9, 40};
  const mha::Tensor q = randn({20, hq, d}, rng), k = randn({40, hkv, d}, rng), v = randn({40, hkv, d}, rng);
  const mha::Tensor out = mha::scaled_dot_product_attention_varlen(q, k, v, cu_q, cu_k, o);
  auto heads_first = [](const mha::TensorView& t, int64_t a, int64_t b) { return t.slice(0, a, b).transpose(0, 1).unsqueeze(0); };
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const mha::Tensor alone = mha::scaled_dot_product_attention(heads_first(q, cu_q[s], cu_q[s + 1]),
                                                                heads_first(k, cu_k[s], cu_k[s + 1]),
                                                                heads_first(v, cu_k[s], cu_k[s + 1]), o);
    EXPECT_TRUE(agree(mha::Tensor::copy_of(heads_first(out, cu_q[s], cu_q[s + 1])), alone)) << "sequence " << s;
  }
  const mha::Tensor pool_k = randn({4, hkv, page_size, d}, rng), pool_v = randn({4, hkv, page_size, d}, rng);
  const std::vector<int32_t> table{2, 0, 3};
  const std::vector<int64_t> lens{21};
  const mha::Tensor qd = randn({1, hq, 1, d}, rng);
  const mha::Tensor paged = mha::paged_attention(qd, pool_k, pool_v, table, lens, o);
  const mha::Tensor kb = mha_test::gathered_pages(pool_k, table.data(), 21);
  const mha::Tensor vb = mha_test::gathered_pages(pool_v, table.data(), 21);
  EXPECT_TRUE(agree(paged, mha::scaled_dot_product_attention(qd, kb, vb, o)));
  const auto ref = mha::reference::scaled_dot_product_attention(qd, kb, vb, o);
  EXPECT_LT(rel_error(paged, ref.output), 2e-5);
}

TEST(Softcap, BadCapsAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 3, 8}, rng);
  mha::SdpaOptions o;
  for (double bad : {-1.0, std::nan(""), HUGE_VAL, 2e30, 1e-31}) {
    o.softcap = bad;
    expect_error([&] { (void)mha::scaled_dot_product_attention(q, q, q, o); },
                 "softcap: expected 0 (no soft-capping) or a value in [1e-30, 1e30], got ");
  }
  // The ends of the range: a cap of 1e30 is the identity, one of 1e-30 flattens every score (equal
  // weights); neither gives NaN.
  for (double edge : {0.0, 1e-30, 1e30}) {
    o.softcap = edge;
    const mha::Tensor out = mha::scaled_dot_product_attention(q, q, q, o);
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data<float>()[i])) << edge;
  }
}

}  // namespace
