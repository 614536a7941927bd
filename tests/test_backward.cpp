// Backward passes: the fused SDPA backward against the float64 reference backward, the reference
// backward against central finite differences of the reference forward, the module backward
// against finite differences of the float64 module reference, and determinism across runs and
// thread counts. Fresh seeds each run (printed; MHA_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::expect_error;
using mha_test::expect_near_float32_path;
using mha_test::tile_unit_backward;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

struct SdpaCase {
  mha::Tensor q, k, v, grad, mask;
  mha::SdpaOptions options;
  bool mask_grad = false;
  std::string describe;
};

SdpaCase draw_sdpa_case(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return static_cast<int64_t>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  // Around the 48-row panels and the row blocks: 64 rows (AVX-512, portable), 72 (AVX2), and 12-row calls.
  static const int64_t sizes[] = {1, 3, 7, 12, 13, 15, 16, 17, 47, 48, 49, 64, 65, 72, 73, 113};
  constexpr int kLast = static_cast<int>(std::size(sizes)) - 1;
  SdpaCase c;
  const int64_t B = pick(1, 2), Hkv = pick(1, 2), Hq = Hkv * pick(1, 3);
  const int64_t Lq = sizes[pick(0, kLast)], Lk = coin(0.3) ? Lq : sizes[pick(0, kLast)];
  const int64_t Dk = pick(1, 40), Dv = coin(0.5) ? Dk : pick(1, 40);
  c.q = randn({B, Hq, Lq, Dk}, rng);
  c.k = randn({B, Hkv, Lk, Dk}, rng);
  c.v = randn({B, Hkv, Lk, Dv}, rng);
  c.grad = randn({B, Hq, Lq, Dv}, rng);
  c.options.enable_gqa = Hq != Hkv;
  c.options.is_causal = coin(0.3);
  c.options.causal_alignment = coin(0.5) ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (coin(0.3)) c.options.scale = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  if (coin(0.3)) {
    c.options.dropout_p = std::uniform_real_distribution<double>(0.05, 0.6)(rng);
    c.options.dropout_seed = rng();
  }
  const int kind = static_cast<int>(pick(0, 2));
  if (kind == 1) {  // float mask, broadcast over batch, with some -inf
    c.mask = randn({Hq, Lq, Lk}, rng);
    for (int64_t i = 0; i < c.mask.numel(); ++i)
      if (coin(0.05)) c.mask.data<float>()[i] = -INFINITY;
    c.options.attn_mask = c.mask.view();
    c.mask_grad = true;
  } else if (kind == 2) {
    c.mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
    for (int64_t i = 0; i < c.mask.numel(); ++i) c.mask.data<bool>()[i] = coin(0.8);
    c.options.attn_mask = c.mask.view();
  }
  c.describe = "B=" + std::to_string(B) + " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) +
               " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " Dk=" + std::to_string(Dk) +
               " Dv=" + std::to_string(Dv) + " causal=" + std::to_string(c.options.is_causal) +
               " dropout=" + std::to_string(c.options.dropout_p) + " mask=" + std::to_string(kind);
  return c;
}

// The one-pass schedule (16 or more key/value head groups) reads a mask that varies along the
// queries from a copy in its tiles' order, where the copy fits (mha::detail::transposed_mask_floats),
// and in place otherwise: the gradients have the same bits either way, and the reference's values.
// Masks of every kind and broadcast, partial tiles, GQA, causality; on every ISA.
TEST(SdpaBackward, MaskTileCopiesGiveTheBitsOfMasksReadInPlace) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int variant = 0; variant < 8; ++variant) {
      const int64_t b = 4, hkv = 4, hq = 8, lq = variant == 3 ? 37 : 100, lk = variant == 3 ? 50 : 130, d = 16;
      const mha::Tensor q = randn({b, hq, lq, d}, rng), k = randn({b, hkv, lk, d}, rng), v = randn({b, hkv, lk, d}, rng);
      const mha::Tensor go = randn({b, hq, lq, d}, rng);
      mha::Tensor mask;
      mha::TensorView view;
      if (variant == 0) {  // additive, [Lq, Lk]
        mask = randn({lq, lk}, rng);
        view = mask.view();
      } else if (variant == 1) {  // bool (true attends), one per head
        mask = mha::Tensor::empty({b, hq, lq, lk}, mha::DType::boolean);
        std::bernoulli_distribution keep(0.8);
        for (int64_t e = 0; e < mask.numel(); ++e) mask.data<uint8_t>()[e] = keep(rng);
        view = mask.view();
      } else if (variant < 4) {  // additive, per batch entry, a transposed view of [B, 1, Lk, Lq]
        mask = randn({b, 1, lk, lq}, rng);
        view = mask.view().transpose(2, 3);
      } else if (variant == 4) {  // additive [Lq, Lk], -inf above the diagonal: tiles it excludes are skipped
        mask = randn({lq, lk}, rng);
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = i + 1; j < lk; ++j) mask.data<float>()[i * lk + j] = -std::numeric_limits<float>::infinity();
        view = mask.view();
      } else if (variant == 7) {  // bool padding [B, Hq, 1, Lk] (read in place, its key panels mapped):
                                  // keys past 30 padded but one per head, the first or last of a
                                  // panel; against the same mask materialised [B, Hq, Lq, Lk]
        mask = mha::Tensor::empty({b, hq, 1, lk}, mha::DType::boolean);
        const int64_t lone[] = {48, 95, 96, 129, -1, -1, -1, -1};
        for (int64_t n = 0; n < b; ++n)
          for (int64_t hh = 0; hh < hq; ++hh)
            for (int64_t j = 0; j < lk; ++j) mask.data<uint8_t>()[(n * hq + hh) * lk + j] = j < 30 || j == lone[hh];
        view = mask.view();
      } else if (variant == 6) {  // bool [B, Hq, Lq, Lk]: causal, and per head one key every query
                                  // sees, the first or last of a 48-key panel causality excludes
        mask = mha::Tensor::empty({b, hq, lq, lk}, mha::DType::boolean);
        const int64_t lone[] = {48, 95, 96, 129, -1, -1, -1, -1};
        for (int64_t n = 0; n < b; ++n)
          for (int64_t hh = 0; hh < hq; ++hh)
            for (int64_t i = 0; i < lq; ++i)
              for (int64_t j = 0; j < lk; ++j)
                mask.data<uint8_t>()[((n * hq + hh) * lq + i) * lk + j] = j <= i || j == lone[hh];
        view = mask.view();
      } else {  // bool [B, 1, Lq, Lk]: causal, padded keys, rows with no key, and lone rows that see
                // every key (the first of each 48-query panel in batch entry 0, the last in 1)
        mask = mha::Tensor::empty({b, 1, lq, lk}, mha::DType::boolean);
        auto sees_all = [](int64_t n, int64_t i) { return n == 0 ? i % 48 == 0 : n == 1 && (i % 48 == 47 || i == 99); };
        for (int64_t n = 0; n < b; ++n)
          for (int64_t i = 0; i < lq; ++i)
            for (int64_t j = 0; j < lk; ++j)
              mask.data<uint8_t>()[(n * lq + i) * lk + j] =
                  sees_all(n, i) || (j <= i && j < lk - 30 * n && !(n == 2 && i % 40 == 5));
        view = mask.view();
      }
      mha::SdpaOptions o{.attn_mask = view, .is_causal = variant == 2 || variant == 3, .enable_gqa = true};
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " variant " + std::to_string(variant));
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto copied = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o);
      std::atomic<int64_t>& cap = mha::detail::transposed_mask_floats();
      const int64_t kept = cap.exchange(0);  // every mask read in place
      mha::SdpaOptions unmapped = o;  // (a padding mask materialised: read in place, no tile skipped)
      mha::Tensor materialised;
      if (variant == 7) {
        materialised = mha::Tensor::copy_of(
            mha::TensorView(view.data, view.dtype, {b, hq, lq, lk}, {view.strides[0], view.strides[1], 0, view.strides[3]}));
        unmapped.attn_mask = materialised.view();
      }
      const auto in_place = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, unmapped);
      mha::detail::skips_excluded_blocks() = false;  // and every tile computed
      const auto computed = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o);
      mha::detail::skips_excluded_blocks() = true;
      cap = kept;
      EXPECT_TRUE(same_bits(copied.query, computed.query));
      EXPECT_TRUE(same_bits(in_place.key, computed.key));
      EXPECT_TRUE(same_bits(in_place.value, computed.value));
      EXPECT_TRUE(same_bits(copied.query, in_place.query));
      EXPECT_TRUE(same_bits(copied.key, in_place.key));
      EXPECT_TRUE(same_bits(copied.value, in_place.value));
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, go, o);
      const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
      EXPECT_LT(rel_error(copied.query, r.query, floor), 1e-4);
      EXPECT_LT(rel_error(copied.key, r.key, floor), 1e-4);
      EXPECT_LT(rel_error(copied.value, r.value, floor), 1e-4);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

TEST(SdpaBackward, MatchesFloat64ReferenceOnEveryIsa) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 40; ++n) {
      const SdpaCase c = draw_sdpa_case(rng);
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + c.describe);
      const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, c.options);
      const auto g = mha::scaled_dot_product_attention_backward(c.q, c.k, c.v, saved, c.grad, c.options, c.mask_grad);
      const auto r = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.grad, c.options);
      // 1e-4: gradients are longer float32 chains than outputs. A gradient that is zero in exact
      // arithmetic (one visible key: dS = dO.v - dO.o with o = v) is what is left of cancelling
      // float32 dot products of length Dv, up to ~1e-5 of the case's largest gradient; it is judged
      // against 5% of that gradient, or of dV with |dO| for dO (the same sums without their
      // cancellation): the gradients themselves can all be small by chance (one key, dropout
      // 0.51, dV a sum of a few dO of either sign: seed 6710299910451952358 on the portable path).
      mha::Tensor grad_magnitude = c.grad.clone();
      for (int64_t e = 0; e < grad_magnitude.numel(); ++e) grad_magnitude.data<float>()[e] = std::fabs(grad_magnitude.data<float>()[e]);
      const auto magnitude = mha::reference::scaled_dot_product_attention_backward(c.q, c.k, c.v, grad_magnitude, c.options);
      const double floor =
          0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value), max_abs(magnitude.value)});
      EXPECT_LT(rel_error(g.query, r.query, floor), 1e-4);
      EXPECT_LT(rel_error(g.key, r.key, floor), 1e-4);
      EXPECT_LT(rel_error(g.value, r.value, floor), 1e-4);
      if (c.mask_grad) EXPECT_LT(rel_error(*g.attn_mask, r.attn_mask, floor), 1e-4);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// With 16 or more (batch, key/value head) groups the backward runs its one-pass schedule.
TEST(SdpaBackward, OnePassScheduleMatchesReference) {
  std::mt19937_64 rng(test_seed());
  const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  for (int n = 0; n < 4 * static_cast<int>(isas.size()); ++n) {
    const mha::detail::Isa isa = isas[n / 4];
    mha::detail::force_isa(isa);
    // The last 48-row panel holds 1, 2 or 3 vectors of 16 (or is full), for queries and keys alike.
    static const int64_t last_panel[] = {5, 29, 41, 48};
    const int64_t Lq = 48 + last_panel[rng() % 4], Lk = 48 + last_panel[rng() % 4];
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk));
    const mha::Tensor q = randn({3, 12, Lq, 20}, rng), k = randn({3, 6, Lk, 20}, rng), v = randn({3, 6, Lk, 9}, rng);
    const mha::Tensor g = randn({3, 12, Lq, 9}, rng);
    mha::Tensor mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = rng() % 5 != 0;
    mha::SdpaOptions o{.is_causal = n % 2 == 1, .causal_alignment = n % 4 == 3 ? mha::CausalAlignment::BottomRight
                                                                         : mha::CausalAlignment::TopLeft,
                       .enable_gqa = true, .dropout_p = n % 4 >= 2 ? 0.2 : 0.0, .dropout_seed = rng()};
    if (n % 4 == 0) o.attn_mask = mask.view();
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o);
    const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
    EXPECT_LT(rel_error(grads.query, r.query), 1e-4) << n;
    EXPECT_LT(rel_error(grads.key, r.key), 1e-4) << n;
    EXPECT_LT(rel_error(grads.value, r.value), 1e-4) << n;
    for (int threads : {1, 3}) {  // the same bits on any thread count
      o.num_threads = threads;
      const auto again = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o);
      EXPECT_TRUE(same_bits(again.query, grads.query) && same_bits(again.key, grads.key) &&
                  same_bits(again.value, grads.value));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// A float mask's gradient from the one-pass schedule (16 head groups and more), which writes dS
// from its tiles as it goes, and zeros for the tiles it skips: against the float64 reference,
// with masks that broadcast along the batch ([1, Hq, Lq, Lk], summed), along everything but the
// rows ([Lq, Lk]) or along the heads and queries (a float key padding mask whose -inf tails
// exclude whole tiles), one per head and batch entry; causality in both alignments (tiles past
// the diagonal skipped), grouped heads, dropout; partial 48-row panels. The same bits on 1 and 3
// threads, and the other gradients the bits of a call that does not ask for the mask's.
TEST(SdpaBackward, OnePassWritesTheMaskGradient) {
  std::mt19937_64 rng(test_seed());
  const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  const int64_t B = 4, hq = 8, hkv = 4, lq = 131, lk = 149, dk = 16, dv = 12;  // 16 groups: one pass
  for (const mha::detail::Isa isa : isas) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 4; ++n) {
      const mha::Tensor q = randn({B, hq, lq, dk}, rng), k = randn({B, hkv, lk, dk}, rng), v = randn({B, hkv, lk, dv}, rng);
      const mha::Tensor g = randn({B, hq, lq, dv}, rng);
      mha::Tensor mask;
      mha::SdpaOptions o{.enable_gqa = true};
      if (n == 0) mask = randn({1, hq, lq, lk}, rng);
      if (n == 1) mask = randn({lq, lk}, rng), o.is_causal = true;
      if (n == 2) {  // entry b keeps its first lk - 50 b keys: from b = 1 on, whole 48-key tiles are -inf
        mask = mha::Tensor::zeros({B, 1, 1, lk});
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = lk - 50 * b; j < lk; ++j)
            if (j >= 0) mask.data<float>()[b * lk + j] = -std::numeric_limits<float>::infinity();
        o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
      }
      if (n == 3) mask = randn({B, hq, lq, lk}, rng), o.dropout_p = 0.2, o.dropout_seed = rng();
      o.attn_mask = mask.view();
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " mask " + mask.shape_str() + (o.is_causal ? " causal" : "") +
                   (o.dropout_p > 0 ? " dropout" : ""));
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, /*attn_mask_grad=*/true);
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
      // 1e-4 against 5% of the largest gradient, as in MatchesFloat64ReferenceOnEveryIsa: dS of a
      // row that sees one key is zero in exact arithmetic and a float32 residue here.
      const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
      EXPECT_LT(rel_error(grads.query, r.query, floor), 1e-4);
      EXPECT_LT(rel_error(grads.key, r.key, floor), 1e-4);
      EXPECT_LT(rel_error(grads.value, r.value, floor), 1e-4);
      ASSERT_TRUE(grads.attn_mask.has_value());
      EXPECT_EQ(grads.attn_mask->sizes(), mask.sizes());
      EXPECT_LT(rel_error(*grads.attn_mask, r.attn_mask, std::max(floor, 0.05 * max_abs(r.attn_mask))), 1e-4);
      if (n == 2) {  // keys past an entry's length: exactly zero (tiles skipped, or P = 0)
        for (int64_t j = lk - 50; j < lk; ++j) EXPECT_EQ(grads.attn_mask->at({1, 0, 0, j}), 0.0) << j;
      }
      for (const int threads : {1, 3}) {
        o.num_threads = threads;
        const auto again = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, true);
        EXPECT_TRUE(same_bits(*again.attn_mask, *grads.attn_mask)) << threads << " threads";
      }
      const auto without = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o);
      EXPECT_TRUE(same_bits(without.query, grads.query) && same_bits(without.key, grads.key) &&
                  same_bits(without.value, grads.value));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Grouped attention whose key and value head counts differ: PyTorch repeats each on its own
// (repeat_interleave by Hq / Hk and by Hq / Hv). The output and every gradient against the float64
// reference on inputs repeated here by hand, the gradients of the repeats summed back here too:
// fewer key heads than value heads and the other way, one key head (a broadcast), keys shared by
// the batch (3-D), a float mask, causality, dropout; float32 on every ISA, bfloat16 and float64.
// Tolerances: float32 1e-5 of the largest output and 1e-4 of the largest gradient (longer
// chains), bfloat16 2e-2 (8-bit inputs), float64 1e-10.
TEST(SdpaBackward, GroupedKeyAndValueHeadCountsThatDiffer) {
  std::mt19937_64 rng(test_seed());
  const int64_t B = 2, lq = 37, lk = 41, dk = 16, dv = 8;
  // t ([h, rows, cols] or [B, h, rows, cols]) as float64 [B, heads, rows, cols]: head i reads t's head i / (heads / h).
  auto repeated = [&](const mha::Tensor& t, int64_t heads) {
    const int64_t h = t.view().size(-3), rows = t.view().size(-2), cols = t.view().size(-1);
    mha::Tensor r = mha::Tensor::empty({B, heads, rows, cols}, mha::DType::f64);
    double* out = r.data<double>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < heads; ++i)
        for (int64_t l = 0; l < rows; ++l)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t src_head = i / (heads / h);
            *out++ = t.view().ndim == 3 ? t.at({src_head, l, c}) : t.at({b, src_head, l, c});
          }
    return r;
  };
  // The gradient of t from the gradient of its repeats, summed over them (and over the batch for 3-D t).
  auto summed_back = [&](const mha::Tensor& full, const mha::Tensor& t) {
    mha::Tensor r = mha::Tensor::zeros(t.sizes(), mha::DType::f64);
    const int64_t heads = full.view().size(1), h = t.view().size(-3), rows = full.view().size(2), cols = full.view().size(3);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < heads; ++i)
        for (int64_t l = 0; l < rows; ++l)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t at = ((t.view().ndim == 3 ? 0 : b) * h + i / (heads / h)) * rows * cols + l * cols + c;
            r.data<double>()[at] += full.at({b, i, l, c});
          }
    return r;
  };
  struct Case {
    int64_t hq, hk, hv;
  };
  const Case cases[] = {{8, 2, 4}, {8, 4, 2}, {6, 1, 2}, {6, 3, 2}};
  const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  for (const mha::detail::Isa isa : isas) {
    mha::detail::force_isa(isa);
    for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16, mha::DType::f64}) {
      if (dtype != mha::DType::f32 && isa != isas.back()) continue;
      for (int n = 0; n < 4; ++n) {
        const Case c = cases[n];
        const mha::Tensor q = randn({B, c.hq, lq, dk}, rng, dtype);
        const mha::Tensor k = n == 1 ? randn({c.hk, lk, dk}, rng, dtype) : randn({B, c.hk, lk, dk}, rng, dtype);
        const mha::Tensor v = randn({B, c.hv, lk, dv}, rng, dtype), g = randn({B, c.hq, lq, dv}, rng, dtype);
        const mha::Tensor mask = randn({lq, lk}, rng, dtype == mha::DType::f64 ? mha::DType::f64 : mha::DType::f32);
        mha::SdpaOptions o{.enable_gqa = true};
        if (n % 2 == 0) o.attn_mask = mask.view();
        if (n >= 2) o.is_causal = true, o.causal_alignment = n == 3 ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
        if (n == 3) o.dropout_p = 0.25, o.dropout_seed = rng();
        SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + std::string(mha::dtype_name(dtype)) + " Hq=" +
                     std::to_string(c.hq) + " Hk=" + std::to_string(c.hk) + " Hv=" + std::to_string(c.hv) +
                     " k " + k.shape_str());
        mha::SdpaOptions plain = o;  // the same call on the repeated inputs: no grouping left
        plain.enable_gqa = false;
        const mha::Tensor kr = repeated(k, c.hq), vr = repeated(v, c.hq);
        const auto r = mha::reference::scaled_dot_product_attention(q, kr, vr, plain);
        const auto rg = mha::reference::scaled_dot_product_attention_backward(q, kr, vr, g, plain);
        const double out_tol = dtype == mha::DType::f32 ? 1e-5 : dtype == mha::DType::bf16 ? 2e-2 : 1e-10;
        const double grad_tol = dtype == mha::DType::f32 ? 1e-4 : out_tol;
        const double terms = mha_test::terms_magnitude(q, kr, vr, plain);
        EXPECT_LT(rel_error(mha::scaled_dot_product_attention(q, k, v, o), r.output, terms), out_tol);
        const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
        EXPECT_LT(rel_error(saved.output, r.output, terms), out_tol);
        const auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o);
        ASSERT_EQ(grads.key.sizes(), k.sizes());
        ASSERT_EQ(grads.value.sizes(), v.sizes());
        const mha::Tensor dk_ref = summed_back(rg.key, k), dv_ref = summed_back(rg.value, v);
        const double floor = 0.05 * std::max({max_abs(rg.query), max_abs(dk_ref), max_abs(dv_ref)});
        EXPECT_LT(rel_error(grads.query, rg.query, floor), grad_tol);
        EXPECT_LT(rel_error(grads.key, dk_ref, floor), grad_tol);
        EXPECT_LT(rel_error(grads.value, dv_ref, floor), grad_tol);
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

TEST(SdpaBackward, StridedInputsAndGradientViews) {
  std::mt19937_64 rng(test_seed());
  // [B, L, H, D] storage viewed as [B, H, L, D]
  const mha::Tensor q = randn({2, 33, 3, 16}, rng), k = randn({2, 20, 3, 16}, rng), v = randn({2, 20, 3, 8}, rng);
  const mha::Tensor g = randn({2, 33, 3, 8}, rng);
  const mha::TensorView qv = q.view().transpose(1, 2), kv = k.view().transpose(1, 2), vv = v.view().transpose(1, 2),
                        gv = g.view().transpose(1, 2);
  const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
  const auto saved = mha::scaled_dot_product_attention_for_training(qv, kv, vv, o);
  const auto grads = mha::scaled_dot_product_attention_backward(qv, kv, vv, saved, gv, o);
  const auto r = mha::reference::scaled_dot_product_attention_backward(qv, kv, vv, gv, o);
  EXPECT_LT(rel_error(grads.query, r.query), 1e-4);
  EXPECT_LT(rel_error(grads.key, r.key), 1e-4);
  EXPECT_LT(rel_error(grads.value, r.value), 1e-4);
}

// float32 q, k, v and output gradients whose rows are not packed (a packed QKV projection's heads)
// are copied packed as the backward reads them: the bits of the backward on packed copies, in the
// one-pass schedule (16 groups), the two passes (4 groups) and the two passes that write the
// mask's gradient, on every ISA.
TEST(SdpaBackward, UnpackedFloat32RowsGiveTheBitsOfPackedCopies) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int variant = 0; variant < 3; ++variant) {
      const int64_t B = variant == 0 ? 4 : 2, hkv = 2, hq = variant == 2 ? 4 : 2, lq = 61 + 40 * variant, lk = 77;
      const int64_t dk = 24, dv = 16;
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " variant " + std::to_string(variant));
      // Q, K and V side by side in one [B, L, H, 3 D]-like row, and the output gradient in [B, Lq, Hq, Dv].
      const mha::Tensor qs = randn({B, lq, hq, dk + 3}, rng), kvs = randn({B, lk, hkv, dk + dv}, rng);
      const mha::Tensor gs = randn({B, lq, hq, dv}, rng);
      const mha::TensorView q = qs.view().slice(3, 3, dk + 3).transpose(1, 2),
                            k = kvs.view().slice(3, 0, dk).transpose(1, 2),
                            v = kvs.view().slice(3, dk, dk + dv).transpose(1, 2), g = gs.view().transpose(1, 2);
      const mha::Tensor qc = mha::Tensor::copy_of(q), kc = mha::Tensor::copy_of(k), vc = mha::Tensor::copy_of(v),
                        gc = mha::Tensor::copy_of(g);
      const mha::Tensor mask = randn({lq, lk}, rng);
      mha::SdpaOptions o{.is_causal = variant == 1, .enable_gqa = true, .dropout_p = variant == 0 ? 0.2 : 0.0,
                         .dropout_seed = rng()};
      if (variant == 2) o.attn_mask = mask.view();
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, variant == 2);
      const auto packed = mha::scaled_dot_product_attention_backward(qc, kc, vc, saved, gc, o, variant == 2);
      EXPECT_TRUE(same_bits(grads.query, packed.query));
      EXPECT_TRUE(same_bits(grads.key, packed.key));
      EXPECT_TRUE(same_bits(grads.value, packed.value));
      if (variant == 2) EXPECT_TRUE(same_bits(*grads.attn_mask, *packed.attn_mask));
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
      EXPECT_LT(rel_error(grads.query, r.query), 1e-4);
      EXPECT_LT(rel_error(grads.key, r.key), 1e-4);
      EXPECT_LT(rel_error(grads.value, r.value), 1e-4);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Central differences of f with respect to every element of `x` (float64), against `analytic`.
// Relative to the gradient's largest element, or to `floor` when that is smaller. The five-point
// stencil, whose error is h^4 f^(5) / 30 plus the loss's rounding, about 2^-53 |f| / h: with
// h = 1e-4, some 1e-11 of the gradients here (the three-point one with h = 1e-6 erred by 1e-9).
double finite_difference_error(mha::Tensor& x, const mha::TensorView& analytic, const std::function<double()>& f,
                               double floor = 1e-12) {
  double worst = 0, scale = std::max(max_abs(analytic), floor);
  const mha::Tensor a = mha::Tensor::copy_of(analytic, mha::DType::f64);
  for (int64_t i = 0; i < x.numel(); ++i) {
    double& xi = x.data<double>()[i];
    const double saved = xi, h = 1e-4;
    auto at = [&](double step) {
      xi = saved + step;
      return f();
    };
    const double difference = (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h);
    xi = saved;
    worst = std::max(worst, std::abs(difference - a.data<double>()[i]));
  }
  // A case whose gradients are all exactly zero (dropout took every weight, no bias) has scale 0:
  // the differences must then be zero too, in absolute terms.
  return scale > 0 ? worst / scale : worst;
}

TEST(SdpaBackward, ReferenceMatchesFiniteDifferences) {
  std::mt19937_64 rng(test_seed());
  mha::Tensor q = randn({1, 4, 5, 3}, rng, mha::DType::f64), k = randn({1, 2, 6, 3}, rng, mha::DType::f64);
  mha::Tensor v = randn({1, 2, 6, 4}, rng, mha::DType::f64), mask = randn({5, 6}, rng, mha::DType::f64);
  const mha::Tensor g = randn({1, 4, 5, 4}, rng, mha::DType::f64);
  mha::Tensor mask32 = mha::Tensor::copy_of(mask, mha::DType::f32);  // masks are float32 in the API
  mha::SdpaOptions o{.attn_mask = mask32.view(), .is_causal = true, .enable_gqa = true, .dropout_p = 0.25,
                     .dropout_seed = rng()};
  const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
  auto loss = [&]() {
    const auto out = mha::reference::scaled_dot_product_attention(q, k, v, o).output;
    double s = 0;
    for (int64_t i = 0; i < out.numel(); ++i) s += out.data<double>()[i] * g.data<double>()[i];
    return s;
  };
  EXPECT_LT(finite_difference_error(q, r.query, loss), 1e-6);
  EXPECT_LT(finite_difference_error(k, r.key, loss), 1e-6);
  EXPECT_LT(finite_difference_error(v, r.value, loss), 1e-6);
  // The mask: perturbed in float32, so a larger step and tolerance.
  double worst = 0;
  for (int64_t i = 0; i < mask32.numel(); ++i) {
    float& m = mask32.data<float>()[i];
    const float saved = m, h = 1e-2f;
    m = saved + h;
    const double plus = loss();
    m = saved - h;
    const double minus = loss();
    m = saved;
    worst = std::max(worst, std::abs((plus - minus) / (2.0 * h) - r.attn_mask.data<double>()[i]));
  }
  EXPECT_LT(worst / max_abs(r.attn_mask), 1e-3);
}

// Up to 16 query rows per key/value head (few_queries_backward.hpp: rows as queries, lanes over
// keys): 1-16 queries, groups of 1-8 heads, key lengths around the 16-key blocks and the 1024-key
// chunks (a top-left causal chunk that no row sees: zero gradients), head dimensions that are not
// whole vectors, every mask kind, dropout, [B, L, H, D] views; on every ISA against the reference,
// the same bits on 1 and 3 threads, and bfloat16 / float16 the float32 kernel's bits rounded once
// (bfloat16 on the tile unit: within its rounding, expect_near_float32_path).
TEST(SdpaBackward, FewRowsPerKeyValueHeadMatchReference) {
  std::mt19937_64 rng(test_seed());
  const int64_t key_lengths[] = {1, 16, 17, 200, 1024, 1025, 2100};
  const int64_t query_lengths[] = {1, 2, 3, 8};
  const int64_t dims[] = {64, 20, 128, 40};
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 28; ++n) {
      const int64_t lq = n % 8 == 3 ? 16 : query_lengths[n % 4];
      const int64_t group = lq >= 8 ? 1 : lq == 3 ? 2 : n % 3 == 0 ? 8 / lq : 1 + n % 2;
      const int64_t hkv = 1 + n % 2, hq = hkv * group, b = 1 + (n / 4) % 2, lk = key_lengths[n % 7];
      const int64_t dk = dims[n % 4], dv = dims[(n + 1) % 4];
      const mha::DType dtype = n % 5 == 3 ? mha::DType::bf16 : n % 5 == 4 ? mha::DType::f16 : mha::DType::f32;
      const mha::Tensor qs = randn({b, lq, hq, dk}, rng), ks = randn({b, lk, hkv, dk}, rng), vs = randn({b, lk, hkv, dv}, rng);
      const mha::Tensor gs = randn({b, lq, hq, dv}, rng);
      auto as = [&](const mha::Tensor& t) { return mha::Tensor::copy_of(t.view().transpose(1, 2), dtype); };
      const mha::Tensor q = as(qs), k = as(ks), v = as(vs), g = as(gs);
      mha::Tensor mask;
      mha::SdpaOptions o{.enable_gqa = true};
      const int kind = n % 3;
      if (kind == 1) {
        mask = randn({lq, lk}, rng);
        for (int64_t e = 0; e < mask.numel(); ++e)
          if (e % 7 == 3) mask.data<float>()[e] = -INFINITY;
      }
      if (kind == 2) {
        mask = mha::Tensor::empty({b, 1, 1, lk}, mha::DType::boolean);
        for (int64_t e = 0; e < mask.numel(); ++e) mask.data<uint8_t>()[e] = e % 5 != 1;
      }
      if (kind > 0) o.attn_mask = mask.view();
      if (n % 4 == 1) o.is_causal = true;  // top-left: the rows see their first keys only
      if (n % 4 == 2) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
      if (n % 6 == 5) o.dropout_p = 0.3, o.dropout_seed = rng();
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " case " + std::to_string(n) + ": Lq=" + std::to_string(lq) +
                   " group=" + std::to_string(group) + " Lk=" + std::to_string(lk) + " Dk=" + std::to_string(dk) +
                   " Dv=" + std::to_string(dv) + " " + std::string(mha::dtype_name(dtype)) + " mask=" +
                   std::to_string(kind) + " dropout=" + std::to_string(o.dropout_p));
      // Views of [B, L, H, D] storage, as a batch-first caller passes them.
      const mha::Tensor qb = mha::Tensor::copy_of(q.view().transpose(1, 2)), kb = mha::Tensor::copy_of(k.view().transpose(1, 2)),
                        vb = mha::Tensor::copy_of(v.view().transpose(1, 2));
      const mha::TensorView qv = qb.view().transpose(1, 2), kv = kb.view().transpose(1, 2), vv = vb.view().transpose(1, 2);
      const auto saved = mha::scaled_dot_product_attention_for_training(qv, kv, vv, o);
      const bool mask_grad = kind == 1;  // the float mask's gradient too (dS, written by the row kernel)
      const auto grads = mha::scaled_dot_product_attention_backward(qv, kv, vv, saved, g, o, mask_grad);
      o.num_threads = 1;
      const auto one = mha::scaled_dot_product_attention_backward(qv, kv, vv, saved, g, o, mask_grad);
      o.num_threads = 3;
      const auto three = mha::scaled_dot_product_attention_backward(qv, kv, vv, saved, g, o, mask_grad);
      for (const auto& [x, y] : {std::pair{&one, &grads}, std::pair{&three, &grads}}) {
        EXPECT_TRUE(same_bits(x->query, y->query));
        EXPECT_TRUE(same_bits(x->key, y->key));
        EXPECT_TRUE(same_bits(x->value, y->value));
        if (mask_grad) EXPECT_TRUE(same_bits(*x->attn_mask, *y->attn_mask));
      }
      if (dtype != mha::DType::f32) {  // the float32 kernel on widened copies, each gradient rounded once
        auto wide = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
        const mha::AttentionForTraining saved32{wide(saved.output), saved.lse};
        const auto g32 = mha::scaled_dot_product_attention_backward(wide(q), wide(k), wide(v), saved32, wide(g), o);
        if (tile_unit_backward(dtype, lq, lk, dk, dv, mask_grad)) {
          expect_near_float32_path(grads, g32);
          continue;
        }
        EXPECT_TRUE(same_bits(grads.query, mha::Tensor::copy_of(g32.query, dtype)));
        EXPECT_TRUE(same_bits(grads.key, mha::Tensor::copy_of(g32.key, dtype)));
        EXPECT_TRUE(same_bits(grads.value, mha::Tensor::copy_of(g32.value, dtype)));
        continue;
      }
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
      mha::Tensor g_magnitude = g.clone();  // as in MatchesFloat64ReferenceOnEveryIsa: the floor of a cancelling gradient
      for (int64_t e = 0; e < g_magnitude.numel(); ++e) g_magnitude.data<float>()[e] = std::fabs(g_magnitude.data<float>()[e]);
      const auto magnitude = mha::reference::scaled_dot_product_attention_backward(q, k, v, g_magnitude, o);
      const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value), max_abs(magnitude.value)});
      EXPECT_LT(rel_error(grads.query, r.query, floor), 1e-4);
      EXPECT_LT(rel_error(grads.key, r.key, floor), 1e-4);
      EXPECT_LT(rel_error(grads.value, r.value, floor), 1e-4);
      if (mask_grad) {  // dS: zero where the mask is -inf, and where causality hides the key
        // A row that sees one key has dS = P (dP - D) = 0 exactly, which float32 leaves as a
        // rounding residue of dP's size: the floor is the other gradients'.
        EXPECT_LT(rel_error(*grads.attn_mask, r.attn_mask, std::max(floor, 0.05 * max_abs(r.attn_mask))), 1e-4);
      }
      if (n % 4 == 1) {  // top-left causal: keys past the last row's are exactly zero
        for (int64_t j = lq; j < lk; j += 97) {
          EXPECT_EQ(grads.key.at({0, 0, j, 0}), 0.0) << j;
          EXPECT_EQ(grads.value.at({0, 0, j, dv - 1}), 0.0) << j;
        }
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// A one-query backward whose key and value rows and their float32 gradients take 16 MiB and more
// stores dK and dV past the caches (few_queries_backward.hpp): the same bits as each head's call
// alone (its rows far under that), in one chunk of keys and in several (Lk > 1024), and the
// float64 reference's values.
TEST(SdpaBackward, FewRowsGradientsStoredPastTheCachesKeepTheirBits) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    // 4 x 8 x Lk x 128 values read and written: float32 23 and 36 MB, 16-bit 11.5 and 18 MB (the
    // threshold, 16 MiB, between the two)
    for (const auto& [dtype, lk] : {std::pair{mha::DType::f32, 700}, std::pair{mha::DType::f32, 1100},
                                    std::pair{mha::DType::bf16, 700}, std::pair{mha::DType::bf16, 1100},
                                    std::pair{mha::DType::f16, 1100}}) {
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + std::string(mha::dtype_name(dtype)) + " Lk=" + std::to_string(lk));
      const int64_t b = 4, h = 8, d = 64;
      const mha::Tensor q = randn({b, h, 1, d}, rng, dtype), k = randn({b, h, lk, d}, rng, dtype), v = randn({b, h, lk, d}, rng, dtype);
      const mha::Tensor g = randn({b, h, 1, d}, rng, dtype);
      const mha::SdpaOptions o;
      const auto saved = mha::scaled_dot_product_attention_for_training(q.view(), k.view(), v.view(), o);
      const auto all = mha::scaled_dot_product_attention_backward(q.view(), k.view(), v.view(), saved, g.view(), o);
      for (int64_t x = 0; x < b; ++x) {
        for (int64_t y = 0; y < h; ++y) {
          auto one = [&](const mha::TensorView& t) { return mha::Tensor::copy_of(t.slice(0, x, x + 1).slice(1, y, y + 1)); };
          const mha::AttentionForTraining alone{one(saved.output.view()), one(saved.lse.view())};
          const auto head = mha::scaled_dot_product_attention_backward(one(q.view()), one(k.view()), one(v.view()), alone,
                                                                       one(g.view()), o);
          EXPECT_TRUE(same_bits(head.key, one(all.key.view()))) << x << " " << y;
          EXPECT_TRUE(same_bits(head.value, one(all.value.view()))) << x << " " << y;
          EXPECT_TRUE(same_bits(head.query, one(all.query.view()))) << x << " " << y;
        }
      }
      // float32 as the backward's other float32 tests; 16-bit as LowPrecisionTrainingIsTheFloat32PathRoundedOnce
      // (the gradients' own rounding, bf16 2^-9 and float16 2^-12, with room; no row here sees
      // few enough keys for the saved output's rounding to matter)
      const double tolerance = dtype == mha::DType::f32 ? 1e-4 : dtype == mha::DType::bf16 ? 1e-2 : 2e-3;
      const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, g, o);
      EXPECT_LT(rel_error(all.key, r.key), tolerance);
      EXPECT_LT(rel_error(all.value, r.value), tolerance);
      EXPECT_LT(rel_error(all.query, r.query), tolerance);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

TEST(SdpaBackward, BitIdenticalAcrossRunsAndThreadCounts) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 150, 32}, rng), k = randn({2, 2, 130, 32}, rng), v = randn({2, 2, 130, 24}, rng);
  const mha::Tensor g = randn({2, 4, 150, 24}, rng), mask = randn({150, 130}, rng);
  mha::SdpaOptions o{.attn_mask = mask.view(), .is_causal = true, .enable_gqa = true, .dropout_p = 0.1,
                     .dropout_seed = 42};
  mha::AttentionGradients first;
  for (int threads : {1, 2, 3, 4, 1}) {
    o.num_threads = threads;
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, true);
    if (threads == 1 && !first.query.defined()) {
      first = std::move(grads);
      continue;
    }
    EXPECT_TRUE(same_bits(grads.query, first.query)) << threads << " threads";
    EXPECT_TRUE(same_bits(grads.key, first.key)) << threads << " threads";
    EXPECT_TRUE(same_bits(grads.value, first.value)) << threads << " threads";
    EXPECT_TRUE(same_bits(*grads.attn_mask, *first.attn_mask)) << threads << " threads";
  }
}

// bfloat16 and float16 training is the float32 path on widened copies, with the output and the
// gradients rounded once to the inputs' dtype (but where the tile unit takes a bfloat16 call,
// forward or backward: within bfloat16 rounding of it): checked bit for bit against exactly that,
// built from the float32 functions (which the tests above judge against float64). The output is
// also judged against float64 on the same rounded inputs, within a few units of the dtype's
// rounding (bf16 2^-9, fp16 2^-12) of its largest element or its terms' size
// (mha_test::terms_magnitude). Gradients are not: D = rowsum(dO O) uses the rounded output, as
// PyTorch's bf16 backward does, so a gradient that cancels to ~0 (one visible key) keeps that
// rounding, e.g. 2e-2 of the largest gradient at Lq = Lk = 1.
// The kernels widen bfloat16 / float16 rows as they read them (in all three backward schedules)
// and round each output and gradient row once: the bits of the float32 path on widened copies
// (the forward's too, but where the AMX kernel takes it).
TEST(SdpaBackward, LowPrecisionTrainingIsTheFloat32PathRoundedOnce) {
  std::mt19937_64 rng(test_seed());
  auto wide = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (const auto& [dtype, tolerance] : {std::pair{mha::DType::bf16, 1e-2}, std::pair{mha::DType::f16, 2e-3}}) {
      for (int n = 0; n < 8; ++n) {
        SdpaCase c = draw_sdpa_case(rng);
        if (n == 0) {  // 18 (batch, key/value head) groups: the one-pass schedule
          c = SdpaCase{};
          c.q = randn({3, 12, 75, 20}, rng), c.k = randn({3, 6, 101, 20}, rng), c.v = randn({3, 6, 101, 9}, rng);
          c.grad = randn({3, 12, 75, 9}, rng);
          c.options = mha::SdpaOptions{.is_causal = true, .enable_gqa = true};
          c.describe = "one pass: B=3 Hq=12 Hkv=6 Lq=75 Lk=101 causal";
        }
        if (n == 1) {  // head dims the AMX kernel's forward takes, dropout
          c = SdpaCase{};
          c.q = randn({2, 4, 70, 64}, rng), c.k = randn({2, 2, 90, 64}, rng), c.v = randn({2, 2, 90, 32}, rng);
          c.grad = randn({2, 4, 70, 32}, rng);
          c.options = mha::SdpaOptions{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight,
                                       .enable_gqa = true};
          c.options.dropout_p = 0.25, c.options.dropout_seed = 77;
          c.describe = "AMX dims: B=2 Hq=4 Hkv=2 Lq=70 Lk=90 dk=64 dv=32 causal bottom-right dropout";
        }
        SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + std::string(mha::dtype_name(dtype)) + " " +
                     c.describe);
        const mha::Tensor q = mha::Tensor::copy_of(c.q, dtype), k = mha::Tensor::copy_of(c.k, dtype),
                          v = mha::Tensor::copy_of(c.v, dtype);
        // Every other case reads the incoming gradient through a view whose rows are not contiguous.
        const mha::Tensor grad_storage = mha::Tensor::copy_of(c.grad.view().transpose(2, 3), dtype);
        const mha::TensorView grad_strided = grad_storage.view().transpose(2, 3);
        const mha::Tensor grad = n % 2 == 1 ? mha::Tensor::copy_of(grad_strided) : mha::Tensor::copy_of(c.grad, dtype);
        const mha::TensorView grad_in = n % 2 == 1 ? grad_strided : grad.view();
        const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, c.options);
        const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad_in, c.options, c.mask_grad);
        ASSERT_EQ(saved.output.dtype(), dtype);
        ASSERT_EQ(saved.lse.dtype(), mha::DType::f32);
        ASSERT_EQ(g.query.dtype(), dtype);

        const auto saved32 = mha::scaled_dot_product_attention_for_training(wide(q), wide(k), wide(v), c.options);
        const double terms = mha_test::terms_magnitude(q, k, v, c.options);
        if ((isa == mha::detail::Isa::amx && dtype == mha::DType::bf16) ||
            mha_test::pair_products_forward(dtype, q.size(2), q.size(3))) {
          // bfloat16 products (AVX512-BF16's pairs, or the tile unit's), likewise. The AMX kernel takes bfloat16 training forwards with head dims of 16 and more (and
          // more than 4 queries, rows of unit stride): its own products and exponentials (7.5e-5
          // relative), so the output within bfloat16 rounding of the float32 path's and the
          // log-sum-exp within 2e-4.
          EXPECT_LT(rel_error(saved.output, saved32.output, terms), tolerance);
          for (int64_t r = 0; r < saved.lse.numel(); ++r) {
            const float a = saved.lse.data<float>()[r], want = saved32.lse.data<float>()[r];
            if (std::isinf(want)) EXPECT_EQ(a, want) << "row " << r;
            else ASSERT_NEAR(a, want, 2e-4 * std::max(1.0f, std::abs(want))) << "row " << r;
          }
        } else {
          EXPECT_TRUE(same_bits(saved.output, mha::Tensor::copy_of(saved32.output, dtype)));
          EXPECT_TRUE(same_bits(saved.lse, saved32.lse));
        }
        // The backward is the float32 path on the rounded output and the saved log-sum-exp.
        const mha::AttentionForTraining rounded_saved{wide(saved.output), saved.lse};
        const auto g32 = mha::scaled_dot_product_attention_backward(wide(q), wide(k), wide(v), rounded_saved, wide(grad),
                                                                    c.options, c.mask_grad);
        if (tile_unit_backward(dtype, q.size(2), k.size(2), q.size(3), v.size(3), c.mask_grad)) {
          expect_near_float32_path(g, g32);
        } else {
          EXPECT_TRUE(same_bits(g.query, mha::Tensor::copy_of(g32.query, dtype)));
          EXPECT_TRUE(same_bits(g.key, mha::Tensor::copy_of(g32.key, dtype)));
          EXPECT_TRUE(same_bits(g.value, mha::Tensor::copy_of(g32.value, dtype)));
          if (c.mask_grad) EXPECT_TRUE(same_bits(*g.attn_mask, *g32.attn_mask));
        }

        const auto out = mha::reference::scaled_dot_product_attention(q, k, v, c.options);
        EXPECT_LT(rel_error(saved.output, out.output, terms), tolerance);
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
  // The saved output and the incoming gradient must have the inputs' dtype.
  const mha::Tensor q = mha::Tensor::copy_of(randn({1, 2, 5, 8}, rng), mha::DType::bf16);
  const auto saved = mha::scaled_dot_product_attention_for_training(q, q, q);
  expect_error([&] { mha::scaled_dot_product_attention_backward(q, q, q, saved, randn({1, 2, 5, 8}, rng)); },
               "grad_output");
  mha::AttentionForTraining wrong = saved;
  wrong.output = mha::Tensor::copy_of(saved.output, mha::DType::f32);
  expect_error([&] { mha::scaled_dot_product_attention_backward(q, q, q, wrong, saved.output); }, "saved.output");
}

TEST(SdpaBackward, Errors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 4, 8}, rng), g = randn({1, 2, 4, 8}, rng);
  const auto saved = mha::scaled_dot_product_attention_for_training(q, q, q);
  EXPECT_THROW(mha::scaled_dot_product_attention_backward(q, q, q, saved, randn({1, 2, 4, 7}, rng)), mha::Error);
  mha::AttentionForTraining wrong = saved;
  wrong.lse = randn({1, 2, 5}, rng);
  EXPECT_THROW(mha::scaled_dot_product_attention_backward(q, q, q, wrong, g), mha::Error);
  EXPECT_THROW(mha::scaled_dot_product_attention_backward(q, q, q, saved, g, {}, /*attn_mask_grad=*/true), mha::Error);
}

struct ModuleCase {
  int64_t E, H, kdim, vdim, N, L, S;
  mha::MultiheadAttentionOptions options;  // (its dtype: float32 or float64)
  bool batched, cross, causal, use_kpm, use_mask, dropout, float_kpm;
  int weights = 0;  // 0: none returned; 1: averaged over the heads, 2: per head, each in the loss
};

// The module's backward against central differences of the float64 module reference, over the
// inputs, every parameter and the float masks; the loss is sum(output * grad), plus
// sum(weights * grad_weights) where the case returns the weights.
void check_module_against_finite_differences(const ModuleCase& c, std::mt19937_64& rng) {
  const mha::DType dtype = c.options.dtype;
  mha::MultiheadAttention m(c.E, c.H, c.options);
  const bool bf = c.options.batch_first;
  auto shape = [&](int64_t len, int64_t width) -> mha::Shape {
    if (!c.batched) return {len, width};
    return bf ? mha::Shape{c.N, len, width} : mha::Shape{len, c.N, width};
  };
  mha::Tensor query = randn(shape(c.L, c.E), rng, mha::DType::f64);
  mha::Tensor key = c.cross ? randn(shape(c.S, c.kdim), rng, mha::DType::f64) : query;
  mha::Tensor value = c.cross ? randn(shape(c.S, c.vdim), rng, mha::DType::f64) : query;
  mha::ForwardOptions fo;
  fo.is_causal = c.causal;
  fo.need_weights = c.weights > 0;
  fo.average_attn_weights = c.weights == 1;
  mha::Tensor kpm, mask;
  if (c.use_kpm && c.float_kpm) {  // additive, with its gradient asked for
    kpm = randn(c.batched ? mha::Shape{c.N, c.S} : mha::Shape{c.S}, rng, dtype);
    fo.key_padding_mask = kpm.view();
  } else if (c.use_kpm) {
    kpm = c.batched ? mha::Tensor::zeros({c.N, c.S}, mha::DType::boolean) : mha::Tensor::zeros({c.S}, mha::DType::boolean);
    kpm.data<bool>()[kpm.numel() - 1] = c.S > 1;  // mask the last key (key 0 stays visible)
    fo.key_padding_mask = kpm.view();
  }
  if (c.use_mask) {
    mask = randn({c.L, c.S}, rng, dtype);
    fo.attn_mask = mask.view();
  }
  if (c.dropout) fo.dropout_seed = rng();
  m.train(c.dropout);

  const mha::Tensor q_in = mha::Tensor::copy_of(query, dtype), k_in = mha::Tensor::copy_of(key, dtype),
                    v_in = mha::Tensor::copy_of(value, dtype);
  mha::ForwardContext ctx;
  const mha::TensorView kin = c.cross ? k_in.view() : q_in.view(), vin = c.cross ? v_in.view() : q_in.view();
  const auto result = m.forward(q_in, kin, vin, fo, &ctx);
  const mha::Tensor grad = randn(result.output.sizes(), rng, dtype);
  const mha::Tensor grad64 = mha::Tensor::copy_of(grad, mha::DType::f64);
  // The float masks' gradients too (a bool mask has none, asked or not).
  mha::Tensor grad_weights, grad_weights64;
  std::optional<mha::TensorView> weights_grad;
  if (c.weights > 0) {
    grad_weights = randn(result.weights->sizes(), rng, dtype);
    grad_weights64 = mha::Tensor::copy_of(grad_weights, mha::DType::f64);
    weights_grad = grad_weights.view();
  }
  const mha::ModuleGradients g =
      m.backward(ctx, grad, {.attn_mask = c.use_mask, .key_padding_mask = c.use_kpm}, weights_grad);
  EXPECT_EQ(g.attn_mask.defined(), c.use_mask);
  EXPECT_EQ(g.key_padding_mask.defined(), c.use_kpm && c.float_kpm);
  // The reference reads float64 copies of the float masks, so that they can be perturbed.
  mha::Tensor mask64, kpm64;
  if (c.use_mask) mask64 = mha::Tensor::copy_of(mask, mha::DType::f64), fo.attn_mask = mask64.view();
  if (c.use_kpm && c.float_kpm) kpm64 = mha::Tensor::copy_of(kpm, mha::DType::f64), fo.key_padding_mask = kpm64.view();

  // float64 parameters: the reference then computes in float64 throughout.
  std::vector<std::pair<std::string, mha::Tensor>> params;
  std::unordered_map<std::string, mha::TensorView> views;
  for (const auto& [name, t] : m.named_parameters()) params.emplace_back(name, mha::Tensor::copy_of(t, mha::DType::f64));
  for (auto& [name, t] : params) views[name] = t.view();
  auto loss = [&]() {
    const auto r = mha::reference::multihead_attention(m, query, key, value, fo, c.dropout, views);
    double s = 0;
    for (int64_t i = 0; i < r.output.numel(); ++i) s += r.output.data<double>()[i] * grad64.data<double>()[i];
    if (c.weights > 0) {
      for (int64_t i = 0; i < r.weights->numel(); ++i) s += r.weights->data<double>()[i] * grad_weights64.data<double>()[i];
    }
    return s;
  };
  // float32 gradients against float64 differences: 1e-4 of the gradient's size, or of 1% of the
  // case's largest gradient for one that is zero in exact arithmetic (q/k weights with one key).
  // float64 gradients: the differences err by about 1e-11 (finite_difference_error), 1e-10 where
  // the floor above is the scale; 1e-8 leaves
  // room and is far below what one float32 step anywhere would cost (1e-7 and up).
  const double tol = dtype == mha::DType::f64 ? 1e-8 : 1e-4;
  double largest = std::max({max_abs(g.query), max_abs(g.key), max_abs(g.value)});
  for (const auto& [name, t] : g.parameters) largest = std::max(largest, max_abs(t));
  const double floor = 0.01 * largest;
  if (c.cross) {
    EXPECT_LT(finite_difference_error(query, g.query, loss, floor), tol) << "query";
    EXPECT_LT(finite_difference_error(key, g.key, loss, floor), tol) << "key";
    EXPECT_LT(finite_difference_error(value, g.value, loss, floor), tol) << "value";
  } else {  // one tensor passed three times: its gradient is the sum of the three
    mha::Tensor sum = mha::Tensor::copy_of(g.query, mha::DType::f64);
    const mha::Tensor gk = mha::Tensor::copy_of(g.key, mha::DType::f64), gv = mha::Tensor::copy_of(g.value, mha::DType::f64);
    for (int64_t i = 0; i < sum.numel(); ++i) sum.data<double>()[i] += gk.data<double>()[i] + gv.data<double>()[i];
    EXPECT_LT(finite_difference_error(query, sum, loss, floor), tol) << "query = key = value";
  }
  for (auto& [name, t] : params) EXPECT_LT(finite_difference_error(t, g.parameter(name), loss, floor), tol) << name;
  if (c.use_mask) EXPECT_LT(finite_difference_error(mask64, g.attn_mask, loss, floor), tol) << "attn_mask";
  if (kpm64.defined()) EXPECT_LT(finite_difference_error(kpm64, g.key_padding_mask, loss, floor), tol) << "key_padding_mask";
}

// `cases` random modules of `dtype` against central differences of the reference.
void check_random_modules_against_finite_differences(mha::DType dtype, int cases) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < cases; ++n) {
    auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
    ModuleCase c{};
    c.H = 1 + static_cast<int64_t>(rng() % 3);
    c.E = c.H * (1 + static_cast<int64_t>(rng() % 3));
    c.cross = coin(0.5);
    c.kdim = c.cross && coin(0.5) ? 1 + static_cast<int64_t>(rng() % 5) : c.E;
    c.vdim = c.cross && coin(0.5) ? 1 + static_cast<int64_t>(rng() % 5) : c.E;
    c.N = 1 + static_cast<int64_t>(rng() % 2);
    c.L = 1 + static_cast<int64_t>(rng() % 4);
    c.S = c.cross ? 1 + static_cast<int64_t>(rng() % 4) : c.L;
    c.batched = coin(0.8);
    c.causal = coin(0.3);
    c.use_kpm = coin(0.4);
    c.float_kpm = coin(0.5);
    c.use_mask = coin(0.4);
    c.dropout = coin(0.3);
    c.weights = coin(0.4) ? 1 + static_cast<int>(rng() % 2) : 0;
    c.options = {.dropout = c.dropout ? 0.3 : 0.0, .bias = coin(0.7), .add_bias_kv = coin(0.4),
                 .add_zero_attn = coin(0.3), .kdim = c.kdim, .vdim = c.vdim, .batch_first = coin(0.5),
                 .seed = rng(), .dtype = dtype};
    SCOPED_TRACE("case " + std::to_string(n) + ": E=" + std::to_string(c.E) + " H=" + std::to_string(c.H) +
                 " kdim=" + std::to_string(c.kdim) + " vdim=" + std::to_string(c.vdim) + " L=" + std::to_string(c.L) +
                 " S=" + std::to_string(c.S) + " cross=" + std::to_string(c.cross) +
                 " bias_kv=" + std::to_string(c.options.add_bias_kv) + " zero_attn=" +
                 std::to_string(c.options.add_zero_attn) + " dropout=" + std::to_string(c.dropout) +
                 " weights=" + std::to_string(c.weights));
    check_module_against_finite_differences(c, rng);
  }
}

TEST(ModuleBackward, MatchesFiniteDifferencesOfTheReference) {
  check_random_modules_against_finite_differences(mha::DType::f32, 12);
}

// A float64 module's gradients are float64 throughout (what torch.autograd.gradcheck needs).
TEST(ModuleBackward, Float64ModuleMatchesFiniteDifferencesToFloat64Accuracy) {
  check_random_modules_against_finite_differences(mha::DType::f64, 12);
}

TEST(ModuleBackward, BitIdenticalAcrossThreadCountsAndErrors) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::f64}) {
    SCOPED_TRACE(mha::dtype_name(dtype));
    mha::MultiheadAttention m(32, 4, {.dropout = 0.2, .add_bias_kv = true, .seed = 3, .dtype = dtype});
    const mha::Tensor x = randn({70, 3, 32}, rng, dtype), grad = randn({70, 3, 32}, rng, dtype);
    mha::ModuleGradients first;
    for (int threads : {1, 2, 3}) {
      mha::ForwardContext ctx;
      m.forward(x, x, x, {.need_weights = false, .is_causal = true, .dropout_seed = 9, .num_threads = threads}, &ctx);
      mha::ModuleGradients g = m.backward(ctx, grad);
      if (threads == 1) {
        first = std::move(g);
        continue;
      }
      EXPECT_TRUE(same_bits(g.query, first.query));
      for (const auto& [name, t] : g.parameters) EXPECT_TRUE(same_bits(t, first.parameter(name))) << name;
    }
  }
  mha::MultiheadAttention m(32, 4, {.dropout = 0.2, .add_bias_kv = true, .seed = 3});
  const mha::Tensor x = randn({70, 3, 32}, rng), grad = randn({70, 3, 32}, rng);
  mha::ModuleGradients first;
  mha::ForwardContext empty;
  EXPECT_THROW(m.backward(empty, grad), mha::Error);
  mha::ForwardContext ctx;
  m.forward(x, x, x, {}, &ctx);
  EXPECT_THROW(m.backward(ctx, randn({70, 3, 31}, rng)), mha::Error);
  EXPECT_THROW(first.parameter("nope"), mha::Error);
  // A weights' gradient must match the weights the forward returned, and needs them returned.
  mha_test::expect_error([&] { m.backward(ctx, grad, {}, randn({3, 70, 69}, rng).view()); },
                         "grad_weights: expected float32 of shape [3, 70, 71] (the weights returned)");  // (+ bias_k)
  mha::ForwardContext without_weights;
  m.forward(x, x, x, {.need_weights = false}, &without_weights);
  mha_test::expect_error([&] { m.backward(without_weights, grad, {}, randn({3, 70, 71}, rng).view()); },
                         "grad_weights: the forward returned no weights");
}

// SDPA gradients left out (SdpaGradientsWanted) are undefined, and the others keep the full
// backward's bits, in every schedule: one pass per head group (16 groups or more), the two passes
// (fewer), the few-row kernel (one or two key chunks), and the two passes with a mask gradient.
TEST(SdpaBackward, GradientsLeftOutAreUndefinedAndTheRestUnchanged) {
  std::mt19937_64 rng(test_seed());
  struct Shape {
    int64_t b, hq, hkv, lq, lk, d;
  };
  const Shape shapes[] = {{4, 4, 4, 50, 70, 16}, {1, 2, 1, 37, 53, 24}, {2, 4, 2, 3, 1100, 32}, {1, 2, 2, 1, 40, 8}};
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 8; ++n) {
      const Shape& sh = shapes[n % 4];
      const mha::DType dtype = n == 5 ? mha::DType::bf16 : mha::DType::f32;
      const bool mask_grad = n == 6 || n == 7;
      const mha::Tensor q = mha::Tensor::copy_of(randn({sh.b, sh.hq, sh.lq, sh.d}, rng), dtype),
                        k = mha::Tensor::copy_of(randn({sh.b, sh.hkv, sh.lk, sh.d}, rng), dtype),
                        v = mha::Tensor::copy_of(randn({sh.b, sh.hkv, sh.lk, sh.d + 8}, rng), dtype),
                        g = mha::Tensor::copy_of(randn({sh.b, sh.hq, sh.lq, sh.d + 8}, rng), dtype);
      const mha::Tensor mask = randn({sh.lq, sh.lk}, rng);
      mha::SdpaOptions o{.is_causal = n == 3, .enable_gqa = true};
      if (n % 4 == 2) o.dropout_p = 0.2, o.dropout_seed = rng();
      if (mask_grad) o.attn_mask = mask.view();
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " case " + std::to_string(n));
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto all = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, mask_grad);
      for (int bits = 0; bits < 8; ++bits) {
        const mha::SdpaGradientsWanted wanted{(bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0, mask_grad};
        const auto some = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, o, wanted);
        for (const auto& [on, got, full] : {std::tuple{wanted.query, &some.query, &all.query},
                                            std::tuple{wanted.key, &some.key, &all.key},
                                            std::tuple{wanted.value, &some.value, &all.value}}) {
          EXPECT_EQ(got->defined(), on) << "wanted " << bits;
          if (on) EXPECT_TRUE(same_bits(*got, *full)) << "wanted " << bits;
        }
        ASSERT_EQ(some.attn_mask.has_value(), mask_grad);
        if (mask_grad) EXPECT_TRUE(same_bits(*some.attn_mask, *all.attn_mask)) << "wanted " << bits;
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Gradients left out (WantedGradients: inputs that need none, frozen parameters) are undefined
// and cost nothing; what is computed has the bits of the full backward: cross-attention with
// kdim/vdim (separate projection weights) and self-attention (the packed in_proj_weight), float32
// and bfloat16, with bias_k/bias_v.
TEST(ModuleBackward, GradientsLeftOutAreUndefinedAndTheRestUnchanged) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    for (const bool cross : {true, false}) {
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + (cross ? " cross" : " self"));
      const int64_t kdim = cross ? 12 : 16;
      mha::MultiheadAttention m(
          16, 2, {.add_bias_kv = true, .kdim = kdim, .vdim = kdim, .batch_first = true, .seed = 5, .dtype = dtype});
      const mha::Tensor q = mha::Tensor::copy_of(randn({3, 2, 16}, rng), dtype);
      const mha::Tensor kv = cross ? mha::Tensor::copy_of(randn({3, 40, kdim}, rng), dtype) : q;
      const mha::Tensor grad = mha::Tensor::copy_of(randn({3, 2, 16}, rng), dtype);
      mha::ForwardContext ctx;
      m.forward(q, kv, kv, {.need_weights = false}, &ctx);
      const mha::ModuleGradients all = m.backward(ctx, grad);
      const std::vector<std::string> weights =
          cross ? std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}
                : std::vector<std::string>{"in_proj_weight", "out_proj.weight"};
      std::vector<std::string> every;
      for (const auto& [name, t] : all.parameters) every.push_back(name);
      const std::vector<mha::WantedGradients> cases = {
          {true, false, false, {}},
          {false, false, true, {}},
          {false, false, false, {}},
          {true, true, true, weights},  // fine-tuning around a frozen attention
          {false, false, false, weights},  // the biases alone
          {false, true, false, {"out_proj.bias", "bias_k", weights[1]}},
          {true, false, true, every},
          {false, false, false, every},  // nothing: no backward runs
      };
      for (const mha::WantedGradients& wanted : cases) {
        const mha::ModuleGradients some = m.backward(ctx, grad, wanted);
        for (const auto& [on, got, full] : {std::tuple{wanted.query, &some.query, &all.query},
                                            std::tuple{wanted.key, &some.key, &all.key},
                                            std::tuple{wanted.value, &some.value, &all.value}}) {
          EXPECT_EQ(got->defined(), on);
          if (on) EXPECT_TRUE(same_bits(*got, *full));
        }
        ASSERT_EQ(some.parameters.size(), all.parameters.size());
        for (const auto& [name, t] : some.parameters) {
          const bool frozen = std::count(wanted.frozen_parameters.begin(), wanted.frozen_parameters.end(), name) > 0;
          EXPECT_EQ(t.defined(), !frozen) << name;
          if (!frozen) EXPECT_TRUE(same_bits(t, all.parameter(name))) << name;
        }
      }
      EXPECT_THROW(m.backward(ctx, grad, {.frozen_parameters = {"in_proj.weight"}}), mha::Error);
    }
  }
}

// A context rebuilt from its activations (restore_context, for callers that keep only tensors
// between the forward and the backward) gives the backward of the forward's own context, bit for
// bit: self-attention sequence-first (the packed buffer's activations are copies) and batch-first,
// cross-attention with kdim/vdim, bfloat16, float64, masks, bias_k/bias_v, zero attention, causal,
// dropout, unbatched inputs, and activations handed back as strided views.
TEST(ModuleBackward, RestoredContextGivesTheBitsOfTheForwardsOwn) {
  std::mt19937_64 rng(test_seed());
  struct Case {
    bool cross, batch_first, batched, masks;
    mha::DType dtype;
  };
  constexpr mha::DType f32 = mha::DType::f32, bf16 = mha::DType::bf16, f64 = mha::DType::f64;
  const Case cases[] = {{false, false, true, false, f32}, {false, true, true, true, f32},
                        {true, true, true, true, f32},   {true, false, true, false, bf16},
                        {false, false, false, true, bf16}, {true, false, false, false, f32},
                        {true, true, true, true, f64},   {false, false, false, true, f64}};
  for (const Case& cs : cases) {
    const mha::DType dtype = cs.dtype;
    const int64_t E = 24, H = 3, N = 2, L = 9, S = cs.cross ? 13 : 9, kdim = cs.cross ? 10 : E;
    SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + (cs.cross ? " cross" : " self") +
                 (cs.batch_first ? " batch_first" : "") + (cs.batched ? "" : " unbatched") + (cs.masks ? " masks" : ""));
    mha::MultiheadAttention m(E, H,
                              {.dropout = 0.25, .add_bias_kv = cs.masks, .add_zero_attn = cs.masks, .kdim = kdim,
                               .vdim = kdim, .batch_first = cs.batch_first, .seed = rng(), .dtype = dtype});
    auto input = [&](int64_t len, int64_t width) {
      const mha::Shape shape = !cs.batched ? mha::Shape{len, width}
                               : cs.batch_first ? mha::Shape{N, len, width} : mha::Shape{len, N, width};
      return mha::Tensor::copy_of(randn(shape, rng), dtype);
    };
    const mha::Tensor q = input(L, E), kv = cs.cross ? input(S, kdim) : q, grad = input(L, E);
    const mha::Tensor attn_mask = randn({L, S}, rng);
    mha::Tensor padding = mha::Tensor::zeros(cs.batched ? mha::Shape{N, S} : mha::Shape{S}, mha::DType::boolean);
    padding.data<bool>()[1] = true;
    mha::ForwardOptions o{.need_weights = false, .is_causal = cs.masks, .dropout_seed = rng(), .num_threads = 2};
    if (cs.masks) o.attn_mask = attn_mask.view(), o.key_padding_mask = padding.view();
    mha::SavedActivations saved;
    mha::ModuleGradients own;
    {
      mha::ForwardContext ctx;
      m.forward(q, kv, kv, o, &ctx);
      own = m.backward(ctx, grad);
      saved = ctx.activations();
    }  // the activations outlive the context
    const mha::ForwardContext restored = m.restore_context(q, kv, kv, o, saved.views());
    const mha::ModuleGradients again = m.backward(restored, grad);
    EXPECT_TRUE(same_bits(again.query, own.query));
    EXPECT_TRUE(same_bits(again.key, own.key));
    for (const auto& [name, t] : again.parameters) EXPECT_TRUE(same_bits(t, own.parameter(name))) << name;
    // Strided activations (every other row of a wider buffer) are read as they are: the same bits.
    EXPECT_EQ(saved.q.dtype(), dtype == f64 ? f64 : f32);  // (bfloat16 modules keep float32 activations)
    const mha::Tensor wide = mha::Tensor::zeros({2 * saved.q.numel()}, saved.q.dtype());
    const mha::TensorView q_rows(wide.view().data, saved.q.dtype(), saved.q.sizes(),
                                 {2 * saved.q.size(1) * E, 2 * E, 1});
    mha::copy_into(saved.q, q_rows);
    mha::ActivationViews strided = saved.views();
    strided.q = q_rows;
    const mha::ModuleGradients from_strided = m.backward(m.restore_context(q, kv, kv, o, strided), grad);
    EXPECT_TRUE(same_bits(from_strided.query, own.query));
  }

  // Errors: activations that do not fit the call, a missing dropout seed, an empty context.
  mha::MultiheadAttention m(16, 2, {.dropout = 0.1, .seed = 4});
  const mha::Tensor x = randn({5, 2, 16}, rng);
  mha::ForwardContext ctx;
  m.forward(x, x, x, {.dropout_seed = 3}, &ctx);
  const mha::SavedActivations saved = ctx.activations();
  mha::ActivationViews short_keys = saved.views();
  short_keys.k = saved.k.view().slice(1, 0, 4);
  EXPECT_THROW(m.restore_context(x, x, x, {.dropout_seed = 3}, short_keys), mha::Error);
  const mha::Tensor lse_bf16 = mha::Tensor::copy_of(saved.lse, mha::DType::bf16);
  mha::ActivationViews wrong_dtype = saved.views();
  wrong_dtype.lse = lse_bf16.view();
  EXPECT_THROW(m.restore_context(x, x, x, {.dropout_seed = 3}, wrong_dtype), mha::Error);
  EXPECT_THROW(m.restore_context(x, x, x, {}, saved.views()), mha::Error);  // dropout without its seed
  m.eval();
  EXPECT_NO_THROW(m.restore_context(x, x, x, {}, saved.views()));  // no dropout in eval mode: no seed needed
  EXPECT_THROW(mha::ForwardContext().activations(), mha::Error);
}

// A float mask of bfloat16 or float16 (PyTorch's usual mask for a bfloat16 model) is its float32
// values: forward, training forward and every gradient have the bits of the float32 mask of the
// same values, a broadcast (stride-0) one too; the mask's gradient comes back in its dtype, the
// float32 one rounded once. A float64 mask is an error naming attn_mask.
TEST(SdpaBackward, LowPrecisionFloatMasksAreTheirFloat32Values) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
    for (const bool expanded : {false, true}) {
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + (expanded ? " expanded" : ""));
      const mha::Tensor q = mha::Tensor::copy_of(randn({2, 3, 9, 16}, rng), dtype),
                        k = mha::Tensor::copy_of(randn({2, 3, 13, 16}, rng), dtype),
                        v = mha::Tensor::copy_of(randn({2, 3, 13, 8}, rng), dtype),
                        g = mha::Tensor::copy_of(randn({2, 3, 9, 8}, rng), dtype);
      const mha::Tensor mask = mha::Tensor::copy_of(randn({2, 1, 9, 13}, rng), dtype);
      const mha::Tensor mask32 = mha::Tensor::copy_of(mask, mha::DType::f32);
      // [2, 3, 9, 13] with stride 0 over the heads, as expand() gives.
      auto as_given = [&](const mha::Tensor& m) {
        if (!expanded) return m.view();
        const mha::TensorView& mv = m.view();
        return mha::TensorView(mv.data, mv.dtype, {2, 3, 9, 13}, {mv.strides[0], 0, mv.strides[2], mv.strides[3]});
      };
      mha::SdpaOptions low{.attn_mask = as_given(mask), .is_causal = true}, wide = low;
      wide.attn_mask = as_given(mask32);
      EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, low),
                            mha::scaled_dot_product_attention(q, k, v, wide)));
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, low);
      const auto saved32 = mha::scaled_dot_product_attention_for_training(q, k, v, wide);
      EXPECT_TRUE(same_bits(saved.output, saved32.output));
      const auto grads = mha::scaled_dot_product_attention_backward(q, k, v, saved, g, low, true);
      const auto grads32 = mha::scaled_dot_product_attention_backward(q, k, v, saved32, g, wide, true);
      EXPECT_TRUE(same_bits(grads.query, grads32.query));
      EXPECT_TRUE(same_bits(grads.key, grads32.key));
      ASSERT_TRUE(grads.attn_mask && grads32.attn_mask);
      EXPECT_EQ(grads.attn_mask->dtype(), dtype);
      EXPECT_EQ(grads.attn_mask->sizes(), low.attn_mask->sizes());
      EXPECT_TRUE(same_bits(*grads.attn_mask, mha::Tensor::copy_of(*grads32.attn_mask, dtype)));
    }
  }
  const mha::Tensor q = randn({1, 2, 4, 8}, rng);
  const mha::Tensor mask64 = mha::Tensor::copy_of(randn({4, 4}, rng), mha::DType::f64);
  try {
    mha::scaled_dot_product_attention(q, q, q, {.attn_mask = mask64.view()});
    FAIL() << "a float64 mask was accepted";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("attn_mask"), std::string::npos) << e.what();
  }
}

// The two-pass backward (few head groups, or a mask gradient) skips the tiles a mask excludes
// entirely: the bits of the same mask materialised [B, Hq, Lq, Lk] and read
// in place, for a bool mask and for an additive one whose gradient is asked for (summed over the
// queries in the same order), with a lone key per head at the first or last key of a 48-key panel
// or of a 64- or 72-key block; and a mask varying along the queries, under causality.
TEST(SdpaBackward, TwoPassSkipsWhatAMaskExcludes) {
  std::mt19937_64 rng(test_seed());
  const int64_t b = 1, hkv = 2, hq = 8, lq = 200, lk = 200, d = 16;
  const mha::Tensor q = randn({b, hq, lq, d}, rng), k = randn({b, hkv, lk, d}, rng), v = randn({b, hkv, lk, d}, rng);
  const mha::Tensor go = randn({b, hq, lq, d}, rng);
  const int64_t lone[] = {48, 95, 96, 143, 64, 127, 72, 191};
  for (const bool additive : {false, true}) {
    SCOPED_TRACE(additive ? "additive, with its gradient" : "bool");
    mha::Tensor mask = additive ? randn({b, hq, 1, lk}, rng) : mha::Tensor::empty({b, hq, 1, lk}, mha::DType::boolean);
    for (int64_t hh = 0; hh < hq; ++hh)
      for (int64_t j = 0; j < lk; ++j) {
        const bool keep = j < 30 || j == lone[hh];
        if (additive) {
          if (!keep) mask.data<float>()[hh * lk + j] = -std::numeric_limits<float>::infinity();
        } else {
          mask.data<uint8_t>()[hh * lk + j] = keep;
        }
      }
    const mha::TensorView& m = mask.view();
    const mha::Tensor materialised =
        mha::Tensor::copy_of(mha::TensorView(m.data, m.dtype, {b, hq, lq, lk}, {m.strides[0], m.strides[1], 0, m.strides[3]}));
    mha::SdpaOptions o{.attn_mask = mask.view(), .enable_gqa = true}, full = o;
    full.attn_mask = materialised.view();
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    const auto in_place = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, full, additive);
    {  // A block of the score gradients' size (1.25 MiB), NaN throughout, freed into the host
       // block cache, which hands it, not zeroed, to the next call's: skipped tiles must be written.
      const mha::Tensor dirt = mha::Tensor::empty({b, hq, lq, lk});
      std::fill_n(dirt.data<float>(), dirt.numel(), std::numeric_limits<float>::quiet_NaN());
    }
    const auto skipped = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, additive);
    mha::detail::skips_excluded_blocks() = false;
    const auto computed = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, additive);
    mha::detail::skips_excluded_blocks() = true;
    EXPECT_TRUE(same_bits(skipped.query, computed.query));
    EXPECT_TRUE(same_bits(skipped.key, computed.key));
    EXPECT_TRUE(same_bits(skipped.value, computed.value));
    if (additive) EXPECT_TRUE(same_bits(*skipped.attn_mask, *computed.attn_mask));
    EXPECT_TRUE(same_bits(skipped.query, in_place.query));
    EXPECT_TRUE(same_bits(skipped.key, in_place.key));
    EXPECT_TRUE(same_bits(skipped.value, in_place.value));
    if (additive) {
      mha::Tensor summed = mha::Tensor::zeros({b, hq, 1, lk});
      for (int64_t hh = 0; hh < hq; ++hh)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = 0; j < lk; ++j)
            summed.data<float>()[hh * lk + j] += in_place.attn_mask->data<float>()[(hh * lq + i) * lk + j];
      EXPECT_TRUE(same_bits(*skipped.attn_mask, summed));
    }
    const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, go, o);
    const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
    EXPECT_LT(rel_error(skipped.key, r.key, floor), 1e-4);
  }

  // A mask varying along the queries with causality on top: the key tasks start at the diagonal,
  // so their query blocks straddle the map's (of kBlock, 64 or 72 queries). Keys [48, 96) are
  // hidden from queries before 72: the map's first block is excluded for that panel, the second
  // is not, and a task's rows from 48 cover both.
  mha::Tensor band = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t j = 0; j < lk; ++j) band.data<uint8_t>()[i * lk + j] = !(j >= 48 && j < 96 && i < 72);
  mha::SdpaOptions o{.attn_mask = band.view(), .is_causal = true, .enable_gqa = true};
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  const auto skipped = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o);
  mha::detail::skips_excluded_blocks() = false;
  const auto computed = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o);
  mha::detail::skips_excluded_blocks() = true;
  EXPECT_TRUE(same_bits(skipped.query, computed.query));
  EXPECT_TRUE(same_bits(skipped.key, computed.key));
  EXPECT_TRUE(same_bits(skipped.value, computed.value));
}

// Hugging Face's finfo.min masks in the backward: tiles of such values (kSwamped) are skipped
// only where every row of the tile sees an ordinary key (P = 0 there); rows that see none are
// computed. The bits of every tile computed: the one-pass schedule (16 head groups) with the mask
// copied and read in place, the two-pass schedule (2 groups) with and without the mask's
// gradient; causal masks left- and right-padded, a row with no ordinary key at a panel's first or
// last row, a band between the thresholds (-1e35), and a lone ordinary key at a panel's edge.
TEST(SdpaBackward, SwampedTilesAreSkippedOnlyWhereExact) {
  std::mt19937_64 rng(test_seed());
  const float lowest = std::numeric_limits<float>::lowest();
  const int64_t lq = 130, lk = 150, d = 16;
  for (const int64_t b : {int64_t{8}, int64_t{1}}) {  // one pass (16 groups), two passes (2)
    const int64_t hkv = 2, hq = 4;
    const mha::Tensor q = randn({b, hq, lq, d}, rng), k = randn({b, hkv, lk, d}, rng), v = randn({b, hkv, lk, d}, rng);
    const mha::Tensor go = randn({b, hq, lq, d}, rng);
    mha::Tensor mask = mha::Tensor::zeros({b, 1, lq, lk});
    for (int64_t e = 0; e < b; ++e)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          float& x = mask.data<float>()[(e * lq + i) * lk + j];
          // Causal from the bottom right; entry 0 left-padded (60 keys, and the rows that see
          // only them) with a lone ordinary key at 48 for the later rows, entry 1 right-padded,
          // others with rows 47 and 48 (last and first of a panel) seeing no ordinary key.
          const int64_t kind = e % 3;
          const bool hidden = j > i + lk - lq || (kind == 0 && j < 60 && !(j == 48 && i >= 65)) ||
                              (kind == 1 && j >= lk - 50) || (kind == 2 && (i == 47 || i == 48));
          // (-1e38 as well: a row of it keeps a log-sum-exp equal to its scores, P = 1, not 0.)
          if (hidden) x = (i + j) % 2 == 0 ? -1e38f : lowest;
          if (kind == 2 && j >= 96 && j < 144 && !hidden) x = -1e35f;  // neither swamped nor ordinary
        }
    for (const bool with_mask_grad : {false, true}) {
      SCOPED_TRACE("B=" + std::to_string(b) + (with_mask_grad ? " with the mask's gradient" : ""));
      const mha::SdpaOptions o{.attn_mask = mask.view(), .enable_gqa = true};
      const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
      const auto skipped = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, with_mask_grad);
      std::atomic<int64_t>& cap = mha::detail::transposed_mask_floats();
      const int64_t kept = cap.exchange(0);  // read in place
      const auto in_place = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, with_mask_grad);
      mha::detail::skips_excluded_blocks() = false;  // and every tile computed
      const auto computed = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, with_mask_grad);
      mha::detail::skips_excluded_blocks() = true;
      cap = kept;
      for (const auto* g : {&skipped, &in_place}) {
        EXPECT_TRUE(same_bits(g->query, computed.query));
        EXPECT_TRUE(same_bits(g->key, computed.key));
        EXPECT_TRUE(same_bits(g->value, computed.value));
        if (with_mask_grad) EXPECT_TRUE(same_bits(*g->attn_mask, *computed.attn_mask));
      }
    }
  }
}


// A row whose every score is its mask value (Hugging Face's padded query rows at finfo.min, or any
// value that swallows q.k): a float32 log-sum-exp cannot hold log2(l) next to such a maximum, and
// recomputing P from it gives each of the row's l keys 1 instead of 1/l (PyTorch's CPU backward
// does). Against the float64 reference, which forms the softmax: every ISA, the one-pass (16 head
// groups) and two-pass schedules and the few-queries kernel, with and without the mask's gradient;
// padding at finfo.min, -1e38 and -1e35, an entry padded throughout, causal rows that see only
// padding, rows mixing -1e38 and -2e38 (their weight on the -1e38 keys alone); masks shared by
// the heads, one per head, and read with keys a row apart; bfloat16 inputs.
// float32 within 1e-5 of the largest gradient (the sums of a few hundred rounded products);
// bfloat16 within 2e-2 (inputs and gradients rounded to 8 bits).
TEST(SdpaBackward, RowsOfMaskValuesAloneGetTheirSoftmax) {
  std::mt19937_64 rng(test_seed());
  const float lowest = std::numeric_limits<float>::lowest();
  struct Case {
    int64_t batch, lq, lk;
    const char* what;
  };
  const Case cases[] = {{8, 130, 150, "one pass"}, {1, 130, 150, "two passes"}, {3, 3, 70, "few queries"}};
  const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  for (const mha::detail::Isa isa : isas) {
    mha::detail::force_isa(isa);
    for (const Case& c : cases) {
      for (const float fill : {lowest, -1e38f, -1e35f}) {
        for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
          if (dtype == mha::DType::bf16 && (fill != lowest || isa != isas.back())) continue;
          const int64_t hkv = 2, hq = 4, d = 24;
          const mha::Tensor q = randn({c.batch, hq, c.lq, d}, rng, dtype), k = randn({c.batch, hkv, c.lk, d}, rng, dtype),
                            v = randn({c.batch, hkv, c.lk, d}, rng, dtype), go = randn({c.batch, hq, c.lq, d}, rng, dtype);
          // The mask [B, 1, Lq, Lk] (its rows shared by the heads), [B, Hq, Lq, Lk], or a view of
          // [B, 1, Lk, Lq] storage (keys a row apart: read key by key).
          const int layout = fill == lowest ? 0 : fill == -1e38f ? 1 : 2;
          const int64_t mask_heads = layout == 1 ? hq : 1;
          mha::Tensor mask = layout == 2 ? mha::Tensor::zeros({c.batch, 1, c.lk, c.lq})
                                         : mha::Tensor::zeros({c.batch, mask_heads, c.lq, c.lk});
          const int64_t row_step = layout == 2 ? 1 : c.lk, key_step = layout == 2 ? c.lq : 1;
          for (int64_t e = 0; e < c.batch; ++e) {
            const int64_t pad = e % 3 == 0 ? c.lk : e % 3 == 1 ? c.lk / 2 : 0;  // entry e's first keys padded
            for (int64_t mh = 0; mh < mask_heads; ++mh)
              for (int64_t i = 0; i < c.lq; ++i)
                for (int64_t j = 0; j < pad; ++j)
                  mask.data<float>()[(e * mask_heads + mh) * c.lq * c.lk + i * row_step + j * key_step] =
                      fill == -1e38f && (i + j + mh) % 3 == 0 ? -2e38f : fill;
          }
          const mha::TensorView mask_view =
              layout == 2 ? mha::TensorView(mask.data<float>(), {c.batch, 1, c.lq, c.lk}, {c.lq * c.lk, c.lq * c.lk, 1, c.lq})
                          : mask.view();
          mha::SdpaOptions o{.attn_mask = mask_view, .enable_gqa = true};
          if (fill == -1e35f) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
          const auto ref = mha::reference::scaled_dot_product_attention_backward(q, k, v, go, o);
          const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
          for (const bool mask_grad : {false, true}) {
            char what[160];
            std::snprintf(what, sizeof what, "%s, %s, fill %g, %s%s", std::string(mha::detail::isa_name(isa)).c_str(),
                          c.what, fill, std::string(mha::dtype_name(dtype)).c_str(), mask_grad ? ", the mask's gradient" : "");
            SCOPED_TRACE(what);
            const double tolerance = dtype == mha::DType::f32 ? 1e-5 : 2e-2;
            const auto got = mha::scaled_dot_product_attention_backward(q, k, v, saved, go, o, mask_grad);
            EXPECT_LE(rel_error(got.query, ref.query), tolerance);
            EXPECT_LE(rel_error(got.key, ref.key), tolerance);
            EXPECT_LE(rel_error(got.value, ref.value), tolerance);
            if (mask_grad) EXPECT_LE(rel_error(*got.attn_mask, ref.attn_mask), tolerance);
          }
        }
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

}  // namespace
