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

// What a case may fix instead of drawing it (0 or -1: drawn).
struct Fixed {
  int64_t group = 0, dk = 0;
  int flash_layout = -1;
};

PagedCase draw_case(std::mt19937_64& rng, mha::DType dtype, int64_t lq, Fixed fixed = {}) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  PagedCase c;
  const int64_t page_sizes[] = {1, 5, 16, 48, 64, 100};
  const int64_t page_size = page_sizes[pick(rng) % 6];
  const int64_t batch = 1 + pick(rng) % 4, hkv = 1 + pick(rng) % 2, group = fixed.group ? fixed.group : 1 + pick(rng) % 3;
  const int64_t hq = hkv * group;
  // (rows of 256 bytes and more, side by side: a sweep's steps of 8 and 4 keys per head)
  const int64_t dims[] = {8, 16, 32, 64, 24, 128};
  const int64_t dk = fixed.dk ? fixed.dk : dims[pick(rng) % 6], dv = pick(rng) % 3 == 0 ? dims[pick(rng) % 6] : dk;
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
  // [pages, page_size, Hkv, D] storage, viewed transposed
  const bool flash_layout = fixed.flash_layout >= 0 ? fixed.flash_layout == 1 : pick(rng) % 2 == 0;
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

// The case's output on `threads` threads is each sequence's own call's bits, and those of the
// other thread count (1 or 2).
void expect_own_calls_at_both_thread_counts(const PagedCase& c, int threads) {
  const mha::Tensor out = paged(c, threads);
  expect_sequences_alone(c, out);
  EXPECT_TRUE(agree(out, paged(c, 3 - threads)));  // the thread count changes no bit
}

TEST(PagedAttention, EachSequenceGivesTheBitsOfItsOwnCall) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 32; ++n) {
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f16, mha::DType::f64};
      // Every length with every dtype: up to 32 read in place, then gathered (bfloat16 with pair
      // products: read in place by the tile kernel too).
      const int64_t lqs[] = {1, 2, 5, 8, 32, 33, 70, 150};
      const PagedCase c = draw_case(rng, dtypes[n % 4], lqs[n / 4]);
      SCOPED_TRACE(c.describe);
      expect_own_calls_at_both_thread_counts(c, 1 + n % 2);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Heads side by side ([pages, page_size, Hkv, D]) with 16 to 32 query rows per key/value head
// and head dims up to 64, where bfloat16 decoding with pair products takes its scores from keys
// transposed as pairs: the bits of the sequence's call on contiguous keys, on every ISA, whatever
// the thread count.
TEST(PagedAttention, ManyRowsPerHeadOverSideBySideHeadsGiveTheBitsOfTheirOwnCall) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 8; ++n) {
      const int64_t lqs[] = {4, 8, 16, 32}, groups[] = {4, 2, 1, 1}, dims[] = {16, 32, 64, 24};
      const mha::DType dtype = n < 6 ? mha::DType::bf16 : mha::DType::f32;
      const PagedCase c = draw_case(rng, dtype, lqs[n % 4], Fixed{groups[n % 4], dims[(n + n / 4) % 4], 1});
      SCOPED_TRACE(c.describe);
      expect_own_calls_at_both_thread_counts(c, 1 + n % 2);
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Prompt chunks (more than 32 queries a head): the bfloat16 pair-product tile kernel reads the
// pages where they lie, in each of its schedules (whole key/value heads per thread with their rows
// copied packed, query tasks, query tasks sharing value pairs), as head counts, lengths and thread
// counts vary; float32 and float16 gather them. Each sequence's rows are its own call's bits on
// contiguous keys and values, on every ISA.
TEST(PagedAttention, PromptChunksGiveEachSequenceItsOwnCall) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 30; ++n) {
      const mha::DType dtypes[] = {mha::DType::bf16, mha::DType::f32, mha::DType::f16};
      const int64_t lqs[] = {33, 48, 90, 150, 600};
      const PagedCase c = draw_case(rng, dtypes[n % 3], lqs[n % 5]);
      SCOPED_TRACE(c.describe);
      expect_own_calls_at_both_thread_counts(c, 1 + n % 2);
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

// Each row's log-sum-exp [Hq, L] (lse_rows) is that of sequence b's own training call, bit for bit;
// +inf for a sequence with no key.
void expect_lse_of_own_call(const mha::TensorView& lse_rows, const mha::TensorView& qb, const PagedCase& c,
                            int64_t b) {
  if (c.lens[b] == 0) {
    const mha::Tensor got = mha::Tensor::copy_of(lse_rows, mha::DType::f64);
    for (int64_t x = 0; x < got.numel(); ++x) EXPECT_EQ(got.data<double>()[x], INFINITY);
    return;
  }
  const auto alone = mha::scaled_dot_product_attention_for_training(qb, c.k_of[b], c.v_of[b], options_of(c, b));
  EXPECT_TRUE(agree(mha::Tensor::copy_of(lse_rows), alone.lse.view().select(0, 0)));
}

// The log-sum-exp beside the output: the output's bits unchanged, each row's lse that of the
// sequence's own training call, padded [B, Hq, Lq] and packed [Hq, Tq], on every ISA.
TEST(PagedAttention, LseIsEachSequencesOwn) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 12; ++n) {
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f64};
      const int64_t lqs[] = {1, 3, 8, 40};  // in place and gathered
      const PagedCase c = draw_case(rng, dtypes[n % 3], lqs[n % 4]);
      SCOPED_TRACE(c.describe);
      mha::SdpaOptions o = c.options;
      o.num_threads = 1 + n % 2;
      const auto r = mha::paged_attention_with_lse(c.q, c.key_cache, c.value_cache, c.table, c.lens, o);
      const int64_t batch = c.q.size(0), hq = c.q.size(1), lq = c.q.size(2);
      ASSERT_EQ(r.lse.sizes(), (mha::Shape{batch, hq, lq}));
      EXPECT_EQ(r.lse.dtype(), dtypes[n % 3] == mha::DType::f64 ? mha::DType::f64 : mha::DType::f32);
      EXPECT_TRUE(agree(r.output, paged(c, o.num_threads)));
      for (int64_t b = 0; b < batch; ++b) {
        SCOPED_TRACE("sequence " + std::to_string(b) + " of " + std::to_string(c.lens[b]) + " keys");
        expect_lse_of_own_call(r.lse.view().select(0, b), c.q.view().slice(0, b, b + 1), c, b);
      }
      // Packed rows, a different count per sequence.
      std::vector<int64_t> cu{0};
      for (int64_t b = 0; b < batch; ++b) cu.push_back(cu.back() + (n + 3 * b) % 5);
      const mha::Tensor q = randn({cu.back(), hq, c.q.size(3)}, rng, c.q.dtype());
      const auto packed = mha::paged_attention_varlen_with_lse(q, cu, c.key_cache, c.value_cache, c.table, c.lens, o);
      ASSERT_EQ(packed.lse.sizes(), (mha::Shape{hq, cu.back()}));
      EXPECT_TRUE(agree(packed.output, mha::paged_attention_varlen(q, cu, c.key_cache, c.value_cache, c.table, c.lens, o)));
      for (int64_t b = 0; b < batch; ++b) {
        SCOPED_TRACE("packed sequence " + std::to_string(b));
        const mha::TensorView qb = q.view().slice(0, cu[b], cu[b + 1]).transpose(0, 1).unsqueeze(0);
        expect_lse_of_own_call(packed.lse.view().slice(1, cu[b], cu[b + 1]), qb, c, b);
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// What the lse is for: a cache split in two (a shared prefix's pages and each sequence's own
// suffix) attended separately and merged (merge_attention_states) gives the whole cache's result;
// the lse itself against log(sum(exp(scale q.k))) in float64. Without causality, windows or ALiBi
// (those depend on where a key lies in the whole sequence).
TEST(PagedAttention, LseMergesResultsOverSplitCaches) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 10; ++n) {
    const mha::DType dtype = n % 5 == 4 ? mha::DType::f64 : mha::DType::f32;
    PagedCase c = draw_case(rng, dtype, n % 2 == 0 ? 1 : 6);
    c.options.is_causal = false;
    c.options.window_left = c.options.window_right = -1;
    c.options.alibi_slopes.reset();
    c.slopes = mha::Tensor();
    SCOPED_TRACE(c.describe);
    const int64_t batch = c.q.size(0), hq = c.q.size(1), lq = c.q.size(2), dk = c.q.size(3);
    const int64_t dv = c.value_cache.shape[3], hkv = c.key_cache.shape[1], page_size = c.key_cache.shape[2];
    const int64_t per_sequence = static_cast<int64_t>(c.table.size()) / batch;
    // Every other case with sinks: the whole call's, and the prefix's alone (counted once).
    mha::Tensor sinks;
    mha::SdpaOptions with_sinks = c.options;
    if (n % 2 == 1) {
      sinks = randn({hq}, rng, dtype == mha::DType::f64 ? mha::DType::f64 : mha::DType::f32);
      with_sinks.sinks = sinks.view();
    }
    const auto whole = mha::paged_attention_with_lse(c.q, c.key_cache, c.value_cache, c.table, c.lens, with_sinks);
    // The prefix: the first `split` pages of every sequence; the suffix: the rest of its table.
    const int64_t split = per_sequence / 2;
    Lens prefix_lens, suffix_lens;
    Table suffix_table;
    for (int64_t b = 0; b < batch; ++b) {
      prefix_lens.push_back(std::min(c.lens[b], split * page_size));
      suffix_lens.push_back(c.lens[b] - prefix_lens.back());
      for (int64_t i = split; i < per_sequence; ++i) suffix_table.push_back(c.table[b * per_sequence + i]);
      if (split == per_sequence) suffix_table.push_back(-1);
    }
    const auto a = mha::paged_attention_with_lse(c.q, c.key_cache, c.value_cache, c.table, prefix_lens, with_sinks);
    const auto z = mha::paged_attention_with_lse(c.q, c.key_cache, c.value_cache, suffix_table, suffix_lens, c.options);
    const auto merged = mha::merge_attention_states(a.output, a.lse, z.output, z.lse);
    ASSERT_EQ(merged.output.dtype(), whole.output.dtype());
    ASSERT_EQ(merged.lse.dtype(), whole.lse.dtype());
    mha::Tensor expected_lse = mha::Tensor::empty(whole.lse.sizes(), mha::DType::f64);
    const mha::Tensor q64 = mha::Tensor::copy_of(c.q, mha::DType::f64);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    for (int64_t row = 0; row < batch * hq * lq; ++row) {
      const int64_t b = row / (hq * lq), h = row / lq % hq;
      // log(sum_j exp(scale q.k_j)) over the sequence's keys, in float64 from the formula.
      const mha::Tensor k64 = mha::Tensor::copy_of(c.k_of[b].view().select(0, 0).select(0, h / (hq / hkv)), mha::DType::f64);
      double top = -INFINITY;
      std::vector<double> s(static_cast<size_t>(c.lens[b]));
      for (int64_t j = 0; j < c.lens[b]; ++j) {
        double dot = 0;
        for (int64_t x = 0; x < dk; ++x) dot += q64.data<double>()[row * dk + x] * k64.data<double>()[j * dk + x];
        s[j] = scale * dot;
        top = std::max(top, s[j]);
      }
      double sum = 0;
      for (double v : s) sum += std::exp(v - top);
      if (sinks.defined()) {  // one more term, exp(sink)
        const double sink = mha::Tensor::copy_of(sinks, mha::DType::f64).data<double>()[h];
        const double top_with_sink = std::max(top, sink);
        sum = (c.lens[b] == 0 ? 0.0 : sum * std::exp(top - top_with_sink)) + std::exp(sink - top_with_sink);
        top = top_with_sink;
      }
      expected_lse.data<double>()[row] = c.lens[b] == 0 && !sinks.defined() ? INFINITY : top + std::log(sum);
    }
    // float32: each half's output and lse carry float32 rounding of sums of up to 1500 terms (2e-5
    // as the SDPA tests); the lse is O(log S + |s|), its float32 statistics within 1e-5 relative.
    const double out_tol = dtype == mha::DType::f64 ? 1e-12 : 2e-5, lse_tol = dtype == mha::DType::f64 ? 1e-12 : 1e-5;
    EXPECT_LT(rel_error(merged.output, whole.output), out_tol);
    EXPECT_LT(rel_error(merged.lse, whole.lse, 1.0), lse_tol);
    EXPECT_LT(rel_error(whole.lse, expected_lse, 1.0), lse_tol);
  }
}

// The packed write: each sequence's rows (a different count each, some none) land where
// write_paged_cache of that sequence alone puts them, bit for bit, NaN pages untouched elsewhere.
TEST(PagedAttention, VarlenWriteMatchesEachSequencesOwnWrite) {
  std::mt19937_64 rng(test_seed());
  for (mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    const int64_t batch = 4, hkv = 2, dk = 16, dv = 8, page_size = 5, per_sequence = 6;
    const int64_t pages = batch * per_sequence;
    auto nan_cache = [&](int64_t d) {
      mha::Tensor t = mha::Tensor::empty({pages, page_size, hkv, d}, dtype);  // FlashAttention's layout
      fill(t, NAN);
      return t;
    };
    mha::Tensor kc = nan_cache(dk), vc = nan_cache(dv), kc_alone = nan_cache(dk), vc_alone = nan_cache(dv);
    std::vector<int32_t> order(static_cast<size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const Table table(order.begin(), order.end());
    const Lens lens{0, 4, 13, 29}, counts{3, 0, 7, 1};
    std::vector<int64_t> cu{0};
    for (int64_t count : counts) cu.push_back(cu.back() + count);
    const mha::Tensor k = randn({cu.back(), hkv, dk}, rng, dtype), v = randn({cu.back(), hkv, dv}, rng, dtype);
    mha::write_paged_cache_varlen(k, v, cu, kc.view().transpose(1, 2), vc.view().transpose(1, 2), table, lens);
    for (int64_t b = 0; b < batch; ++b) {
      const mha::TensorView kb = k.view().slice(0, cu[b], cu[b + 1]).transpose(0, 1).unsqueeze(0);
      const mha::TensorView vb = v.view().slice(0, cu[b], cu[b + 1]).transpose(0, 1).unsqueeze(0);
      const std::span<const int32_t> row(table.data() + b * per_sequence, static_cast<size_t>(per_sequence));
      mha::write_paged_cache(kb, vb, kc_alone.view().transpose(1, 2), vc_alone.view().transpose(1, 2), row,
                             Lens{lens[b]});
    }
    EXPECT_TRUE(mha_test::same_bits(kc, kc_alone));
    EXPECT_TRUE(mha_test::same_bits(vc, vc_alone));
    // Rows written: one per new row; every other slot still NaN.
    const mha::Tensor written = mha::Tensor::copy_of(kc, mha::DType::f64);
    int64_t finite = 0;
    for (int64_t x = 0; x < written.numel(); ++x) finite += std::isnan(written.data<double>()[x]) ? 0 : 1;
    EXPECT_EQ(finite, cu.back() * hkv * dk);
    const mha::TensorView kcv = kc.view().transpose(1, 2), vcv = vc.view().transpose(1, 2);
    expect_error([&] { mha::write_paged_cache_varlen(k, v, Lens{0, 3, 3, 10}, kcv, vcv, table, lens); },
                 "cu_seqlens_new: expected the last offset to be the number of key rows, 11, got 10");
    expect_error([&] { mha::write_paged_cache_varlen(k.view().unsqueeze(0), v, cu, kcv, vcv, table, lens); },
                 "key: expected a packed [Tnew, Hkv, D] tensor (rank 3)");
    expect_error([&] { mha::write_paged_cache_varlen(k, v.view().slice(1, 0, 1), cu, kcv, vcv, table, lens); },
                 "key/value: expected [Tnew, Hkv, Dk] and [Tnew, Hkv, Dv] with the caches' Hkv = 2");
    expect_error([&] { mha::write_paged_cache_varlen(k, v, cu, kcv, vcv, table, Lens{0, 4, 24, 29}); },
                 "sequence 2 writes rows up to position 31, more than its 6 table entries of 5 rows hold");
    expect_error([&] { mha::write_paged_cache_varlen(k, v, cu, kcv, vcv, table, Lens{0, 4, 13}); },
                 "cache_seqlens: expected one length per sequence (4), got 3");
    expect_error([&] { mha::write_paged_cache_varlen(mha::Tensor::copy_of(k, mha::DType::f16), v, cu, kcv, vcv, table, lens); },
                 "key: expected the caches' dtype");
  }
}

// merge_attention_states on its own: packed rows [Tq, Hq, Dv] with lse [Hq, Tq] against the
// formula in float64, bfloat16 outputs rounded once, a part without keys (+inf) taking no weight,
// neither part with keys giving zeros and +inf, any strides; bad arguments are clear errors.
TEST(PagedAttention, MergeAttentionStatesFollowsTheFormula) {
  std::mt19937_64 rng(test_seed());
  const int64_t tq = 5, hq = 3, dv = 7;
  const mha::Tensor oa = randn({tq, hq, dv}, rng), ob = randn({tq, hq, dv}, rng);
  mha::Tensor la = randn({hq, tq}, rng), lb = randn({hq, tq}, rng);
  la.data<float>()[1] = INFINITY;                               // row (1, 0): b's alone
  la.data<float>()[2] = lb.data<float>()[2] = INFINITY;         // row (2, 0): neither
  lb.data<float>()[tq + 3] = INFINITY;                          // row (3, 1): a's alone
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    SCOPED_TRACE(mha::dtype_name(dtype));
    const mha::Tensor xa = mha::Tensor::copy_of(oa, dtype), xb = mha::Tensor::copy_of(ob, dtype);
    const auto m = mha::merge_attention_states_varlen(xa, la, xb, lb);
    ASSERT_EQ(m.output.sizes(), (mha::Shape{tq, hq, dv}));
    ASSERT_EQ(m.lse.sizes(), (mha::Shape{hq, tq}));
    EXPECT_EQ(m.output.dtype(), dtype);
    const mha::Tensor a64 = mha::Tensor::copy_of(xa, mha::DType::f64), b64 = mha::Tensor::copy_of(xb, mha::DType::f64);
    const mha::Tensor got = mha::Tensor::copy_of(m.output, mha::DType::f64);
    for (int64_t t = 0; t < tq; ++t)
      for (int64_t h = 0; h < hq; ++h) {
        const double x = la.data<float>()[h * tq + t], y = lb.data<float>()[h * tq + t];
        const double wx = std::isinf(x) ? 0.0 : std::exp(x), wy = std::isinf(y) ? 0.0 : std::exp(y);
        const double lse = m.lse.data<float>()[h * tq + t];
        if (wx + wy == 0) {
          EXPECT_EQ(lse, INFINITY);
        } else {
          EXPECT_NEAR(lse, std::log(wx + wy), 1e-6 * std::max(1.0, std::abs(lse)));
        }
        for (int64_t e = 0; e < dv; ++e) {
          const int64_t at = (t * hq + h) * dv + e;
          const double want = wx + wy == 0 ? 0.0 : (wx * a64.data<double>()[at] + wy * b64.data<double>()[at]) / (wx + wy);
          EXPECT_NEAR(got.data<double>()[at], want, dtype == mha::DType::f32 ? 1e-6 : 1e-2 * std::max(1.0, std::abs(want)))
              << "row " << t << " head " << h;
        }
      }
  }
  // [B, Hq, Lq, Dv] with [B, Hq, Lq], views with strides: one row's merge is the packed one's.
  const auto packed = mha::merge_attention_states_varlen(oa, la, ob, lb);
  const auto rows = mha::merge_attention_states(oa.view().transpose(0, 1).unsqueeze(0), la.view().unsqueeze(0),
                                                ob.view().transpose(0, 1).unsqueeze(0), lb.view().unsqueeze(0));
  EXPECT_TRUE(agree(rows.output, mha::Tensor::copy_of(packed.output.view().transpose(0, 1).unsqueeze(0))));
  EXPECT_TRUE(agree(rows.lse, mha::Tensor::copy_of(packed.lse.view().unsqueeze(0))));
  expect_error([&] { (void)mha::merge_attention_states_varlen(oa, la, randn({tq, hq, dv + 1}, rng), lb); },
               "out_b: expected out_a's shape and dtype [5, 3, 7] float32, got [5, 3, 8] float32");
  expect_error([&] { (void)mha::merge_attention_states_varlen(oa, la, ob, randn({hq, tq}, rng, mha::DType::f64)); },
               "lse_b: expected lse_a's shape and dtype [3, 5] float32, got [3, 5] float64");
  expect_error([&] { (void)mha::merge_attention_states_varlen(oa, randn({tq, hq}, rng), ob, randn({tq, hq}, rng)); },
               "lse_a: expected [Hq, Tq] = [3, 5], got [5, 3]");
  expect_error([&] { (void)mha::merge_attention_states(oa, la, ob, lb); },
               "lse_a: expected the output's shape without its last dimension, [5, 3], got [3, 5]");
  const mha::Tensor bf = mha::Tensor::copy_of(la, mha::DType::bf16);
  expect_error([&] { (void)mha::merge_attention_states_varlen(oa, bf, ob, bf); }, "lse_a: expected float32 or float64, got bfloat16");
}

}  // namespace
