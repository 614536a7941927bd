// ALiBi (attention with linear biases), SdpaOptions::alibi_slopes: a call with slopes gives the
// bits of the same call with the biases written out as a float attn_mask [B, Hq, Lq, Lk] (drawn by
// the test from the definition, -slope |i + diagonal - j|), on every ISA, dtype (float64 within
// its rounding) and thread count, forward, weights, log-sum-exp and gradients, decoding shapes
// included; the float64 reference (which applies ALiBi from the slopes, not from the kernels'
// term) within stated tolerances; varlen sequences their own calls; bad slopes clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::expect_error;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

struct AlibiCase {
  mha::Tensor q, k, v, grad, slopes, keep, biases;
  mha::SdpaOptions options;
  std::string describe;
};

int64_t diagonal_of(const mha::SdpaOptions& o, int64_t lq, int64_t lk) {
  return o.causal_alignment == mha::CausalAlignment::BottomRight ? lk - lq : 0;
}

// The slope of (b, h) for slopes of shape [Hq] or [B, Hq] (either dimension possibly 1), as float64.
double slope_at(const mha::Tensor& slopes, int64_t b, int64_t h) {
  const mha::TensorView s = slopes.view();
  const int64_t hh = s.shape[s.ndim - 1] == 1 ? 0 : h, bb = s.ndim == 2 && s.shape[0] > 1 ? b : 0;
  const int64_t off = (s.ndim == 2 ? bb * s.strides[0] : 0) + hh * s.strides[s.ndim - 1];
  return s.dtype == mha::DType::f64 ? s.data_as<double>()[off] : s.data_as<float>()[off];
}

// The biases as a float mask [B, Hq, Lq, Lk] (float64 for float64 inputs), each the product of the
// slope and the distance rounded once, negated; -inf where the case's bool mask drops the key.
mha::Tensor biases_as_mask(const AlibiCase& c, int64_t b, int64_t hq, int64_t lq, int64_t lk, bool f64) {
  mha::Tensor m = mha::Tensor::empty({b, hq, lq, lk}, f64 ? mha::DType::f64 : mha::DType::f32);
  const int64_t diagonal = diagonal_of(c.options, lq, lk);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          const int64_t at = ((bi * hq + h) * lq + i) * lk + j, distance = std::abs(i + diagonal - j);
          const bool kept = !c.keep.defined() || c.keep.data<uint8_t>()[i * lk + j] != 0;
          const double slope = slope_at(c.slopes, bi, h);
          if (f64) {
            m.data<double>()[at] = kept ? -(slope * static_cast<double>(distance)) : -INFINITY;
          } else {
            m.data<float>()[at] = kept ? -(static_cast<float>(slope) * static_cast<float>(distance)) : -INFINITY;
          }
        }
  return m;
}

// Shapes around the kernels' tiles and the decoding kernel's (one query, a few), Lq != Lk, GQA;
// slopes as models use them (2^(-8 h / H)), per head or per batch entry and head, now and then
// steep ones (up to 8: far keys underflow to exactly 0 and whole blocks are skipped); with
// causality, either alignment, a window, a bool mask, dropout at random.
AlibiCase draw_case(std::mt19937_64& rng, mha::DType dtype) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  AlibiCase c;
  const int64_t shape_kind = pick(0, 3);
  const int64_t lq = shape_kind == 0 ? 1 : shape_kind == 1 ? pick(2, 12) : pick(1, pick(0, 1) == 0 ? 260 : 90);
  const int64_t lk = pick(0, 2) == 0 || lq < 13 ? pick(1, 300) : lq;
  const int64_t hkv = pick(1, 2), hq = hkv * pick(1, 4), b = pick(1, 2);
  const int64_t dk = std::vector<int64_t>{8, 16, 32, 64}[pick(0, 3)], dv = pick(0, 2) == 0 ? 24 : dk;
  c.q = randn({b, hq, lq, dk}, rng, dtype);
  c.k = randn({b, hkv, lk, dk}, rng, dtype);
  c.v = randn({b, hkv, lk, dv}, rng, dtype);
  c.grad = randn({b, hq, lq, dv}, rng, dtype);
  const bool per_batch = pick(0, 2) == 0, steep = pick(0, 4) == 0;
  const mha::DType slope_dtype = dtype == mha::DType::f64 && pick(0, 1) == 0 ? mha::DType::f64 : mha::DType::f32;
  mha::Tensor slopes64 = per_batch ? mha::Tensor::empty({b, hq}, mha::DType::f64) : mha::Tensor::empty({hq}, mha::DType::f64);
  for (int64_t x = 0; x < slopes64.numel(); ++x) {
    const double base = std::exp2(-8.0 * static_cast<double>(x % hq + 1) / static_cast<double>(hq));
    slopes64.data<double>()[x] = steep ? base * 16.0 : base * std::uniform_real_distribution<double>(0.5, 1.5)(rng);
  }
  c.slopes = slope_dtype == mha::DType::f64 ? slopes64 : mha::Tensor::copy_of(slopes64, slope_dtype);
  mha::SdpaOptions& o = c.options;
  o.alibi_slopes = c.slopes.view();
  o.is_causal = pick(0, 1) == 0;
  o.causal_alignment = pick(0, 1) == 1 ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
  if (pick(0, 3) == 0) o.window_left = pick(0, 100);
  o.enable_gqa = hq != hkv;
  if (pick(0, 3) == 0) {
    c.keep = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
    for (int64_t x = 0; x < lq * lk; ++x) c.keep.data<uint8_t>()[x] = pick(0, 4) != 0;
    o.attn_mask = c.keep.view();
  }
  if (pick(0, 3) == 0) o.dropout_p = 0.2, o.dropout_seed = static_cast<uint64_t>(pick(0, 1 << 30));
  o.num_threads = static_cast<int>(pick(1, 3));
  c.biases = biases_as_mask(c, b, hq, lq, lk, dtype == mha::DType::f64);
  c.describe = "B " + std::to_string(b) + " Hq " + std::to_string(hq) + " Hkv " + std::to_string(hkv) + " Lq " +
               std::to_string(lq) + " Lk " + std::to_string(lk) + " Dk " + std::to_string(dk) + " Dv " +
               std::to_string(dv) + " slopes " + c.slopes.view().shape_str() + (steep ? " steep" : "") + " causal " +
               std::to_string(o.is_causal) + " bottom-right " +
               std::to_string(o.causal_alignment == mha::CausalAlignment::BottomRight) + " window_left " +
               std::to_string(o.window_left) + " bool mask " + std::to_string(c.keep.defined()) + " dropout " +
               std::to_string(o.dropout_p) + " threads " + std::to_string(o.num_threads) + " dtype " +
               std::to_string(static_cast<int>(dtype));
  return c;
}

// The same call with the biases (and the bool mask) as one float attn_mask instead of the slopes.
mha::SdpaOptions as_bias_mask(const AlibiCase& c) {
  mha::SdpaOptions o = c.options;
  o.alibi_slopes.reset();
  o.attn_mask = c.biases.view();
  return o;
}

TEST(Alibi, GivesTheBitsOfTheBiasesAsAMask) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 32; ++n) {
      const mha::DType dtype = std::vector<mha::DType>{mha::DType::f32, mha::DType::bf16, mha::DType::f16,
                                                       mha::DType::f64}[n % 4];
      const AlibiCase c = draw_case(rng, dtype);
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + c.describe);
      mha_test::expect_same_calls(c.q, c.k, c.v, c.grad, c.options, as_bias_mask(c));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Against the float64 reference, with a random additive attn_mask in half the cases. float32:
// outputs and weights within 2e-5 of the largest plus 4 u_f32 times the largest bias (a score
// and its bias are added in float32, so the sum rounds relative to the bias: u |bias| in the
// exponent), gradients within 1e-4 plus the same, judged against 5% of the largest where
// cancelling sums leave exact zeros; float64 within 1e-12 / 1e-11.
TEST(Alibi, MatchesFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 16; ++n) {
    const mha::DType dtype = n % 4 == 3 ? mha::DType::f64 : mha::DType::f32;
    AlibiCase c = draw_case(rng, dtype);
    mha::Tensor mask;
    if (n % 2 == 1 && !c.keep.defined()) {
      mask = randn({c.q.size(2), c.k.size(2)}, rng, dtype);
      c.options.attn_mask = mask.view();
    }
    SCOPED_TRACE(c.describe + (mask.defined() ? " with an additive mask" : ""));
    const double largest_bias = [&] {
      double m = 0;  // (finite biases only: -inf marks the bool mask's dropped keys)
      const mha::Tensor b64 = mha::Tensor::copy_of(c.biases.view(), mha::DType::f64);
      for (int64_t x = 0; x < b64.numel(); ++x)
        if (std::isfinite(b64.data<double>()[x])) m = std::max(m, std::abs(b64.data<double>()[x]));
      return m;
    }();
    const double rounding = dtype == mha::DType::f64 ? 0.0 : 4 * std::ldexp(1.0, -24) * largest_bias;
    const double out_tol = dtype == mha::DType::f64 ? 1e-12 : 2e-5 + rounding;
    const double grad_tol = dtype == mha::DType::f64 ? 1e-11 : 1e-4 + rounding;
    const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    const auto w = mha::scaled_dot_product_attention_with_weights(c.q, c.k, c.v, c.options);
    EXPECT_LT(rel_error(w.output, ref.output), out_tol);
    EXPECT_LT(rel_error(w.weights, ref.weights), out_tol);
    const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, c.options);
    const auto g = mha::scaled_dot_product_attention_backward(c.q, c.k, c.v, saved, c.grad, c.options);
    const auto r = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.grad, c.options);
    const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
    EXPECT_LT(rel_error(g.query, r.query, floor), grad_tol);
    EXPECT_LT(rel_error(g.key, r.key, floor), grad_tol);
    EXPECT_LT(rel_error(g.value, r.value, floor), grad_tol);
  }
}

// The reference's own ALiBi against a hand-computed case: one query, two keys with equal scores
// (q . k the same), slope s, top-left: the weights are softmax(0, -s) for keys at distance 0 and 1.
TEST(Alibi, ReferenceFollowsTheDefinition) {
  const float qd[] = {1.0f, 2.0f}, kd[] = {0.5f, 0.25f, 0.5f, 0.25f}, vd[] = {3.0f, -1.0f};
  const mha::TensorView q(qd, {1, 1, 2}), k(kd, {1, 2, 2}), v(vd, {1, 2, 1});
  const float slope = 0.75f;
  const mha::TensorView slopes(&slope, {1});
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes});
  const double w1 = std::exp(-0.75) / (1.0 + std::exp(-0.75));
  EXPECT_NEAR(ref.weights.view().at({0, 0, 1}), w1, 1e-15);
  EXPECT_NEAR(ref.output.view().at({0, 0, 0}), 3.0 * (1 - w1) - w1, 1e-15);
  const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes});
  EXPECT_NEAR(out.view().at({0, 0, 0}), 3.0 * (1 - w1) - w1, 1e-6);
}

// Each packed sequence gets its own biases (distances within it, its row of [sequences, Hq]
// slopes), as one SDPA call on it alone: the same bits.
TEST(Alibi, VarlenSequencesAreTheirOwnCalls) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int64_t> cu_q{0, 70, 71, 71, 200}, cu_k{0, 90, 140, 150, 180};
  const mha::Tensor q = randn({200, 4, 32}, rng), k = randn({180, 2, 32}, rng), v = randn({180, 2, 32}, rng);
  const mha::Tensor grad = randn({200, 4, 32}, rng);
  const mha::Tensor per_head = mha::Tensor::copy_of(randn({4}, rng).view(), mha::DType::f32);
  const mha::Tensor per_sequence = randn({4, 4}, rng);
  for (const mha::Tensor* slopes : {&per_head, &per_sequence}) {
    for (const bool causal : {false, true}) {
      const mha::SdpaOptions o{.is_causal = causal, .causal_alignment = mha::CausalAlignment::BottomRight,
                               .alibi_slopes = slopes->view(), .enable_gqa = true, .num_threads = 2};
      SCOPED_TRACE("slopes " + slopes->view().shape_str() + " causal " + std::to_string(causal));
      const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu_q, cu_k, o);
      const auto g = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu_q, cu_k, saved, grad, o);
      for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
        auto rows = [](const mha::TensorView& t, int64_t a, int64_t b) { return t.slice(0, a, b).transpose(0, 1); };
        auto packed = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, t.dtype); };
        const mha::TensorView qs = rows(q, cu_q[s], cu_q[s + 1]), ks = rows(k, cu_k[s], cu_k[s + 1]),
                              vs = rows(v, cu_k[s], cu_k[s + 1]);
        mha::SdpaOptions alone_options = o;
        if (slopes->view().ndim == 2) alone_options.alibi_slopes = slopes->view().select(0, static_cast<int64_t>(s));
        const auto alone = mha::scaled_dot_product_attention_for_training(qs, ks, vs, alone_options);
        EXPECT_TRUE(same_bits(packed(rows(saved.output, cu_q[s], cu_q[s + 1])), alone.output));
        const auto ga =
            mha::scaled_dot_product_attention_backward(qs, ks, vs, alone, rows(grad, cu_q[s], cu_q[s + 1]), alone_options);
        EXPECT_TRUE(same_bits(packed(rows(g.query, cu_q[s], cu_q[s + 1])), ga.query));
        EXPECT_TRUE(same_bits(packed(rows(g.key, cu_k[s], cu_k[s + 1])), ga.key));
      }
    }
  }
}

// Slopes shared over batch dimensions that do not fold into one stride ([2, 1, H] against a
// batch [2, 3, H]) are copied; the result is that of the slopes expanded.
TEST(Alibi, SlopesBroadcastOverTheBatchDimensions) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 3, 4, 20, 16}, rng), k = randn({2, 3, 4, 30, 16}, rng), v = randn({2, 3, 4, 30, 16}, rng);
  const mha::Tensor slopes = randn({2, 1, 4}, rng);
  mha::Tensor expanded = mha::Tensor::empty({2, 3, 4});
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t h = 0; h < 4; ++h) expanded.data<float>()[(a * 3 + b) * 4 + h] = slopes.data<float>()[a * 4 + h];
  const mha::Tensor broadcast = mha::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes.view()});
  EXPECT_TRUE(same_bits(broadcast, mha::scaled_dot_product_attention(q, k, v, {.alibi_slopes = expanded.view()})));
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes.view()});
  EXPECT_LT(rel_error(broadcast, ref.output), 2e-5 + 4 * std::ldexp(1.0, -24) * max_abs(slopes) * 29);  // (|i - j| <= 29)
}

// Inputs without heads (2-D: one slope, shape [1] or []), and sequences of no queries or no keys
// (no scores: an empty output, or zeros).
TEST(Alibi, InputsWithoutHeadsAndEmptySequences) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({20, 16}, rng), k = randn({30, 16}, rng), v = randn({30, 8}, rng);
  const float slope = 0.3f;
  for (const mha::Shape& shape : {mha::Shape{1}, mha::Shape{}}) {
    const mha::TensorView slopes(&slope, shape);
    const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes});
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, {.alibi_slopes = slopes});
    EXPECT_LT(rel_error(out, ref.output), 2e-5 + 4 * std::ldexp(1.0, -24) * 0.3 * 29);
    const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v);
    EXPECT_GT(rel_error(out, plain), 1e-3);  // (the biases change the result)
  }
  const float slopes[2] = {0.5f, 0.25f};
  const mha::TensorView per_head(slopes, {2});
  const mha::Tensor q0 = randn({1, 2, 0, 16}, rng), k0 = randn({1, 2, 0, 16}, rng), v0 = randn({1, 2, 0, 8}, rng);
  const mha::Tensor qs = randn({1, 2, 5, 16}, rng), ks = randn({1, 2, 7, 16}, rng), vs = randn({1, 2, 7, 8}, rng);
  EXPECT_EQ(mha::scaled_dot_product_attention(q0, ks, vs, {.alibi_slopes = per_head}).numel(), 0);
  const mha::Tensor no_keys = mha::scaled_dot_product_attention(qs, k0, v0, {.alibi_slopes = per_head});
  EXPECT_EQ(max_abs(no_keys), 0.0);
  EXPECT_EQ(no_keys.numel(), 2 * 5 * 8);
  // No head, or no batch entry: empty slopes (no storage) are read by no one, on every path.
  const mha::TensorView none(nullptr, mha::DType::f32, {0});
  const mha::Tensor qh = randn({3, 0, 5, 16}, rng), kh = randn({3, 0, 7, 16}, rng), vh = randn({3, 0, 7, 8}, rng);
  const mha::Tensor qb = randn({0, 2, 5, 16}, rng), kb = randn({0, 2, 7, 16}, rng), vb = randn({0, 2, 7, 8}, rng);
  for (const mha::Tensor* t : {&qh, &qb}) {
    const mha::Tensor& q4 = *t;
    const mha::Tensor& k4 = t == &qh ? kh : kb;
    const mha::Tensor& v4 = t == &qh ? vh : vb;
    const mha::SdpaOptions o{.alibi_slopes = t == &qh ? none : per_head};
    EXPECT_EQ(mha::scaled_dot_product_attention(q4, k4, v4, o).numel(), 0);
    const auto saved = mha::scaled_dot_product_attention_for_training(q4, k4, v4, o);
    EXPECT_EQ(saved.output.numel(), 0);
    EXPECT_EQ(mha::scaled_dot_product_attention_with_weights(q4, k4, v4, o).weights.numel(), 0);
  }
}

TEST(Alibi, BadSlopesAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 3, 8, 16}, rng), k = randn({2, 3, 8, 16}, rng);
  auto call = [&](const mha::Tensor& slopes) {
    mha::scaled_dot_product_attention(q, k, k, {.alibi_slopes = slopes.view()});
  };
  expect_error([&] { call(randn({3}, rng, mha::DType::bf16)); }, "alibi_slopes: expected dtype float32, got bfloat16");
  expect_error([&] { call(randn({3}, rng, mha::DType::f64)); }, "alibi_slopes: expected dtype float32, got float64");
  expect_error([&] { call(randn({4}, rng)); },
               "alibi_slopes: shape [4] cannot be broadcast to the batch dimensions and heads [2, 3]");
  expect_error([&] { call(randn({3, 3}, rng)); }, "cannot be broadcast");
  expect_error([&] { call(randn({2, 1, 3}, rng)); }, "cannot be broadcast");
  expect_error([&] { call(randn({1, 1, 1, 1, 2, 3}, rng)); },
               "alibi_slopes: expected at most 4 dimensions (the batch dimensions and heads), got shape [1, 1, 1, 1, 2, 3]");
  mha::Tensor bad = randn({2, 3}, rng);
  bad.data<float>()[4] = std::numeric_limits<float>::infinity();
  expect_error([&] { call(bad); }, "alibi_slopes: expected finite slopes, got inf at batch entry 1, head 1");
  bad.data<float>()[4] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { call(bad); }, "expected finite slopes, got nan");
  // float64 slopes with float64 inputs are fine
  const mha::Tensor q64 = randn({1, 3, 8, 16}, rng, mha::DType::f64);
  EXPECT_NO_THROW(mha::scaled_dot_product_attention(q64, q64, q64, {.alibi_slopes = randn({3}, rng, mha::DType::f64).view()}));
  const std::vector<int64_t> cu{0, 3, 8};
  const mha::TensorView packed = q.view().select(0, 0).transpose(0, 1);  // [8, 3, 16]
  expect_error([&] { mha::scaled_dot_product_attention_varlen(packed, packed, packed, cu, cu,
                                                              {.alibi_slopes = randn({3, 3}, rng).view()}); },
               "alibi_slopes: expected shape [Hq] or [sequences, Hq] (2 sequences), got [3, 3]");
  expect_error([&] { mha::scaled_dot_product_attention_varlen(packed, packed, packed, cu, cu,
                                                              {.alibi_slopes = randn({2, 4}, rng).view()}); },
               "alibi_slopes: shape [4] cannot be broadcast");
}

}  // namespace
