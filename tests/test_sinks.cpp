// Attention sinks (SdpaOptions::sinks, gpt-oss's per-head sink logits): against the float64
// reference, which adds exp(sink) to each row's softmax denominator from the definition, on every
// ISA and dtype, with causality, masks (rows that see no key), windows, ALiBi, GQA and dropout:
// output, weights, log-sum-exp (which includes the sink) and the gradients of q, k, v and the
// sinks; sinks far above and below the scores; variable-length and paged calls give each
// sequence its own call's bits; bad sinks are clear errors.
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

using mha_test::abs_of;
using mha_test::agree;
using mha_test::expect_error;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

struct SinkCase {
  mha::Tensor q, k, v, grad, sinks, mask, slopes;
  mha::SdpaOptions options;
  std::string describe;
};

SinkCase draw_case(std::mt19937_64& rng, mha::DType dtype) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  SinkCase c;
  const int64_t b = 1 + pick(rng) % 2, hkv = 1 + pick(rng) % 2, hq = hkv * (1 + pick(rng) % 2);
  const int64_t lqs[] = {1, 3, 17, 50}, lks[] = {1, 9, 40, 70};
  const int64_t lq = lqs[pick(rng) % 4], lk = lks[pick(rng) % 4];
  const int64_t dims[] = {8, 16, 32, 64};
  const int64_t dk = dims[pick(rng) % 4], dv = pick(rng) % 3 == 0 ? dims[pick(rng) % 4] : dk;
  c.q = randn({b, hq, lq, dk}, rng, dtype);
  c.k = randn({b, hkv, lk, dk}, rng, dtype);
  c.v = randn({b, hkv, lk, dv}, rng, dtype);
  c.grad = randn({b, hq, lq, dv}, rng, dtype);
  // Sinks around the scores' range, some far above (rows mostly sink) or below (nearly none).
  c.sinks = mha::Tensor::empty({hq}, dtype == mha::DType::f64 ? mha::DType::f64 : mha::DType::f32);
  std::uniform_real_distribution<double> around(-3.0, 3.0);
  for (int64_t h = 0; h < hq; ++h) {
    const int kind = pick(rng) % 6;
    const double s = kind == 0 ? 12.0 : kind == 1 ? -30.0 : around(rng);
    if (dtype == mha::DType::f64) c.sinks.data<double>()[h] = s;
    else c.sinks.data<float>()[h] = static_cast<float>(s);
  }
  c.options.sinks = c.sinks.view();
  c.options.enable_gqa = hq != hkv;
  c.options.is_causal = pick(rng) % 2 == 0;
  c.options.causal_alignment = pick(rng) % 2 == 0 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (pick(rng) % 3 == 0) {  // a bool mask with some rows that see no key at all
    c.mask = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) c.mask.data<uint8_t>()[i * lk + j] = i % 5 != 1 && pick(rng) % 4 != 0;
    c.options.attn_mask = c.mask.view();
  }
  if (pick(rng) % 4 == 0) c.options.window_left = pick(rng) % 12;
  if (pick(rng) % 4 == 0) {
    c.slopes = mha::Tensor::empty({hq}, c.sinks.dtype());
    for (int64_t h = 0; h < hq; ++h) {
      if (dtype == mha::DType::f64) c.slopes.data<double>()[h] = 0.05 * static_cast<double>(h + 1);
      else c.slopes.data<float>()[h] = 0.05f * static_cast<float>(h + 1);
    }
    c.options.alibi_slopes = c.slopes.view();
  }
  if (pick(rng) % 5 == 0) {
    c.options.dropout_p = 0.2;
    c.options.dropout_seed = pick(rng);
  }
  c.describe = std::string(mha::dtype_name(dtype)) + " B=" + std::to_string(b) + " Hq=" + std::to_string(hq) +
               " Hkv=" + std::to_string(hkv) + " Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk) +
               " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) + (c.options.is_causal ? " causal" : "") +
               (c.mask.defined() ? " mask" : "") + " window_left=" + std::to_string(c.options.window_left) +
               (c.slopes.defined() ? " alibi" : "") + (c.options.dropout_p > 0 ? " dropout" : "");
  return c;
}

// log(sum_j exp(s_j) + exp(sink)) of each row from the reference's weights and the call's own
// lse without sinks: the lse with the sink is logaddexp(lse_without, sink).
double logaddexp(double a, double b) {
  if (std::isinf(a) && a > 0) return b;  // (+inf: a row with no key)
  const double top = std::max(a, b);
  return top + std::log(std::exp(a - top) + std::exp(b - top));
}

// Outputs are judged against the larger of their largest element and their terms' size
// (mha_test::terms_magnitude: rows mostly sink can cancel too).
// float32: outputs and weights within 2e-5 of the largest (the SDPA tests' bound: float32
// statistics over up to 70 keys; the sink's share is one more float32 multiply), gradients
// within 1e-4 judged against 5% of the largest (cancelling sums); the sinks' gradient sums
// B Lq products of two O(1) rows in float64 from float32 rows: 1e-4 too, judged against 5% of its
// sums without cancellation. bfloat16: outputs and weights 1e-2 (each rounded once to 8 bits);
// its gradients are the float32 path's on the rounded output, bit for bit (as the backward tests
// hold every bfloat16 backward; within bfloat16 rounding of it where the tile unit takes the
// backward). float64: 1e-12 / 1e-10.
TEST(Sinks, MatchFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 12; ++n) {
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f64};
      const mha::DType dtype = dtypes[n % 3];
      const SinkCase c = draw_case(rng, dtype);
      SCOPED_TRACE(c.describe);
      const double out_tol = dtype == mha::DType::f64 ? 1e-12 : dtype == mha::DType::bf16 ? 1e-2 : 2e-5;
      const double grad_tol = dtype == mha::DType::f64 ? 1e-10 : dtype == mha::DType::bf16 ? 1e-2 : 1e-4;
      const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
      const double terms = mha_test::terms_magnitude(c.q, c.k, c.v, c.options);
      const mha::Tensor out = mha::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
      EXPECT_LT(rel_error(out, ref.output, terms), out_tol);
      const auto w = mha::scaled_dot_product_attention_with_weights(c.q, c.k, c.v, c.options);
      EXPECT_LT(rel_error(w.output, ref.output, terms), out_tol);
      EXPECT_LT(rel_error(w.weights, ref.weights), out_tol);
      const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, c.options);
      EXPECT_TRUE(agree(saved.output, out));
      // The lse includes the sink: logaddexp of the call's lse without sinks and the sink.
      mha::SdpaOptions plain = c.options;
      plain.sinks.reset();
      const auto without = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, plain);
      const mha::Tensor l = mha::Tensor::copy_of(saved.lse, mha::DType::f64);
      const mha::Tensor l0 = mha::Tensor::copy_of(without.lse, mha::DType::f64);
      const mha::Tensor s64 = mha::Tensor::copy_of(c.sinks, mha::DType::f64);
      const int64_t hq = c.q.size(1), lq = c.q.size(2);
      for (int64_t r = 0; r < l.numel(); ++r) {
        const double want = logaddexp(l0.data<double>()[r], s64.data<double>()[r / lq % hq]);
        ASSERT_NEAR(l.data<double>()[r], want, (dtype == mha::DType::f64 ? 1e-13 : 1e-6) * std::max(1.0, std::abs(want)))
            << "row " << r;
      }
      const auto g = mha::scaled_dot_product_attention_backward(c.q, c.k, c.v, saved, c.grad, c.options);
      if (dtype == mha::DType::bf16) {
        // The training forward within bfloat16 rounding of the float32 path on widened copies, its
        // log-sum-exp within 2e-4 (the AMX kernel, where it takes the call, sums exponentials of
        // its own, 7.5e-5 relative each, of scores summed in another order). Gradients from
        // D = rowsum(dO O) on the rounded output, as every bfloat16 backward: the float32 path on
        // widened copies, that rounded output and that log-sum-exp, rounded once.
        auto wide = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
        const auto saved32 = mha::scaled_dot_product_attention_for_training(wide(c.q), wide(c.k), wide(c.v), c.options);
        EXPECT_LT(rel_error(saved.output, saved32.output, terms), out_tol);
        for (int64_t r = 0; r < saved.lse.numel(); ++r) {
          const float a = saved.lse.data<float>()[r], want = saved32.lse.data<float>()[r];
          ASSERT_NEAR(a, want, 2e-4 * std::max(1.0f, std::abs(want))) << "row " << r;
        }
        const mha::AttentionForTraining rounded{wide(saved.output), saved.lse};
        const auto g32 = mha::scaled_dot_product_attention_backward(wide(c.q), wide(c.k), wide(c.v), rounded,
                                                                    wide(c.grad), c.options);
        if (mha_test::tile_unit_backward(dtype, c.q.size(2), c.k.size(2), c.q.size(3), c.v.size(3))) {
          mha_test::expect_near_float32_path(g, g32);
        } else {
          EXPECT_TRUE(agree(g.query, mha::Tensor::copy_of(g32.query, dtype)));
          EXPECT_TRUE(agree(g.key, mha::Tensor::copy_of(g32.key, dtype)));
          EXPECT_TRUE(agree(g.value, mha::Tensor::copy_of(g32.value, dtype)));
        }
        EXPECT_TRUE(agree(g.sinks, g32.sinks));  // (from the output, its gradient and the lse alone)
        continue;
      }
      const auto rg = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.grad, c.options);
      const double floor = 0.05 * std::max({max_abs(rg.query), max_abs(rg.key), max_abs(rg.value)});
      EXPECT_LT(rel_error(g.query, rg.query, floor), grad_tol);
      EXPECT_LT(rel_error(g.key, rg.key, floor), grad_tol);
      EXPECT_LT(rel_error(g.value, rg.value, floor), grad_tol);
      ASSERT_TRUE(g.sinks.defined());
      EXPECT_EQ(g.sinks.dtype(), c.sinks.dtype());
      // A sink's gradient -sum_rows p_sink rowsum(dO O) cancels within each row and across rows
      // (seed 15937600413733460316: -1.19e-5, its float32 rows off by 3.2e-8): judged against 5%
      // of the same sums without cancellation, the reference's with |dO| and |V|.
      const auto magnitude = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, abs_of(c.v), abs_of(c.grad), c.options);
      EXPECT_LT(rel_error(g.sinks, rg.sinks, 0.05 * max_abs(magnitude.sinks)), grad_tol);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// The reference's own sink against a hand-computed row: one query, two keys with scores 0 and
// log 2 (values 1 and 4) and a sink of log 3: weights 1/6 and 2/6, output 1/6 + 8/6 = 1.5.
TEST(Sinks, ReferenceFollowsTheDefinition) {
  mha::Tensor q = mha::Tensor::zeros({1, 1, 1, 1}), k = mha::Tensor::zeros({1, 1, 2, 1}), v = mha::Tensor::zeros({1, 1, 2, 1});
  q.data<float>()[0] = 1.0f;
  k.data<float>()[1] = static_cast<float>(std::log(2.0));
  v.data<float>()[0] = 1.0f;
  v.data<float>()[1] = 4.0f;
  mha::Tensor sinks = mha::Tensor::empty({1});
  sinks.data<float>()[0] = static_cast<float>(std::log(3.0));
  mha::SdpaOptions o;
  o.scale = 1.0;
  o.sinks = sinks.view();
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
  EXPECT_NEAR(ref.weights.data<double>()[0], 1.0 / 6, 1e-7);
  EXPECT_NEAR(ref.weights.data<double>()[1], 2.0 / 6, 1e-7);
  EXPECT_NEAR(ref.output.data<double>()[0], 1.5, 1e-6);
  EXPECT_NEAR(mha::scaled_dot_product_attention(q, k, v, o).data<float>()[0], 1.5f, 1e-6f);
}

// Sinks of -1000 change nothing measurable (their share underflows); a sink of +1000 leaves
// zeros and an lse of 1000, without overflow; a row that sees no key gives zeros and the sink
// as its lse.
TEST(Sinks, ExtremeSinksAndRowsWithoutKeys) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 4, 16}, rng), k = randn({1, 2, 9, 16}, rng), v = randn({1, 2, 9, 16}, rng);
  mha::Tensor sinks = mha::Tensor::empty({2});
  sinks.data<float>()[0] = -1000.0f;
  sinks.data<float>()[1] = 1000.0f;
  mha::Tensor keep = mha::Tensor::empty({4, 9}, mha::DType::boolean);
  for (int64_t x = 0; x < 36; ++x) keep.data<uint8_t>()[x] = x / 9 != 2;  // row 2 sees no key
  mha::SdpaOptions o;
  o.attn_mask = keep.view();
  const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, o);
  o.sinks = sinks.view();
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  EXPECT_TRUE(agree(mha::Tensor::copy_of(saved.output.view().select(1, 0)), mha::Tensor::copy_of(plain.view().select(1, 0))));
  EXPECT_EQ(max_abs(saved.output.view().select(1, 1)), 0.0);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(saved.lse.data<float>()[4 + i], 1000.0f);
    if (i == 2) EXPECT_EQ(saved.lse.data<float>()[i], -1000.0f);
  }
  const mha::Tensor grad = randn({1, 2, 4, 16}, rng);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
  for (int64_t h = 0; h < 2; ++h) EXPECT_TRUE(std::isfinite(g.sinks.data<float>()[h]));
  EXPECT_EQ(g.sinks.data<float>()[1], 0.0f);  // its rows' outputs are zeros: D = 0
}

// GQA, causal from the bottom right (a decoding step's alignment), with `sinks`.
mha::SdpaOptions grouped_causal(const mha::Tensor& sinks) {
  mha::SdpaOptions o;
  o.enable_gqa = true;
  o.is_causal = true;
  o.causal_alignment = mha::CausalAlignment::BottomRight;
  o.sinks = sinks.view();
  return o;
}

// Variable-length calls: each sequence's output, lse and q/k/v gradients are its own SDPA call's
// bits; the sinks' gradient is the sum of the sequences' (1e-6: summed in another order); a
// sequence with queries and no keys gives zeros and the sinks as its lse.
TEST(Sinks, VarlenSequencesAreTheirOwnCalls) {
  std::mt19937_64 rng(test_seed());
  const int64_t hq = 4, hkv = 2, d = 16;
  const std::vector<int64_t> cu_q{0, 3, 3, 20, 21}, cu_k{0, 5, 9, 40, 40};
  const mha::Tensor q = randn({21, hq, d}, rng), k = randn({40, hkv, d}, rng), v = randn({40, hkv, d}, rng);
  const mha::Tensor grad = randn({21, hq, d}, rng);
  mha::Tensor sinks = randn({hq}, rng);
  const mha::SdpaOptions o = grouped_causal(sinks);
  const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu_q, cu_k, o);
  const auto g = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu_q, cu_k, saved, grad, o);
  mha::Tensor sink_sum = mha::Tensor::zeros({hq}, mha::DType::f64);
  auto heads_first = [](const mha::TensorView& t, int64_t a, int64_t b) { return t.slice(0, a, b).transpose(0, 1).unsqueeze(0); };
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    const mha::TensorView qs = heads_first(q, cu_q[s], cu_q[s + 1]), ks = heads_first(k, cu_k[s], cu_k[s + 1]),
                          vs = heads_first(v, cu_k[s], cu_k[s + 1]), gs = heads_first(grad, cu_q[s], cu_q[s + 1]);
    const mha::Tensor lse_rows = mha::Tensor::copy_of(saved.lse.view().slice(1, cu_q[s], cu_q[s + 1]));
    if (cu_q[s + 1] == cu_q[s]) continue;
    if (cu_k[s + 1] == cu_k[s]) {
      EXPECT_EQ(max_abs(saved.output.view().slice(0, cu_q[s], cu_q[s + 1])), 0.0);
      for (int64_t h = 0; h < hq; ++h) EXPECT_EQ(lse_rows.data<float>()[h], sinks.data<float>()[h]);
      continue;
    }
    const auto alone = mha::scaled_dot_product_attention_for_training(qs, ks, vs, o);
    EXPECT_TRUE(agree(mha::Tensor::copy_of(heads_first(saved.output, cu_q[s], cu_q[s + 1])), alone.output));
    EXPECT_TRUE(agree(lse_rows, alone.lse.view().select(0, 0)));
    const auto ga = mha::scaled_dot_product_attention_backward(qs, ks, vs, alone, gs, o);
    EXPECT_TRUE(agree(mha::Tensor::copy_of(heads_first(g.query, cu_q[s], cu_q[s + 1])), ga.query));
    EXPECT_TRUE(agree(mha::Tensor::copy_of(heads_first(g.key, cu_k[s], cu_k[s + 1])), ga.key));
    for (int64_t h = 0; h < hq; ++h) sink_sum.data<double>()[h] += ga.sinks.data<float>()[h];
  }
  EXPECT_LT(rel_error(g.sinks, sink_sum), 1e-6);
}

// Paged caches: each sequence's rows and lse are its own SDPA call's; no key: zeros, the sink.
TEST(Sinks, PagedSequencesAreTheirOwnCalls) {
  std::mt19937_64 rng(test_seed());
  const int64_t hq = 4, hkv = 2, d = 16, page_size = 8;
  const mha::Tensor pool_k = randn({6, page_size, hkv, d}, rng), pool_v = randn({6, page_size, hkv, d}, rng);
  const mha::TensorView kc = pool_k.view().transpose(1, 2), vc = pool_v.view().transpose(1, 2);
  const std::vector<int32_t> table{4, 1, 0, -1, -1, -1, 2, 5, 3};
  const std::vector<int64_t> lens{19, 0, 24};
  const mha::Tensor q = randn({3, hq, 2, d}, rng);
  mha::Tensor sinks = randn({hq}, rng);
  const mha::SdpaOptions o = grouped_causal(sinks);
  const auto r = mha::paged_attention_with_lse(q, kc, vc, table, lens, o);
  for (int64_t b = 0; b < 3; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    if (lens[b] == 0) {
      EXPECT_EQ(max_abs(r.output.view().select(0, b)), 0.0);
      for (int64_t h = 0; h < hq; ++h) EXPECT_EQ(r.lse.data<float>()[(b * hq + h) * 2], sinks.data<float>()[h]);
      continue;
    }
    const mha::Tensor kb = mha_test::gathered_pages(kc, table.data() + b * 3, lens[b]);
    const mha::Tensor vb = mha_test::gathered_pages(vc, table.data() + b * 3, lens[b]);
    const auto alone = mha::scaled_dot_product_attention_for_training(q.view().slice(0, b, b + 1), kb, vb, o);
    EXPECT_TRUE(agree(mha::Tensor::copy_of(r.output.view().slice(0, b, b + 1)), alone.output));
    EXPECT_TRUE(agree(mha::Tensor::copy_of(r.lse.view().slice(0, b, b + 1)), alone.lse));
  }
}

TEST(Sinks, BadSinksAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 4, 3, 8}, rng), k = randn({1, 2, 5, 8}, rng);
  mha::SdpaOptions o;
  o.enable_gqa = true;
  auto call = [&](const mha::Tensor& s) {
    o.sinks = s.view();
    (void)mha::scaled_dot_product_attention(q, k, k, o);
  };
  EXPECT_NO_THROW(call(randn({4}, rng)));
  expect_error([&] { call(randn({2}, rng)); }, "sinks: expected shape [Hq] = [4] (one per query head), got [2]");
  expect_error([&] { call(randn({1, 4}, rng)); }, "sinks: expected shape [Hq] = [4]");
  expect_error([&] { call(randn({4}, rng, mha::DType::bf16)); }, "sinks: expected dtype float32, got bfloat16");
  expect_error([&] { call(randn({4}, rng, mha::DType::f64)); }, "sinks: expected dtype float32, got float64");
  mha::Tensor bad = randn({4}, rng);
  bad.data<float>()[3] = NAN;
  expect_error([&] { call(bad); }, "sinks: expected finite values, got sinks[3]");
  o.sinks = mha::TensorView(nullptr, mha::DType::f32, {4});
  expect_error([&] { (void)mha::scaled_dot_product_attention(q, k, k, o); }, "sinks: data pointer is null");
}

}  // namespace
