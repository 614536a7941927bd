// Sliding-window (local) attention, SdpaOptions::window_left / window_right: a call with a window
// gives the bits of the same call with the window written out as a bool attn_mask (the band the
// test draws itself from the definition), on every ISA, dtype (float64 within its rounding) and
// thread count, forward, weights
// and gradients; the float64 reference within the stated tolerances; varlen sequences their own
// windowed calls; bad windows clear errors.
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

using mha_test::agree;
using mha_test::expect_error;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

// Whether query i sees key j under the window and causality, written from the definition: the
// diagonal is key i (top-left) or key i + Lk - Lq (bottom-right); the window keeps keys from
// `left` before it to `right` after it (-1: no bound on that side); is_causal keeps keys up to it.
bool in_window(const mha::SdpaOptions& o, int64_t lq, int64_t lk, int64_t i, int64_t j) {
  const int64_t diagonal = i + (o.causal_alignment == mha::CausalAlignment::BottomRight ? lk - lq : 0);
  if (o.window_left >= 0 && j < diagonal - o.window_left) return false;
  if (o.window_right >= 0 && j > diagonal + o.window_right) return false;
  return !(o.is_causal && j > diagonal);
}

struct WindowCase {
  mha::Tensor q, k, v, grad, band;
  mha::SdpaOptions options;
  std::string describe;
};

// Shapes around the kernels' tiles (48 queries, 64-72 keys per block), Lq != Lk, GQA, windows
// from none to wider than the sequence on either side (0: the diagonal alone), with and without
// is_causal, both alignments, dropout.
WindowCase draw_case(std::mt19937_64& rng, mha::DType dtype) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto window_side = [&] {
    const int64_t kind = pick(0, 4);
    return kind == 0 ? -1 : kind == 1 ? 0 : kind == 2 ? pick(1, 8) : kind == 3 ? pick(9, 100) : pick(100, 400);
  };
  WindowCase c;
  const int64_t lq = pick(1, pick(0, 2) == 0 ? 300 : 90), lk = pick(0, 3) == 0 ? pick(1, 300) : lq;
  const int64_t hkv = pick(1, 2), hq = hkv * pick(1, 3), b = pick(1, 2);
  const int64_t dk = std::vector<int64_t>{8, 16, 32, 64}[pick(0, 3)], dv = pick(0, 2) == 0 ? 24 : dk;
  c.q = randn({b, hq, lq, dk}, rng, dtype);
  c.k = randn({b, hkv, lk, dk}, rng, dtype);
  c.v = randn({b, hkv, lk, dv}, rng, dtype);
  c.grad = randn({b, hq, lq, dv}, rng, dtype);
  mha::SdpaOptions& o = c.options;
  o.window_left = window_side();
  o.window_right = window_side();
  if (o.window_left < 0 && o.window_right < 0) o.window_left = pick(0, 40);
  o.is_causal = pick(0, 2) == 0;
  o.causal_alignment = pick(0, 1) == 1 ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
  o.enable_gqa = hq != hkv;
  if (pick(0, 3) == 0) o.dropout_p = 0.2, o.dropout_seed = static_cast<uint64_t>(pick(0, 1 << 30));
  o.num_threads = static_cast<int>(pick(1, 3));
  c.band = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t j = 0; j < lk; ++j) c.band.data<uint8_t>()[i * lk + j] = in_window(o, lq, lk, i, j);
  c.describe = "B " + std::to_string(b) + " Hq " + std::to_string(hq) + " Hkv " + std::to_string(hkv) + " Lq " +
               std::to_string(lq) + " Lk " + std::to_string(lk) + " Dk " + std::to_string(dk) + " Dv " +
               std::to_string(dv) + " window (" + std::to_string(o.window_left) + ", " +
               std::to_string(o.window_right) + ") causal " + std::to_string(o.is_causal) + " bottom-right " +
               std::to_string(o.causal_alignment == mha::CausalAlignment::BottomRight) + " dropout " +
               std::to_string(o.dropout_p) + " threads " + std::to_string(o.num_threads) + " dtype " +
               std::to_string(static_cast<int>(dtype));
  return c;
}

// The same call with the window (and causality) as a bool attn_mask instead.
mha::SdpaOptions as_band_mask(const WindowCase& c) {
  mha::SdpaOptions o = c.options;
  o.window_left = o.window_right = -1;
  o.is_causal = false;
  o.attn_mask = c.band.view();
  return o;
}

TEST(SlidingWindow, GivesTheBitsOfTheBandAsAMask) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 24; ++n) {
      const mha::DType dtype = std::vector<mha::DType>{mha::DType::f32, mha::DType::bf16, mha::DType::f16,
                                                       mha::DType::f64}[n % 4];
      const WindowCase c = draw_case(rng, dtype);
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + c.describe);
      mha_test::expect_same_calls(c.q, c.k, c.v, c.grad, c.options, as_band_mask(c));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Against the float64 reference (which applies the window from its definition, not as a mask),
// with a random additive attn_mask in half the cases (a key must pass both): float32 outputs and
// weights within 2e-5 of the largest (the SDPA forward tests' bound), gradients within 1e-4 judged
// against 5% of the largest where cancelling sums leave exact zeros; float64 within 1e-12 / 1e-11.
// The reference's weights are exactly 0 outside the test's own band.
TEST(SlidingWindow, MatchesFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 16; ++n) {
    const mha::DType dtype = n % 4 == 3 ? mha::DType::f64 : mha::DType::f32;
    const double out_tol = dtype == mha::DType::f64 ? 1e-12 : 2e-5, grad_tol = dtype == mha::DType::f64 ? 1e-11 : 1e-4;
    WindowCase c = draw_case(rng, dtype);
    mha::Tensor mask;
    if (n % 2 == 1) {
      mask = randn({c.q.size(2), c.k.size(2)}, rng, dtype);
      c.options.attn_mask = mask.view();
    }
    SCOPED_TRACE(c.describe + (n % 2 == 1 ? " with an additive mask" : ""));
    const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    const int64_t lq = c.q.size(2), lk = c.k.size(2);
    const mha::Tensor rw = mha::Tensor::copy_of(ref.weights, mha::DType::f64);
    for (int64_t r = 0; r < rw.numel() / (lq * lk); ++r)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j)
          if (!in_window(c.options, lq, lk, i, j)) ASSERT_EQ(rw.data<double>()[(r * lq + i) * lk + j], 0.0);
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

// A mask's gradient with a window, in both backward schedules (one pass per head group with many
// groups, two passes with few): an additive mask read through a transposed view (not one
// contiguous term, so the kernels apply the window themselves) gives the bits of the same mask
// contiguous (where the window becomes a mask term), and the float64 reference's gradient within
// 1e-4 of the largest (the backward tolerance above).
TEST(SlidingWindow, MaskGradientsInBothBackwardSchedules) {
  std::mt19937_64 rng(test_seed());
  for (const auto& [b, h] : {std::pair{int64_t{1}, int64_t{2}}, std::pair{int64_t{8}, int64_t{4}}}) {
    SCOPED_TRACE("B " + std::to_string(b) + " H " + std::to_string(h));
    const mha::Tensor q = randn({b, h, 150, 32}, rng), k = randn({b, h, 130, 32}, rng), v = randn({b, h, 130, 32}, rng);
    const mha::Tensor grad = randn({b, h, 150, 32}, rng), stored = randn({130, 150}, rng);
    const mha::TensorView transposed = stored.view().transpose(0, 1);  // [150, 130], strides (1, 150)
    const mha::Tensor contiguous = mha::Tensor::copy_of(transposed, mha::DType::f32);
    mha::SdpaOptions o{.attn_mask = transposed, .causal_alignment = mha::CausalAlignment::BottomRight,
                       .window_left = 20, .window_right = 5, .num_threads = 2};
    const mha::SdpaGradientsWanted all{.attn_mask = true};
    mha::SdpaOptions oc = o;
    oc.attn_mask = contiguous.view();
    const auto saved_c = mha::scaled_dot_product_attention_for_training(q, k, v, oc);
    const auto gc = mha::scaled_dot_product_attention_backward(q, k, v, saved_c, grad, oc, all);
    {  // a call without the window first: its score gradients, nonzero everywhere, stay in the
       // blocks the host cache hands the next call, so one the kernels fail to write would show
      mha::SdpaOptions unbounded = o;
      unbounded.window_left = unbounded.window_right = -1;
      const auto s = mha::scaled_dot_product_attention_for_training(q, k, v, unbounded);
      (void)mha::scaled_dot_product_attention_backward(q, k, v, s, grad, unbounded, all);
    }
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o, all);
    EXPECT_TRUE(agree(saved.output, saved_c.output));
    EXPECT_TRUE(agree(g.query, gc.query));
    EXPECT_TRUE(agree(g.key, gc.key));
    EXPECT_TRUE(agree(*g.attn_mask, *gc.attn_mask));
    const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
    EXPECT_LT(rel_error(*g.attn_mask, r.attn_mask, 0.05 * max_abs(r.attn_mask)), 1e-4);
    EXPECT_LT(rel_error(g.key, r.key, 0.05 * max_abs(r.key)), 1e-4);
  }
}

// Each packed sequence gets its own window, as one SDPA call on it alone: the same bits.
TEST(SlidingWindow, VarlenSequencesAreTheirOwnWindowedCalls) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int64_t> cu_q{0, 70, 71, 71, 200}, cu_k{0, 90, 140, 150, 180};
  const mha::Tensor q = randn({200, 4, 32}, rng), k = randn({180, 2, 32}, rng), v = randn({180, 2, 32}, rng);
  const mha::Tensor grad = randn({200, 4, 32}, rng);
  for (const auto& [left, right, causal] : {std::tuple{16, -1, true}, std::tuple{5, 3, false}, std::tuple{-1, 0, false}}) {
    const mha::SdpaOptions o{.is_causal = causal, .causal_alignment = mha::CausalAlignment::BottomRight,
                             .window_left = left, .window_right = right, .enable_gqa = true, .num_threads = 2};
    SCOPED_TRACE("window (" + std::to_string(left) + ", " + std::to_string(right) + ")");
    const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu_q, cu_k, o);
    const auto g = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu_q, cu_k, saved, grad, o);
    for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
      auto rows = [](const mha::TensorView& t, int64_t a, int64_t b) { return t.slice(0, a, b).transpose(0, 1); };
      auto packed = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, t.dtype); };
      const mha::TensorView qs = rows(q, cu_q[s], cu_q[s + 1]), ks = rows(k, cu_k[s], cu_k[s + 1]),
                            vs = rows(v, cu_k[s], cu_k[s + 1]);
      const auto alone = mha::scaled_dot_product_attention_for_training(qs, ks, vs, o);
      EXPECT_TRUE(same_bits(packed(rows(saved.output, cu_q[s], cu_q[s + 1])), alone.output));
      const auto ga = mha::scaled_dot_product_attention_backward(qs, ks, vs, alone, rows(grad, cu_q[s], cu_q[s + 1]), o);
      EXPECT_TRUE(same_bits(packed(rows(g.query, cu_q[s], cu_q[s + 1])), ga.query));
      EXPECT_TRUE(same_bits(packed(rows(g.key, cu_k[s], cu_k[s + 1])), ga.key));
    }
  }
}

// A window of the diagonal alone (0, 0) with Lq > Lk, bottom-right: the first queries' diagonals
// lie before the first key, so they see nothing (zeros, +inf log-sum-exp); the others see one key
// each, so their output is that key's value row.
TEST(SlidingWindow, TheDiagonalAloneAndRowsThatSeeNoKey) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 9, 16}, rng), k = randn({1, 2, 5, 16}, rng), v = randn({1, 2, 5, 8}, rng);
  const mha::SdpaOptions o{.causal_alignment = mha::CausalAlignment::BottomRight, .window_left = 0, .window_right = 0};
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(saved.lse.view().at({0, h, i}), INFINITY);
      for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(saved.output.view().at({0, h, i, d}), 0.0f);
    }
    for (int64_t i = 4; i < 9; ++i)
      for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(saved.output.view().at({0, h, i, d}), v.view().at({0, h, i - 4, d}));
  }
}

// Windows wider than the sequences (the largest int64 included) bound nothing: the bits of the
// call without them (and no overflow on the way, which the sanitizer build would report).
TEST(SlidingWindow, WindowsWiderThanTheSequencesBoundNothing) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 70, 16}, rng), k = randn({1, 2, 90, 16}, rng), v = randn({1, 2, 90, 16}, rng);
  const int64_t huge = std::numeric_limits<int64_t>::max();
  for (const auto alignment : {mha::CausalAlignment::TopLeft, mha::CausalAlignment::BottomRight}) {
    const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, {.causal_alignment = alignment});
    for (const auto& [left, right] : {std::pair{huge, huge}, std::pair{int64_t{160}, int64_t{-1}},
                                      std::pair{int64_t{-1}, int64_t{160}}}) {
      const mha::SdpaOptions o{.causal_alignment = alignment, .window_left = left, .window_right = right};
      EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, o), plain)) << left << ", " << right;
    }
  }
}

TEST(SlidingWindow, BadWindowsAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 8, 16}, rng), k = randn({1, 2, 8, 16}, rng);
  expect_error([&] { mha::scaled_dot_product_attention(q, k, k, {.window_left = -2}); },
               "window_left, window_right: expected -1 (unbounded) or a key count >= 0, got (-2, -1)");
  expect_error([&] { mha::scaled_dot_product_attention(q, k, k, {.window_right = -5}); }, "got (-1, -5)");
  const std::vector<int64_t> cu{0, 8};
  expect_error([&] {
    mha::scaled_dot_product_attention_varlen(q.view().select(0, 0).transpose(0, 1), k.view().select(0, 0).transpose(0, 1),
                                             k.view().select(0, 0).transpose(0, 1), cu, cu, {.window_left = -3});
  }, "window_left, window_right");
}

}  // namespace
