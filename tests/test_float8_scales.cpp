// Scaled float8 keys and values (SdpaOptions::k_descale, v_descale; CacheWriteScales): a call
// attends over k * k_descale and v * v_descale, one scale per key/value head (per batch entry
// where given). Held against the float64 reference on keys and values dequantised here, in
// float64, from the definition; against the documented fold of one scale for the tensor (the
// softmax scale times k_descale, the output times v_descale); per sequence in paged and packed
// calls; and writes into float8 caches divide by the scales before rounding, bit for bit as
// PyTorch's (x.float() / scale).to(float8) does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::agree;
using mha_test::expect_error;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

// Scales of one of the shapes a call takes, and their values per (batch entry, key/value head).
struct Scales {
  mha::Tensor tensor;
  std::vector<double> per_head;  // [B * Hkv], b major
};

// shape_kind 0: [] (one for the tensor), 1: [Hkv], 2: [B, Hkv], 3: [B, 1]; values log-uniform in
// [lo, hi] (never 1, so a scale left out or applied twice shows).
Scales draw_scales(std::mt19937_64& rng, int64_t batch, int64_t heads, int shape_kind, double lo, double hi) {
  std::uniform_real_distribution<double> u(std::log(lo), std::log(hi));
  const mha::Shape shapes[] = {{}, {heads}, {batch, heads}, {batch, 1}};
  Scales s;
  s.tensor = mha::Tensor::empty(shapes[shape_kind]);
  for (int64_t i = 0; i < s.tensor.numel(); ++i) {
    float x = static_cast<float>(std::exp(u(rng)));
    if (x == 1.0f) x = 1.5f;
    s.tensor.data<float>()[i] = x;
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = shape_kind == 0 ? 0 : shape_kind == 1 ? h : shape_kind == 2 ? b * heads + h : b;
      s.per_head.push_back(s.tensor.data<float>()[i]);
    }
  return s;
}

mha::Tensor filled(const mha::Shape& shape, float value = 1.0f) {
  mha::Tensor t = mha::Tensor::empty(shape);
  std::fill_n(t.data<float>(), t.numel(), value);
  return t;
}

// x8 [B, Hkv, L, D] as float64 times its head's scale: the keys or values a scaled call means.
mha::Tensor dequantised(const mha::Tensor& x8, const std::vector<double>& per_head) {
  mha::Tensor x = mha::Tensor::copy_of(x8, mha::DType::f64);
  const int64_t rows = x.size(2) * x.size(3), heads = x.size(0) * x.size(1);
  for (int64_t t = 0; t < heads; ++t)
    for (int64_t e = 0; e < rows; ++e) x.data<double>()[t * rows + e] *= per_head[static_cast<size_t>(t)];
  return x;
}

// Every kernel (decoding dot and row modes, the tile kernel, keys widened once per head), every
// ISA, both formats, float32 and bfloat16 queries, each shape of scales: the output within 2e-5
// of the largest against float64 on the dequantised keys and values for float32 queries (the
// float8 tests' bound: scores of a few units), within 8e-3 for bfloat16 (one rounding of the
// output, 2^-8 relative, twice over); the weights the reference's. Rows of padding (mask values
// alone, which the forward writes from the mask) are scaled too.
TEST(Float8Scales, CallsAttendOverScaledKeysAndValues) {
  std::mt19937_64 rng(test_seed());
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  for (int n = 0; n < 24; ++n) {
    const mha::DType eight = n % 2 ? mha::DType::f8e5m2 : mha::DType::f8e4m3;
    const mha::DType q_dtype = n / 2 % 2 ? mha::DType::bf16 : mha::DType::f32;
    const int64_t lqs[] = {1, 3, 20, 60, 530, 2};
    const int64_t b = 2, hkv = 1 + pick(rng) % 2, hq = hkv * (1 + pick(rng) % 3), lq = lqs[n / 4];
    const int64_t lk = lq == 530 ? 100 : 1 + pick(rng) % 150, d = n % 3 ? 64 : 40;
    const mha::Tensor q = randn({b, hq, lq, d}, rng, q_dtype);
    const mha::Tensor k8 = randn({b, hkv, lk, d}, rng, eight), v8 = randn({b, hkv, lk, d}, rng, eight);
    const Scales ks = draw_scales(rng, b, hkv, n % 4, 0.125, 2.0);
    const Scales vs = draw_scales(rng, b, hkv, (n + 1) % 4, 1.0 / 64, 64.0);
    mha::SdpaOptions o;
    o.enable_gqa = hq != hkv;
    o.is_causal = pick(rng) % 2 == 0;
    o.causal_alignment = mha::CausalAlignment::BottomRight;
    if (pick(rng) % 3 == 0) o.window_left = pick(rng) % 30;
    mha::Tensor mask;  // Hugging Face's padding rows (finfo.min throughout) in a third of the cases
    if (n % 3 == 1) {
      mask = randn({lq, lk}, rng);
      for (int64_t i = 0; i < std::min<int64_t>(lq, 2) * lk; ++i) mask.data<float>()[i] = std::numeric_limits<float>::lowest();
      o.attn_mask = mask.view();
    }
    o.k_descale = ks.tensor.view();
    o.v_descale = vs.tensor.view();
    const std::string what = std::string(mha::dtype_name(eight)) + " " + std::string(mha::dtype_name(q_dtype)) +
                             " query, Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv) + " Lq=" +
                             std::to_string(lq) + " Lk=" + std::to_string(lk) + " d=" + std::to_string(d) +
                             " scales " + ks.tensor.view().shape_str() + ", " + vs.tensor.view().shape_str() +
                             (mask.defined() ? " padding mask" : "");
    SCOPED_TRACE(what);
    mha::SdpaOptions plain = o;
    plain.k_descale.reset();
    plain.v_descale.reset();
    const auto ref = mha::reference::scaled_dot_product_attention(q, dequantised(k8, ks.per_head),
                                                                  dequantised(v8, vs.per_head), plain);
    if (q_dtype == mha::DType::f32)  // the reference's own scales: the same float64 products
      EXPECT_LT(rel_error(mha::reference::scaled_dot_product_attention(q, k8, v8, o).output, ref.output), 1e-12);
    for (mha::detail::Isa isa : mha::detail::supported_isas()) {
      mha::detail::force_isa(isa);
      SCOPED_TRACE(mha::detail::isa_name(isa));
      const mha::Tensor out = mha::scaled_dot_product_attention(q, k8, v8, o);
      ASSERT_EQ(out.dtype(), q_dtype);
      EXPECT_LT(rel_error(out, ref.output), q_dtype == mha::DType::f32 ? 2e-5 : 8e-3);
      if (q_dtype != mha::DType::f32) continue;
      const auto w = mha::scaled_dot_product_attention_with_weights(q, k8, v8, o);
      EXPECT_LT(rel_error(w.output, ref.output), 2e-5);
      EXPECT_LT(rel_error(w.weights, ref.weights), 2e-5);
    }
    mha::detail::force_isa(std::nullopt);
  }
}

// One scale for the tensor is the documented fold: the softmax scale times k_descale and the
// output times v_descale, to float32 rounding (the fold multiplies the scale in float32); the
// log-sum-exp of the training forward too. Scales of 1 change no bit.
TEST(Float8Scales, OneScaleForTheTensorIsTheFold) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int64_t lq : {1, 8, 40}) {
      SCOPED_TRACE("Lq=" + std::to_string(lq));
      const mha::Tensor q = randn({2, 4, lq, 64}, rng), k8 = randn({2, 2, 90, 64}, rng, mha::DType::f8e4m3);
      const mha::Tensor v8 = randn({2, 2, 90, 64}, rng, mha::DType::f8e4m3);
      mha::Tensor kd = mha::Tensor::empty({}), vd = mha::Tensor::empty({});
      kd.data<float>()[0] = 0.37f;
      vd.data<float>()[0] = 12.5f;
      mha::SdpaOptions o;
      o.enable_gqa = true;
      o.is_causal = lq > 1;
      mha::SdpaOptions folded = o;
      folded.scale = 0.125 * 0.37f;
      o.k_descale = kd.view();
      o.v_descale = vd.view();
      const auto scaled = mha::scaled_dot_product_attention_for_training(q, k8, v8, o);
      const auto fold = mha::scaled_dot_product_attention_for_training(q, k8, v8, folded);
      mha::Tensor want = mha::Tensor::copy_of(fold.output, mha::DType::f64);
      for (int64_t i = 0; i < want.numel(); ++i) want.data<double>()[i] *= 12.5;
      EXPECT_LT(rel_error(scaled.output, want), 1e-6);
      EXPECT_LT(rel_error(scaled.lse, fold.lse), 1e-6);
      kd.data<float>()[0] = 1.0f;
      vd.data<float>()[0] = 1.0f;
      mha::SdpaOptions unscaled = o;
      unscaled.k_descale.reset();
      unscaled.v_descale.reset();
      EXPECT_TRUE(agree(mha::scaled_dot_product_attention(q, k8, v8, o),
                        mha::scaled_dot_product_attention(q, k8, v8, unscaled)));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Writing rows through the scales and reading them back with the same scales: each sequence and
// head divides by its own scale ([B, Hkv]) as it is written, bit for bit the float32 division
// rounded to the format, and the paged call (in place for decoding, gathered for a prompt chunk)
// and the packed call read each sequence with its own scales (the reference on the rows
// dequantised here).
TEST(Float8Scales, PagedWritesAndReadsUseEachSequencesScales) {
  std::mt19937_64 rng(test_seed());
  const int64_t pages = 10, hkv = 2, page_size = 16, d = 32, batch = 2;
  std::vector<int32_t> order(pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const std::vector<int32_t> table = {order[0], order[1], order[2], order[3], order[4],
                                      order[5], order[6], order[7], order[8], order[9]};
  const std::vector<int64_t> lens = {70, 53}, empty_lens = {0, 0};
  for (mha::DType eight : {mha::DType::f8e4m3, mha::DType::f8e5m2}) {
    SCOPED_TRACE(std::string(mha::dtype_name(eight)));
    const mha::Tensor kc = mha::Tensor::zeros({pages, hkv, page_size, d}, eight);
    const mha::Tensor vc = mha::Tensor::zeros({pages, hkv, page_size, d}, eight);
    const Scales ks = draw_scales(rng, batch, hkv, 2, 1.0 / 16, 16.0), vs = draw_scales(rng, batch, hkv, 2, 1.0 / 16, 16.0);
    // The rows, written as a prompt of 70 and 53 positions in bfloat16 (packed, one call).
    const std::vector<int64_t> cu = {0, 70, 123};
    const mha::Tensor key = randn({123, hkv, d}, rng, mha::DType::bf16), value = randn({123, hkv, d}, rng, mha::DType::bf16);
    mha::CacheWriteScales w;
    w.k_descale = ks.tensor.view();
    w.v_descale = vs.tensor.view();
    mha::write_paged_cache_varlen(key, value, cu, kc, vc, table, empty_lens, w);
    // Each row as written: the float32 quotient rounded; and the rows dequantised in float64.
    const mha::Tensor key32 = mha::Tensor::copy_of(key, mha::DType::f32), value32 = mha::Tensor::copy_of(value, mha::DType::f32);
    auto widen = [&](uint8_t bits) {
      return eight == mha::DType::f8e4m3 ? static_cast<float>(mha::float8_e4m3::from_bits(bits))
                                         : static_cast<float>(mha::float8_e5m2::from_bits(bits));
    };
    std::vector<mha::Tensor> k_rows, v_rows;  // [1, Hkv, len, d] per sequence, float64
    for (int64_t b = 0; b < batch; ++b) {
      mha::Tensor kr = mha::Tensor::empty({1, hkv, lens[b], d}, mha::DType::f64), vr = kr.clone();
      for (int64_t j = 0; j < lens[b]; ++j) {
        const int32_t page = table[b * 5 + j / page_size];
        for (int64_t h = 0; h < hkv; ++h)
          for (int64_t e = 0; e < d; ++e) {
            const int64_t cache_at = ((page * hkv + h) * page_size + j % page_size) * d + e;
            const int64_t row_at = ((cu[b] + j) * hkv + h) * d + e, out_at = (h * lens[b] + j) * d + e;
            for (auto [src, cache, scales, out] : {std::tuple{&key32, &kc, &ks, &kr}, std::tuple{&value32, &vc, &vs, &vr}}) {
              const float scale = static_cast<float>(scales->per_head[b * hkv + h]);
              const float quotient = src->data<float>()[row_at] / scale;
              const uint8_t want = eight == mha::DType::f8e4m3 ? mha::float8_e4m3(quotient).bits : mha::float8_e5m2(quotient).bits;
              const uint8_t got = cache->data<uint8_t>()[cache_at];
              ASSERT_EQ(got, want) << "sequence " << b << " position " << j << " head " << h << " element " << e
                                   << (src == &key32 ? " (key)" : " (value)");
              out->data<double>()[out_at] = static_cast<double>(widen(got)) * scale;
            }
          }
      }
      k_rows.push_back(kr);
      v_rows.push_back(vr);
    }
    mha::SdpaOptions o;
    o.enable_gqa = true;
    o.is_causal = true;
    o.causal_alignment = mha::CausalAlignment::BottomRight;
    o.k_descale = ks.tensor.view();
    o.v_descale = vs.tensor.view();
    mha::SdpaOptions plain = o;
    plain.k_descale.reset();
    plain.v_descale.reset();
    for (mha::detail::Isa isa : mha::detail::supported_isas()) {
      mha::detail::force_isa(isa);
      SCOPED_TRACE(mha::detail::isa_name(isa));
      for (int64_t lq : {1, 3, 40}) {
        SCOPED_TRACE("Lq=" + std::to_string(lq));
        const mha::Tensor q = randn({batch, 2 * hkv, lq, d}, rng);
        const mha::Tensor out = mha::paged_attention(q, kc, vc, table, lens, o);
        for (int64_t b = 0; b < batch; ++b) {
          const mha::TensorView qb = q.view().slice(0, b, b + 1);
          const auto ref = mha::reference::scaled_dot_product_attention(qb, k_rows[b], v_rows[b], plain);
          EXPECT_LT(rel_error(out.view().slice(0, b, b + 1), ref.output), 2e-5) << "sequence " << b;
        }
      }
    }
    mha::detail::force_isa(std::nullopt);
    // Packed: the same keys as packed rows, the queries 2 and 5 rows per sequence.
    const std::vector<int64_t> cu_q = {0, 2, 7};
    const mha::Tensor q = randn({7, 2 * hkv, d}, rng);
    mha::Tensor k8 = mha::Tensor::empty({123, hkv, d}, eight), v8 = k8.clone();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < lens[b]; ++j)
        for (int64_t h = 0; h < hkv; ++h) {
          const int32_t page = table[b * 5 + j / page_size];
          copy_into(kc.view().select(0, page).select(0, h).select(0, j % page_size), k8.view().select(0, cu[b] + j).select(0, h));
          copy_into(vc.view().select(0, page).select(0, h).select(0, j % page_size), v8.view().select(0, cu[b] + j).select(0, h));
        }
    const mha::Tensor out = mha::scaled_dot_product_attention_varlen(q, k8, v8, cu_q, cu, o);
    for (int64_t b = 0; b < batch; ++b) {
      const mha::TensorView qb = q.view().slice(0, cu_q[b], cu_q[b + 1]).transpose(0, 1).unsqueeze(0);
      const auto ref = mha::reference::scaled_dot_product_attention(qb, k_rows[b], v_rows[b], plain);
      const mha::TensorView got = out.view().slice(0, cu_q[b], cu_q[b + 1]).transpose(0, 1).unsqueeze(0);
      EXPECT_LT(rel_error(got, ref.output), 2e-5) << "packed sequence " << b;
    }
  }
}

TEST(Float8Scales, BadScalesAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 3, 16}, rng), k8 = randn({2, 2, 9, 16}, rng, mha::DType::f8e4m3);
  const mha::Tensor v8 = randn({2, 2, 9, 16}, rng, mha::DType::f8e4m3);
  auto call = [&](const mha::Tensor& scales, const mha::TensorView& k, const mha::TensorView& v, bool value = false) {
    mha::SdpaOptions o;
    o.enable_gqa = true;
    (value ? o.v_descale : o.k_descale) = scales.view();
    (void)mha::scaled_dot_product_attention(q.view(), k, v, o);
  };
  mha::Tensor good = mha::Tensor::empty({2});
  good.data<float>()[0] = 0.5f, good.data<float>()[1] = 2.0f;
  const mha::Tensor k = mha::Tensor::copy_of(k8, mha::DType::f32);
  expect_error([&] { call(good, k, k); },
               "k_descale: dequantisation scales are taken with float8 keys and values (float8_e4m3fn or "
               "float8_e5m2), got keys of dtype float32");
  expect_error([&] { call(mha::Tensor::copy_of(good, mha::DType::f64), k8, v8); },
               "k_descale: expected dtype float32, got float64");
  expect_error([&] { call(filled({3}), k8, v8, true); },
               "v_descale: expected one scale per key/value head, shape [], [Hkv] or broadcastable to the batch "
               "dimensions and key/value heads [2, 2], got [3]");
  expect_error([&] { call(filled({4, 2}), k8, v8); }, "got [4, 2]");
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    mha::Tensor s = good.clone();
    s.data<float>()[1] = bad;
    expect_error([&] { call(s, k8, v8, true); }, "v_descale: expected finite scales > 0, got");
  }
  mha::Tensor zero = good.clone();
  zero.data<float>()[1] = 0.0f;
  expect_error([&] { call(zero, k8, v8); }, "k_descale: expected finite scales > 0, got 0 at index [1]");
  mha::Tensor grid = filled({2, 2});
  grid.data<float>()[2] = -2.0f;
  expect_error([&] { call(grid, k8, v8, true); }, "v_descale: expected finite scales > 0, got -2 at index [1, 0]");
  // The reference's backward takes no scales (the kernels' takes no float8 at all).
  mha::SdpaOptions o;
  o.enable_gqa = true;
  o.k_descale = good.view();
  expect_error([&] { (void)mha::reference::scaled_dot_product_attention_backward(q, k8, v8, randn({2, 4, 3, 16}, rng), o); },
               "k_descale: float8 keys and values with scales are for inference");
  // Paged: [B, Hkv] with another B; writes into a bfloat16 cache; bad values stop a write before any row.
  const mha::Tensor kc = mha::Tensor::zeros({4, 2, 8, 16}, mha::DType::f8e5m2), vc = kc.clone();
  const std::vector<int32_t> table = {0, 1, 2, 3};
  const std::vector<int64_t> lens = {5, 6};
  o.k_descale = filled({3, 2}).view();
  expect_error([&] { (void)mha::paged_attention(q, kc, vc, table, lens, o); },
               "k_descale: expected shape [], [Hkv] or [B, Hkv] (B = 2), got [3, 2]");
  const mha::Tensor rows = randn({2, 2, 1, 16}, rng);
  mha::CacheWriteScales w;
  w.v_descale = good.view();
  const mha::Tensor bc = mha::Tensor::zeros({4, 2, 8, 16}, mha::DType::bf16);
  expect_error([&] { mha::write_paged_cache(mha::Tensor::copy_of(rows, mha::DType::bf16), mha::Tensor::copy_of(rows, mha::DType::bf16), bc, bc, table, lens, w); },
               "v_descale: scales are taken for float8 caches (float8_e4m3fn or float8_e5m2), got bfloat16 caches");
  w.v_descale = zero.view();
  expect_error([&] { mha::write_paged_cache(rows, rows, kc, vc, table, lens, w); }, "v_descale: expected finite scales > 0");
  EXPECT_TRUE(mha_test::max_abs(kc) == 0 && mha_test::max_abs(vc) == 0);
  const std::vector<int64_t> cu = {0, 3};
  expect_error([&] {
    mha::SdpaOptions packed;
    packed.v_descale = filled({2, 2}).view();
    (void)mha::scaled_dot_product_attention_varlen(randn({3, 2, 16}, rng), randn({3, 2, 16}, rng, mha::DType::f8e4m3),
                                                   randn({3, 2, 16}, rng, mha::DType::f8e4m3), cu, cu, packed);
  }, "v_descale: expected shape [], [Hkv] or [sequences, Hkv] (1 sequences), got [2, 2]");
}

}  // namespace
