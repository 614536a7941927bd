// Paged key/value caches (mha::paged_attention, mha::write_paged_cache): each sequence's result
// is the bits of scaled_dot_product_attention on its keys gathered in order, on every ISA, dtype
// (float64 within its rounding), thread count and page size, decoding shapes read in place and
// longer query blocks gathered, both cache layouts, with causality, windows, ALiBi and GQA; pages
// not listed (filled with NaN) are never read; the float64 reference within stated tolerances; a
// decoding loop that writes its cache step by step; bad input a clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
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
using Lens = std::vector<int64_t>;
using Table = std::vector<int32_t>;

// A pool of pages, the table and lengths of B sequences over it, and the same keys and values
// per sequence written out contiguously ([1, Hkv, len, D]), which the paged call must match.
struct PagedCase {
  mha::Tensor q, storage_k, storage_v;  // the caches' storage, in either layout
  mha::TensorView key_cache, value_cache;  // [pages, Hkv, page_size, D] views of it
  std::vector<int32_t> table;
  std::vector<int64_t> lens;
  std::vector<mha::Tensor> k_of, v_of;  // per sequence
  mha::Tensor slopes;
  mha::SdpaOptions options;
  std::string describe;
};

// Sets every element of `t` (any view) to `value`.
void fill(const mha::TensorView& t, double value) {
  mha::Tensor f = mha::Tensor::empty(t.sizes(), mha::DType::f64);
  std::fill_n(f.data<double>(), f.numel(), value);
  copy_into(f, t);
}

PagedCase draw_case(std::mt19937_64& rng, mha::DType dtype, int64_t lq) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  PagedCase c;
  const int64_t page_sizes[] = {1, 5, 16, 48, 64, 100};
  const int64_t page_size = page_sizes[pick(rng) % 6];
  const int64_t batch = 1 + pick(rng) % 4, hkv = 1 + pick(rng) % 2, group = 1 + pick(rng) % 3;
  const int64_t hq = hkv * group;
  const int64_t dims[] = {8, 16, 32, 64, 24};
  const int64_t dk = dims[pick(rng) % 5], dv = pick(rng) % 3 == 0 ? dims[pick(rng) % 5] : dk;
  // Lengths: empty, one key, a page's edge, and a few pages' worth (past 1008 keys: several runs).
  const int64_t max_len = pick(rng) % 3 == 0 ? 1500 : 300;
  int64_t pages_per_sequence = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int kind = pick(rng) % 8;
    const int64_t len = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? page_size * (1 + pick(rng) % 3)
                                                                  : 1 + pick(rng) % max_len;
    c.lens.push_back(len);
    pages_per_sequence = std::max(pages_per_sequence, (len + page_size - 1) / page_size + pick(rng) % 2);
  }
  pages_per_sequence = std::max<int64_t>(pages_per_sequence, 1);
  // The pool: every sequence's pages plus spares, in shuffled order; unused ones hold NaN.
  int64_t used = 0;
  for (int64_t len : c.lens) used += (len + page_size - 1) / page_size;
  const int64_t pages = used + 1 + pick(rng) % 3;
  std::vector<int32_t> order(static_cast<size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const bool flash_layout = pick(rng) % 2 == 0;  // [pages, page_size, Hkv, D] storage, viewed transposed
  if (flash_layout) {
    c.storage_k = mha::Tensor::empty({pages, page_size, hkv, dk}, dtype);
    c.storage_v = mha::Tensor::empty({pages, page_size, hkv, dv}, dtype);
    c.key_cache = c.storage_k.view().transpose(1, 2);
    c.value_cache = c.storage_v.view().transpose(1, 2);
  } else {
    c.storage_k = mha::Tensor::empty({pages, hkv, page_size, dk}, dtype);
    c.storage_v = mha::Tensor::empty({pages, hkv, page_size, dv}, dtype);
    c.key_cache = c.storage_k.view();
    c.value_cache = c.storage_v.view();
  }
  fill(c.storage_k, NAN);
  fill(c.storage_v, NAN);
  size_t next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = c.lens[b];
    c.k_of.push_back(randn({1, hkv, len, dk}, rng, dtype));
    c.v_of.push_back(randn({1, hkv, len, dv}, rng, dtype));
    for (int64_t i = 0; i < pages_per_sequence; ++i) {
      const int64_t j0 = i * page_size, n = std::min(len - j0, page_size);
      if (n <= 0) {
        c.table.push_back(-1);  // padding past the last page: never read
        continue;
      }
      const int32_t page = order[next++];
      c.table.push_back(page);
      copy_into(c.k_of[b].view().select(0, 0).slice(1, j0, j0 + n), c.key_cache.select(0, page).slice(1, 0, n));
      copy_into(c.v_of[b].view().select(0, 0).slice(1, j0, j0 + n), c.value_cache.select(0, page).slice(1, 0, n));
    }
  }
  c.q = randn({batch, hq, lq, dk}, rng, dtype);
  c.options.enable_gqa = group > 1;
  c.options.is_causal = pick(rng) % 2 == 0;
  c.options.causal_alignment = pick(rng) % 4 == 0 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (pick(rng) % 3 == 0) c.options.window_left = pick(rng) % 64;
  if (pick(rng) % 4 == 0) c.options.window_right = pick(rng) % 8;
  if (pick(rng) % 3 == 0) {
    c.slopes = pick(rng) % 2 == 0 ? mha::Tensor::empty({hq}) : mha::Tensor::empty({batch, hq});
    std::uniform_real_distribution<double> u(0.01, 0.5);
    for (int64_t x = 0; x < c.slopes.numel(); ++x) c.slopes.data<float>()[x] = static_cast<float>(u(rng));
    if (dtype == mha::DType::f64) c.slopes = mha::Tensor::copy_of(c.slopes, mha::DType::f64);
    c.options.alibi_slopes = c.slopes.view();
  }
  c.describe = std::string(mha::dtype_name(dtype)) + " B=" + std::to_string(batch) + " Hq=" + std::to_string(hq) +
               " Hkv=" + std::to_string(hkv) + " Lq=" + std::to_string(lq) + " dk=" + std::to_string(dk) +
               " dv=" + std::to_string(dv) + " page_size=" + std::to_string(page_size) +
               (flash_layout ? " [pages, page_size, H, D]" : " [pages, H, page_size, D]") +
               (c.options.is_causal ? " causal" : "") + " window=(" + std::to_string(c.options.window_left) + ", " +
               std::to_string(c.options.window_right) + ")" + (c.slopes.defined() ? " alibi" : "");
  return c;
}

// Sequence b alone, as scaled_dot_product_attention on its contiguous keys and values.
mha::SdpaOptions options_of(const PagedCase& c, int64_t b) {
  mha::SdpaOptions o = c.options;
  if (c.slopes.defined() && c.slopes.ndim() == 2) o.alibi_slopes = c.slopes.view().slice(0, b, b + 1);
  return o;
}

mha::Tensor paged(const PagedCase& c, int threads = 0) {
  mha::SdpaOptions o = c.options;
  o.num_threads = threads;
  return mha::paged_attention(c.q, c.key_cache, c.value_cache, c.table, c.lens, o);
}

void expect_sequences_alone(const PagedCase& c, const mha::Tensor& out) {
  for (int64_t b = 0; b < static_cast<int64_t>(c.lens.size()); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " of " + std::to_string(c.lens[b]) + " keys");
    const mha::TensorView qb = c.q.view().slice(0, b, b + 1);
    const mha::Tensor alone = mha::scaled_dot_product_attention(qb, c.k_of[b], c.v_of[b], options_of(c, b));
    EXPECT_TRUE(agree(mha::Tensor::copy_of(out.view().slice(0, b, b + 1)), alone));
  }
}

TEST(PagedAttention, EachSequenceGivesTheBitsOfItsOwnCall) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 24; ++n) {
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f16, mha::DType::f64};
      const int64_t lqs[] = {1, 1, 2, 5, 8, 32, 33, 70};  // up to 32 read in place, then gathered
      const PagedCase c = draw_case(rng, dtypes[n % 4], lqs[n % 8]);
      SCOPED_TRACE(c.describe);
      const mha::Tensor out = paged(c, 1 + n % 2);
      expect_sequences_alone(c, out);
      EXPECT_TRUE(agree(out, paged(c, 2 - n % 2)));  // the thread count changes no bit
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Packed query rows, a different count per sequence (a continuous-batching step: prompt chunks
// beside single decoding tokens, sequences with no row): each sequence's rows are its own SDPA
// call's bits, on every ISA, both sides of the 32-row line (in place and gathered).
TEST(PagedAttention, VarlenQueriesGiveEachSequenceItsOwnCall) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 12; ++n) {
      const mha::DType dtype = n % 3 == 1 ? mha::DType::bf16 : n % 6 == 2 ? mha::DType::f64 : mha::DType::f32;
      const PagedCase c = draw_case(rng, dtype, 1);
      SCOPED_TRACE(c.describe);
      const int64_t batch = static_cast<int64_t>(c.lens.size()), hq = c.q.size(1), dk = c.q.size(3);
      std::vector<int64_t> cu{0};
      const int64_t counts[] = {0, 1, 1, 3, 8, 40};
      for (int64_t b = 0; b < batch; ++b) cu.push_back(cu.back() + counts[(n + 5 * b) % 6]);
      const mha::Tensor q = randn({cu.back(), hq, dk}, rng, dtype);
      mha::SdpaOptions o = c.options;
      o.num_threads = 1 + n % 2;
      const mha::Tensor out = mha::paged_attention_varlen(q, cu, c.key_cache, c.value_cache, c.table, c.lens, o);
      ASSERT_EQ(out.sizes(), (mha::Shape{cu.back(), hq, c.value_cache.shape[3]}));
      for (int64_t b = 0; b < batch; ++b) {
        SCOPED_TRACE("sequence " + std::to_string(b) + ": " + std::to_string(cu[b + 1] - cu[b]) + " rows, " +
                     std::to_string(c.lens[b]) + " keys");
        const mha::TensorView qb = q.view().slice(0, cu[b], cu[b + 1]).transpose(0, 1).unsqueeze(0);
        const mha::Tensor alone = mha::scaled_dot_product_attention(qb, c.k_of[b], c.v_of[b], options_of(c, b));
        const mha::Tensor got = mha::Tensor::copy_of(out.view().slice(0, cu[b], cu[b + 1]).transpose(0, 1).unsqueeze(0));
        EXPECT_TRUE(agree(got, alone));
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
  const mha::Tensor kc = randn({2, 1, 4, 8}, rng), q = randn({3, 1, 8}, rng);
  expect_error([&] { (void)mha::paged_attention_varlen(q.view().unsqueeze(0), Lens{0, 3}, kc, kc, Table{0}, Lens{2}); },
               "query: expected a packed [Tq, Hq, Dk] tensor (rank 3)");
  expect_error([&] { (void)mha::paged_attention_varlen(q, Lens{0, 2}, kc, kc, Table{0}, Lens{2}); },
               "cu_seqlens_q: expected the last offset to be the number of query rows, 3, got 2");
  expect_error([&] { (void)mha::paged_attention_varlen(q, Lens{0, 1, 3}, kc, kc, Table{0}, Lens{2}); },
               "cache_seqlens: expected one length per sequence (2), got 1");
}

TEST(PagedAttention, MatchesFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 8; ++n) {
    const mha::DType dtype = n % 4 == 3 ? mha::DType::f64 : mha::DType::f32;
    const PagedCase c = draw_case(rng, dtype, n % 2 == 0 ? 1 : 4);
    SCOPED_TRACE(c.describe);
    const mha::Tensor out = paged(c);
    for (int64_t b = 0; b < static_cast<int64_t>(c.lens.size()); ++b) {
      if (c.lens[b] == 0) {  // no key: zeros, as a fully masked row gives
        EXPECT_EQ(mha_test::max_abs(out.view().slice(0, b, b + 1)), 0.0);
        continue;
      }
      const auto ref =
          mha::reference::scaled_dot_product_attention(c.q.view().slice(0, b, b + 1), c.k_of[b], c.v_of[b], options_of(c, b));
      // float32: softmax and sums of up to 1500 terms of O(1) in float32 with float32 statistics
      // (2e-5, as the SDPA tests); float64: its rounding over the same sums.
      EXPECT_LT(rel_error(out.view().slice(0, b, b + 1), ref.output), dtype == mha::DType::f64 ? 1e-12 : 2e-5);
    }
  }
}

// A decoding loop: a prompt written into empty pages, then one key per step, each step attending
// over the cache so far; against SDPA on the contiguous keys of the same steps.
TEST(PagedAttention, DecodingLoopWritesItsCacheAndReadsIt) {
  std::mt19937_64 rng(test_seed());
  for (mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    const int64_t batch = 3, hq = 4, hkv = 2, d = 32, page_size = 16, prompt = 21, steps = 20;
    const int64_t per_sequence = (prompt + steps + page_size - 1) / page_size;
    const int64_t pages = batch * per_sequence + 2;
    mha::Tensor key_cache = mha::Tensor::empty({pages, page_size, hkv, d}, dtype);  // vLLM's layout
    mha::Tensor value_cache = mha::Tensor::empty({pages, page_size, hkv, d}, dtype);
    fill(key_cache, NAN);
    fill(value_cache, NAN);
    const mha::TensorView kc = key_cache.view().transpose(1, 2), vc = value_cache.view().transpose(1, 2);
    std::vector<int32_t> table;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < per_sequence; ++i) table.push_back(static_cast<int32_t>(pages - 1 - (i * batch + b)));
    std::vector<int64_t> lens(batch, 0);
    mha::Tensor keys = randn({batch, hkv, prompt + steps, d}, rng, dtype);
    mha::Tensor values = randn({batch, hkv, prompt + steps, d}, rng, dtype);
    mha::write_paged_cache(keys.view().slice(2, 0, prompt), values.view().slice(2, 0, prompt), kc, vc, table, lens);
    for (int64_t& len : lens) len = prompt;
    mha::SdpaOptions o;
    o.is_causal = true;
    o.causal_alignment = mha::CausalAlignment::BottomRight;
    o.enable_gqa = true;
    for (int64_t t = 0; t < steps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      mha::write_paged_cache(keys.view().slice(2, prompt + t, prompt + t + 1),
                             values.view().slice(2, prompt + t, prompt + t + 1), kc, vc, table, lens);
      for (int64_t& len : lens) ++len;
      const mha::Tensor q = randn({batch, hq, 1, d}, rng, dtype);
      const mha::Tensor out = mha::paged_attention(q, kc, vc, table, lens, o);
      const mha::Tensor alone = mha::scaled_dot_product_attention(q, keys.view().slice(2, 0, lens[0]),
                                                                  values.view().slice(2, 0, lens[0]), o);
      EXPECT_TRUE(agree(out, alone));
    }
  }
}

TEST(PagedAttention, BadInputsAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 1, 8}, rng), kc = randn({6, 2, 4, 8}, rng), vc = randn({6, 2, 4, 8}, rng);
  const std::vector<int32_t> table{0, 1, 2, 3, 4, -1};
  const std::vector<int64_t> lens{9, 5};
  mha::SdpaOptions gqa;
  gqa.enable_gqa = true;
  auto call = [&](const mha::TensorView& qq, const mha::TensorView& k, const mha::TensorView& v,
                  const std::vector<int32_t>& t, const std::vector<int64_t>& l, const mha::SdpaOptions& o) {
    (void)mha::paged_attention(qq, k, v, t, l, o);
  };
  EXPECT_NO_THROW(call(q, kc, vc, table, lens, gqa));
  expect_error([&] { call(q.view().select(0, 0), kc, vc, table, lens, gqa); }, "query: expected a [B, Hq, Lq, Dk] tensor (rank 4)");
  expect_error([&] { call(q, kc.view().select(0, 0), vc, table, lens, gqa); }, "key_cache: expected a [pages, Hkv, page_size, Dk]");
  expect_error([&] { call(q, kc, vc.view().slice(2, 0, 3), table, lens, gqa); }, "expected the same [pages, Hkv, page_size]");
  expect_error([&] { call(q, kc, mha::Tensor::copy_of(vc, mha::DType::bf16), table, lens, gqa); },
               "value_cache: expected the key cache's dtype float32, got bfloat16");
  const mha::Tensor rows_last = randn({6, 2, 8, 4}, rng);
  expect_error([&] { call(q, kc, rows_last.view().transpose(2, 3), table, lens, gqa); },
               "value_cache: expected unit stride in the last dimension");
  expect_error([&] { call(q, kc, vc, table, {9}, gqa); }, "cache_seqlens: expected one length per sequence (2), got 1");
  expect_error([&] { call(q, kc, vc, {0, 1, 2, 3, 4}, lens, gqa); }, "block_table: expected [B, pages_per_sequence] entries");
  expect_error([&] { call(q, kc, vc, table, {-1, 5}, gqa); }, "cache_seqlens: expected lengths >= 0");
  expect_error([&] { call(q, kc, vc, table, {13, 5}, gqa); }, "sequence 0 reads keys up to position 13, more than its 3");
  expect_error([&] { call(q, kc, vc, table, {9, 9}, gqa); }, "block_table[1][2] = -1");
  expect_error([&] { call(q, kc, vc, {0, 1, 7, 3, 4, 5}, lens, gqa); }, "expected page indices in [0, 6), got block_table[0][2] = 7");
  expect_error([&] { call(q, kc, vc, table, lens, {}); }, "enable_gqa");
  const mha::Tensor mask = mha::Tensor::zeros({1, 9});
  mha::SdpaOptions masked = gqa;
  masked.attn_mask = mask.view();
  expect_error([&] { call(q, kc, vc, table, lens, masked); }, "attn_mask: not taken by paged_attention");
  mha::SdpaOptions dropout = gqa;
  dropout.dropout_p = 0.1;
  expect_error([&] { call(q, kc, vc, table, lens, dropout); }, "dropout_p: paged_attention is for inference");
  const mha::Tensor slopes = mha::Tensor::zeros({3, 4});
  mha::SdpaOptions alibi = gqa;
  alibi.alibi_slopes = slopes.view();
  expect_error([&] { call(q, kc, vc, table, lens, alibi); }, "alibi_slopes: expected shape [Hq] or [B, Hq] (B = 2)");
  mha::Tensor bad_slopes = mha::Tensor::zeros({4});
  bad_slopes.data<float>()[2] = INFINITY;
  alibi.alibi_slopes = bad_slopes.view();
  expect_error([&] { call(q, kc, vc, table, lens, alibi); }, "alibi_slopes");
  const mha::Tensor no_rows = mha::Tensor::empty({6, 2, 0, 8});
  expect_error([&] { call(q, no_rows, no_rows, table, {0, 0}, gqa); }, "page size (dimension 2) of at least 1");

  // The cache write.
  const mha::Tensor k_new = randn({2, 2, 3, 8}, rng), v_new = randn({2, 2, 3, 8}, rng);
  EXPECT_NO_THROW(mha::write_paged_cache(k_new, v_new, kc, vc, table, Lens{9, 5}));
  expect_error([&] { mha::write_paged_cache(k_new, v_new, kc, vc, table, Lens{10, 5}); },
               "sequence 0 writes rows up to position 13, more than its 3 table entries of 4 rows hold");
  expect_error([&] { mha::write_paged_cache(k_new, v_new, kc, vc, table, Lens{9, 6}); }, "block_table[1][2] = -1");
  expect_error([&] { mha::write_paged_cache(k_new.view().slice(1, 0, 1), v_new, kc, vc, table, lens); },
               "key/value: expected [B, Hkv, Lnew, Dk] and [B, Hkv, Lnew, Dv] with the caches' Hkv = 2");
  expect_error([&] { mha::write_paged_cache(mha::Tensor::copy_of(k_new, mha::DType::f16), v_new, kc, vc, table, lens); },
               "key: expected the caches' dtype float32, got float16");
  expect_error([&] { mha::write_paged_cache(k_new.view().select(0, 0), v_new, kc, vc, table, lens); },
               "key: expected a [B, Hkv, Lnew, Dk] tensor (rank 4)");
}

// Empty shapes: no sequence, no query row, no key anywhere.
TEST(PagedAttention, EmptyShapes) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor kc = randn({3, 1, 4, 8}, rng), vc = randn({3, 1, 4, 8}, rng);
  EXPECT_EQ(mha::paged_attention(mha::Tensor::empty({0, 2, 1, 8}), kc, vc, Table{}, Lens{}).sizes(), (mha::Shape{0, 2, 1, 8}));
  EXPECT_EQ(mha::paged_attention(mha::Tensor::empty({2, 2, 0, 8}), kc, vc, Table{0, 1}, Lens{3, 4}).sizes(),
            (mha::Shape{2, 2, 0, 8}));
  const mha::Tensor out = mha::paged_attention(randn({2, 2, 3, 8}, rng), kc, vc, Table{-1, -1}, Lens{0, 0});
  EXPECT_EQ(mha_test::max_abs(out), 0.0);
  const mha::Tensor none = mha::Tensor::empty({0, 1, 4, 8});
  EXPECT_EQ(mha_test::max_abs(mha::paged_attention(randn({1, 1, 1, 8}, rng), none, none, Table{-1}, Lens{0})), 0.0);
}

}  // namespace
