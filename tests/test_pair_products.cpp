// The bfloat16 forward with AVX512-BF16 pair products (Isa::avx512_bf16, flash_forward_avx512bf16):
// against the float64 reference on fresh random shapes and options around its blocks (48 queries,
// 64 keys, pairs of dims and of keys), that it really runs (its output is not the float32
// kernel's), and that its bits do not depend on the thread count.
//
// Tolerance: bfloat16 inputs are exact in its products and the softmax is float32, but P is rounded
// to bfloat16 (2^-8 relative at most) for P V and the output is rounded once more: 1e-2 of the
// largest output or of the size of its terms (mha_test::terms_magnitude), whichever is larger, as
// every bfloat16 path. The weights are the float32 P's rounded once: 1e-2 too. The log-sum-exp is
// the float32 softmax's with 2^x sized for bfloat16 probabilities (7.5e-5 relative per term): 2e-4 absolute per row, as the AMX kernel's.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "mha/reference.hpp"
#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

bool has_pairs() {
  const auto isas = mha::detail::supported_isas();
  return std::find(isas.begin(), isas.end(), mha::detail::Isa::avx512_bf16) != isas.end();
}

struct PairCase {
  mha::Tensor q, k, v, mask;
  mha::SdpaOptions options;
  std::string describe;
};

// Lq from just past the decoding kernel's 32 to past 512, Lk from 1 (a block of one key, 63 of
// zeros) to 300, even head dims of q and k from 2 to 256 (a pair per word; the tail of a 16-word
// transpose), any dv (a partial vector of columns), GQA, causal of both alignments, a sliding
// window, bool and float masks with broadcast dims, dropout, a scale, soft-capping, and q, k, v
// read through views whose rows are not contiguous (then copied with unit stride).
PairCase draw(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  PairCase c;
  const int64_t lq = coin(0.1) ? pick(513, 600) : pick(33, 200), lk = coin(0.2) ? pick(1, 70) : pick(1, 300);
  const int64_t hkv = pick(1, 2), hq = hkv * pick(1, 3), b = pick(1, 2);
  const int64_t dk = std::vector<int64_t>{2, 8, 24, 40, 64, 64, 128, 256}[pick(0, 7)];
  const int64_t dv = std::vector<int64_t>{1, 7, 16, 33, 64, 72, 128}[pick(0, 6)];
  auto make = [&](int64_t h, int64_t l, int64_t d) {
    if (coin(0.25)) {  // [B, L, H, D] storage seen as [B, H, L, D]
      const mha::Tensor t = randn({b, l, h, d}, rng, mha::DType::bf16);
      return mha::Tensor::copy_of(t.view().transpose(1, 2), mha::DType::bf16);
    }
    return randn({b, h, l, d}, rng, mha::DType::bf16);
  };
  c.q = make(hq, lq, dk), c.k = make(hkv, lk, dk), c.v = make(hkv, lk, dv);
  c.options.enable_gqa = hq != hkv;
  c.options.is_causal = coin(0.4);
  c.options.causal_alignment = coin(0.5) ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (coin(0.2)) c.options.window_left = pick(0, 100);
  if (coin(0.2)) c.options.scale = std::uniform_real_distribution<double>(0.05, 1.5)(rng);
  if (coin(0.15)) c.options.dropout_p = 0.3, c.options.dropout_seed = rng();
  if (coin(0.15)) c.options.softcap = 5.0;
  const int64_t mask_kind = pick(0, 3);
  if (mask_kind == 1) {
    c.mask = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
    for (int64_t i = 0; i < c.mask.numel(); ++i) c.mask.data<bool>()[i] = coin(0.8);
  } else if (mask_kind == 2) {
    c.mask = randn({b, 1, 1, lk}, rng);
  }
  if (c.mask.defined()) c.options.attn_mask = c.mask.view();
  // (A fully masked row is zero in both; the float64 reference and the kernel agree on it.)
  c.describe = "q " + c.q.shape_str() + " k " + c.k.shape_str() + " v " + c.v.shape_str() + " causal " +
               std::to_string(c.options.is_causal) + " window " + std::to_string(c.options.window_left) + " mask " +
               std::to_string(mask_kind) + " dropout " + std::to_string(c.options.dropout_p) + " softcap " +
               std::to_string(c.options.softcap);
  return c;
}

// The float32 kernel (ISA avx512) on the same bfloat16 inputs as `saved`, a training forward of
// the pair products: its log-sum-exp within 2e-4 of saved's (both the float32 softmax of the same
// exact products' sums; the 2^x sized for bfloat16 adds up to 7.5e-5 relative per term), infinite
// where it is. Returns whether the outputs' or the log-sum-exps' bits differ: the products ran (P
// rounded to bfloat16, the 2^x sized for it, or, in the decoding kernel's dot mode, the scores
// summed as pairs and P rounded for the value product).
bool differs_from_float32_kernel(const mha::AttentionForTraining& saved, const mha::TensorView& q, const mha::TensorView& k,
                                 const mha::TensorView& v, const mha::SdpaOptions& o) {
  mha::detail::force_isa(mha::detail::Isa::avx512);
  const auto saved32 = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  mha::detail::force_isa(mha::detail::Isa::avx512_bf16);
  for (int64_t r = 0; r < saved.lse.numel(); ++r) {
    const float a = saved.lse.data<float>()[r], want = saved32.lse.data<float>()[r];
    const bool near = std::isinf(want) ? a == want : std::abs(a - want) <= 2e-4 * std::max(1.0f, std::abs(want));
    if (!near) {
      ADD_FAILURE() << "log-sum-exp of row " << r << ": " << a << " against the float32 kernel's " << want;
      break;
    }
  }
  return !same_bits(saved.output, saved32.output) || !same_bits(saved.lse, saved32.lse);
}

class PairProducts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_pairs()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
    mha::detail::force_isa(mha::detail::Isa::avx512_bf16);
  }
  void TearDown() override { mha::detail::force_isa(std::nullopt); }
};

TEST_F(PairProducts, RandomizedAgainstFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  int differs_from_float32 = 0;
  constexpr int kCases = 60;
  for (int n = 0; n < kCases; ++n) {
    const PairCase c = draw(rng);
    SCOPED_TRACE(c.describe);
    ASSERT_TRUE(mha_test::pair_products_forward(mha::DType::bf16, c.q.size(2), c.q.size(3)));
    const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    const mha::Tensor out = mha::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    const double terms = mha_test::terms_magnitude(c.q, c.k, c.v, c.options);
    EXPECT_LT(rel_error(out, ref.output, terms), 1e-2);
    const auto with_weights = mha::scaled_dot_product_attention_with_weights(c.q, c.k, c.v, c.options);
    // With the weights wanted, P from the float32 exponential rather than the one sized for
    // bfloat16 (7.5e-5): the output within bfloat16 rounding of the plain call's.
    EXPECT_LT(rel_error(with_weights.output, out, terms), 1e-2);
    EXPECT_LT(rel_error(with_weights.weights, ref.weights), 1e-2);
    // The float32 kernel on the same bfloat16 inputs, and its log-sum-exp.
    const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k, c.v, c.options);
    EXPECT_TRUE(same_bits(saved.output, out));
    differs_from_float32 += differs_from_float32_kernel(saved, c.q, c.k, c.v, c.options);
  }
  // P rounded to bfloat16 changes some bits in nearly every case: the kernel ran.
  EXPECT_GT(differs_from_float32, kCases / 2);
}

// The decoding kernel in pair products, up to 32 queries per head: its panel schedule
// (few_queries.hpp's run_keys_by_pairs) past 32 query rows per key/value head (GQA groups of 2-8
// at several tokens each) in odd cases where the group allows, its dot mode's scores
// (dot_pair_scores_rows) up to 32 rows in the others (decoding steps, speculative decoding,
// prompt chunks: blocks of 4 rows and the rest; with [B, L, H, D] views, several heads per task),
// against the float64 reference on fresh shapes:
// caches past one run of 1008 keys (runs merged), blocks of 48 keys cut short and odd key counts
// (a pair half empty), even head dims from 2 to 256, any Dv, [B, L, H, D] views, causal in both
// alignments, windows, masks (bool, additive, a left-padded batch's key padding that skips
// blocks), dropout, soft-capping, a scale. Tolerance as above (P rounded to bfloat16, the output
// rounded); the log-sum-exp within 2e-4 of the float32 schedule's; the bits those of 1 thread on 3;
// and not the float32 schedule's bits in most cases (the products ran).
TEST_F(PairProducts, FewQueriesAgainstFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  int differs_from_float32 = 0;
  constexpr int kCases = 40;
  for (int n = 0; n < kCases; ++n) {
    const int64_t group = std::vector<int64_t>{1, 2, 4, 8}[pick(0, 3)], hkv = pick(1, 2), b = pick(1, 2);
    const int64_t panel = 32 / group + 1;  // the fewest queries per head the panel takes (33 for one head: none)
    const int64_t lq = n % 2 == 1 && panel <= 32 ? pick(panel, 32) : pick(1, std::min<int64_t>(panel - 1, 32));
    const int64_t lk = coin(0.3) ? pick(900, 2200) : pick(1, 200);
    const int64_t dk = std::vector<int64_t>{2, 16, 40, 64, 128, 256}[pick(0, 5)];
    const int64_t dv = std::vector<int64_t>{1, 7, 16, 33, 64, 128}[pick(0, 5)];
    const int64_t hq = hkv * group;
    auto make = [&](int64_t h, int64_t l, int64_t d) {
      if (coin(0.3)) return mha::Tensor::copy_of(randn({b, l, h, d}, rng, mha::DType::bf16).view().transpose(1, 2));
      return randn({b, h, l, d}, rng, mha::DType::bf16);
    };
    const mha::Tensor q = make(hq, lq, dk), k = make(hkv, lk, dk), v = make(hkv, lk, dv);
    mha::SdpaOptions o{.enable_gqa = group > 1};
    o.is_causal = coin(0.5);
    o.causal_alignment = coin(0.7) ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
    if (coin(0.2)) o.window_left = pick(0, 300);
    if (coin(0.2)) o.scale = std::uniform_real_distribution<double>(0.05, 1.5)(rng);
    if (coin(0.15)) o.dropout_p = 0.3, o.dropout_seed = rng();
    if (coin(0.15)) o.softcap = 5.0;
    mha::Tensor mask;
    const int64_t mask_kind = pick(0, 3);
    if (mask_kind == 1) {
      mask = mha::Tensor::empty({lq, lk}, mha::DType::boolean);
      for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = coin(0.8);
    } else if (mask_kind == 2) {
      mask = randn({hq, lq, lk}, rng);
    } else if (mask_kind == 3) {  // left padding: whole blocks of keys excluded for every row
      mask = mha::Tensor::empty({b, 1, 1, lk});
      for (int64_t e = 0; e < b; ++e) {
        const int64_t padded = pick(0, lk - 1);
        for (int64_t j = 0; j < lk; ++j) mask.data<float>()[e * lk + j] = j < padded ? -INFINITY : 0.0f;
      }
    }
    if (mask.defined()) o.attn_mask = mask.view();
    SCOPED_TRACE("B=" + std::to_string(b) + " Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv) +
                 " Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk) + " dk=" + std::to_string(dk) +
                 " dv=" + std::to_string(dv) + " causal=" + std::to_string(o.is_causal) + " window=" +
                 std::to_string(o.window_left) + " mask=" + std::to_string(mask_kind) + " dropout=" +
                 std::to_string(o.dropout_p) + " softcap=" + std::to_string(o.softcap));
    ASSERT_TRUE(mha_test::pair_products_forward(mha::DType::bf16, lq, dk));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
    o.num_threads = 1;
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    EXPECT_LT(rel_error(saved.output, ref.output, mha_test::terms_magnitude(q, k, v, o)), 1e-2);
    o.num_threads = 3;
    EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, o), saved.output));
    differs_from_float32 += differs_from_float32_kernel(saved, q, k, v, o);
  }
  EXPECT_GT(differs_from_float32, kCases / 2);
}

TEST_F(PairProducts, ThreadCountsGiveIdenticalBits) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 300, 64}, rng, mha::DType::bf16), k = randn({2, 2, 257, 64}, rng, mha::DType::bf16),
                    v = randn({2, 2, 257, 40}, rng, mha::DType::bf16);
  mha::SdpaOptions o{.is_causal = true, .enable_gqa = true};
  o.num_threads = 1;
  const mha::Tensor one = mha::scaled_dot_product_attention(q, k, v, o);
  o.num_threads = 3;
  EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, o), one));
}

// The values as pairs of keys, copied three ways: per group by the thread that runs the whole
// group (4 groups on 2 threads; on 3, three of them), per chunk of groups for long heads in query
// tasks (4 groups on 5 threads, and the fourth on 3; 300 queries), in each task per key block for
// short ones (40 queries). All give the same values: the first 40 queries of a call of 300 (each
// of the first two ways, the chunks of one head or of all) are the bits of a call of those 40
// alone.
TEST_F(PairProducts, SharedValuePairsGiveTheBitsOfPerBlockCopies) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 2, 300, 32}, rng, mha::DType::bf16), k = randn({2, 2, 150, 32}, rng, mha::DType::bf16),
                    v = randn({2, 2, 150, 24}, rng, mha::DType::bf16);
  const mha::Tensor q40 = mha::Tensor::copy_of(q.view().slice(2, 0, 40), mha::DType::bf16);
  const mha::Tensor first = mha::scaled_dot_product_attention(q40, k, v, {.num_threads = 3});
  std::atomic<int64_t>& chunk = mha::detail::widened_chunk_floats();
  const int64_t saved = chunk.exchange(1);
  const mha::Tensor one_head_chunks = mha::scaled_dot_product_attention(q, k, v, {.num_threads = 3});
  chunk = saved;
  const mha::Tensor all_chunk = mha::scaled_dot_product_attention(q, k, v, {.num_threads = 5});
  const mha::Tensor whole_groups = mha::scaled_dot_product_attention(q, k, v, {.num_threads = 2});
  const mha::Tensor three_whole = mha::scaled_dot_product_attention(q, k, v, {.num_threads = 3});
  EXPECT_TRUE(same_bits(all_chunk, one_head_chunks));
  EXPECT_TRUE(same_bits(all_chunk, whole_groups));
  EXPECT_TRUE(same_bits(three_whole, whole_groups));
  EXPECT_TRUE(same_bits(mha::Tensor::copy_of(whole_groups.view().slice(2, 0, 40), mha::DType::bf16), first));
}

// Keys, values and queries read through [B, L, H, D] views (rows a head-row stride apart, as the
// module's projections lay them out): whole-group tasks copy such keys packed once per group, query
// tasks read them in place. Every schedule gives the bits of packed copies of the same tensors (4
// groups: whole groups on 1, 2 and 4 threads, three whole and one in query tasks on 3, query tasks
// alone on 5), short heads and long ones (values shared per chunk).
TEST_F(PairProducts, UnpackedRowsGiveTheBitsOfPackedCopies) {
  std::mt19937_64 rng(test_seed());
  for (const int64_t lq : {100, 300}) {
    const mha::Tensor qs = randn({2, lq, 4, 64}, rng, mha::DType::bf16), ks = randn({2, 130, 2, 64}, rng, mha::DType::bf16),
                      vs = randn({2, 130, 2, 40}, rng, mha::DType::bf16);
    const mha::TensorView q = qs.view().transpose(1, 2), k = ks.view().transpose(1, 2), v = vs.view().transpose(1, 2);
    const mha::Tensor qc = mha::Tensor::copy_of(q), kc = mha::Tensor::copy_of(k), vc = mha::Tensor::copy_of(v);
    mha::SdpaOptions o{.is_causal = true, .enable_gqa = true};
    const mha::Tensor packed = mha::scaled_dot_product_attention(qc, kc, vc, o);
    for (const int threads : {1, 2, 3, 4, 5}) {
      o.num_threads = threads;
      EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, o), packed)) << "Lq " << lq << " threads " << threads;
    }
  }
}

// Empty head dims on the pair path: no values (an empty output, the shared value copy of a long
// head empty too), and no dims of q and k (every score 0: each row the mean of its visible values).
TEST_F(PairProducts, EmptyHeadDims) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 300, 8}, rng, mha::DType::bf16), k = randn({1, 2, 40, 8}, rng, mha::DType::bf16);
  const mha::Tensor none = mha::Tensor::empty({1, 2, 40, 0}, mha::DType::bf16);
  EXPECT_EQ(mha::scaled_dot_product_attention(q, k, none, {}).sizes(), (mha::Shape{1, 2, 300, 0}));
  const mha::Tensor q0 = mha::Tensor::empty({1, 2, 300, 0}, mha::DType::bf16), k0 = mha::Tensor::empty({1, 2, 40, 0}, mha::DType::bf16);
  const mha::Tensor v = randn({1, 2, 40, 16}, rng, mha::DType::bf16);
  mha::SdpaOptions o{.is_causal = true};
  o.scale = 1.0;  // (the default 1/sqrt(0) is not finite)
  const mha::Tensor out = mha::scaled_dot_product_attention(q0, k0, v, o);
  EXPECT_LT(rel_error(out, mha::reference::scaled_dot_product_attention(q0, k0, v, o).output), 1e-2);
}

// Odd head dims of q and k (no whole pairs: 100 queries, and a decoding step in dot mode) and
// few-query calls that return their weights (dot mode, 32, 24 and 4 rows) take the float32 kernel
// on the widened inputs: its bits.
TEST_F(PairProducts, OddDimsFewRowsAndWeightsTakeTheFloat32Kernel) {
  std::mt19937_64 rng(test_seed());
  struct Shape {
    int64_t lq, dk, hq, hkv;
    bool weights;
  };
  for (const Shape& c : {Shape{100, 33, 2, 2, false}, Shape{1, 33, 8, 2, false}, Shape{32, 64, 2, 2, true},
                         Shape{6, 64, 8, 2, true}, Shape{1, 64, 8, 2, true}}) {
    SCOPED_TRACE("Lq " + std::to_string(c.lq) + " dk " + std::to_string(c.dk) + " Hq " + std::to_string(c.hq) +
                 " weights " + std::to_string(c.weights));
    EXPECT_FALSE(mha_test::pair_products_forward(mha::DType::bf16, c.lq, c.dk, c.weights));
    const mha::Tensor q = randn({1, c.hq, c.lq, c.dk}, rng, mha::DType::bf16),
                      k = randn({1, c.hkv, 1100, c.dk}, rng, mha::DType::bf16),
                      v = randn({1, c.hkv, 1100, 16}, rng, mha::DType::bf16);
    const mha::SdpaOptions o{.enable_gqa = c.hq != c.hkv};
    auto run = [&] {
      return c.weights ? mha::scaled_dot_product_attention_with_weights(q, k, v, o).output
                       : mha::scaled_dot_product_attention(q, k, v, o);
    };
    const mha::Tensor out = run();
    mha::detail::force_isa(mha::detail::Isa::avx512);
    const mha::Tensor out32 = run();
    mha::detail::force_isa(mha::detail::Isa::avx512_bf16);
    EXPECT_TRUE(same_bits(out, out32));
  }
}

}  // namespace

namespace {

struct BackwardCase {
  mha::Tensor q, k, v, grad, mask;
  mha::SdpaOptions options;
  std::string describe;
};

// Shapes the pair backward takes (even head dims, more than 16 query rows per key/value head), in
// its one-pass schedule (16 and more (batch, key/value head) groups: every third case) and its two
// passes (fewer): lengths around its 48-row panels, 64-row blocks and pairs of rows (odd ones leave
// a pair half empty), grouped heads, causality in both alignments, sliding windows, scales, masks
// (additive with -inf entries, bool, key padding), dropout, soft-capping.
BackwardCase draw_backward(std::mt19937_64& rng, bool one_pass) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  auto any = [&](const std::vector<int64_t>& values) { return values[pick(0, static_cast<int64_t>(values.size()) - 1)]; };
  const int64_t B = one_pass ? any({4, 8}) : any({1, 2, 3}), Hkv = one_pass ? 16 / B * pick(1, 2) : pick(1, 4);
  const int64_t Hq = Hkv * pick(1, 2);
  const int64_t Lq = any({17, 31, 47, 48, 49, 70, 97, 130}), Lk = coin(0.4) ? Lq : any({5, 33, 48, 71, 100});
  const int64_t Dk = any({2, 16, 24, 40, 64, 128}), Dv = coin(0.5) ? Dk : any({2, 8, 32, 48, 64});
  const mha::DType bf16 = mha::DType::bf16;
  BackwardCase c;
  c.q = randn({B, Hq, Lq, Dk}, rng, bf16), c.k = randn({B, Hkv, Lk, Dk}, rng, bf16);
  c.v = randn({B, Hkv, Lk, Dv}, rng, bf16), c.grad = randn({B, Hq, Lq, Dv}, rng, bf16);
  c.options.enable_gqa = Hq != Hkv;
  c.options.is_causal = coin(0.4);
  c.options.causal_alignment = coin(0.5) ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (coin(0.25)) c.options.window_left = pick(0, 40);
  if (coin(0.25)) c.options.scale = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  if (coin(0.15)) c.options.softcap = 4.0;
  const int64_t mask_kind = pick(0, 3);
  if (mask_kind == 1) {
    c.mask = randn({Hq, Lq, Lk}, rng);
    for (int64_t e = 0; e < c.mask.numel(); ++e)
      if (coin(0.05)) c.mask.data<float>()[e] = -INFINITY;
  } else if (mask_kind == 2) {
    c.mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
    for (int64_t e = 0; e < c.mask.numel(); ++e) c.mask.data<bool>()[e] = coin(0.8);
  } else if (mask_kind == 3) {
    c.mask = mha::Tensor::empty({B, 1, 1, Lk}, mha::DType::boolean);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t kept = pick(1, Lk);
      for (int64_t j = 0; j < Lk; ++j) c.mask.data<bool>()[b * Lk + j] = j < kept;
    }
  }
  if (mask_kind != 0) c.options.attn_mask = c.mask.view();
  if (coin(0.25)) c.options.dropout_p = 0.2, c.options.dropout_seed = rng();
  c.describe = "B=" + std::to_string(B) + " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) +
               " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " Dk=" + std::to_string(Dk) +
               " Dv=" + std::to_string(Dv) + " causal=" + std::to_string(c.options.is_causal) + " window=" +
               std::to_string(c.options.window_left) + " mask=" + std::to_string(mask_kind) + " dropout=" +
               std::to_string(c.options.dropout_p) + " softcap=" + std::to_string(c.options.softcap);
  return c;
}

// Against the float64 reference backward on the same bfloat16 inputs, each gradient within 2e-2
// of the largest of the three (5% of it where a gradient cancels to nearly zero): Pd, dS and dS^T
// enter the products rounded to bfloat16 (2^-9 relative each), each gradient is rounded once to
// bfloat16 (2^-9); where the float32 path on the same inputs is itself further off (rows that see
// one or two keys, whose dS cancels to the rounding of the saved output that D reads), within twice
// its error; and within 2e-2 of that path's gradients. Not that path's bits (the kernel ran), the
// same bits on 1 and 3 threads and when one gradient alone is wanted.
TEST_F(PairProducts, BackwardAgainstFloat64ReferenceAndDeterministic) {
  std::mt19937_64 rng(test_seed());
  double worst = 0, worst32 = 0;
  int differs_from_float32 = 0;
  constexpr int kCases = 18;
  for (int n = 0; n < kCases; ++n) {
    const BackwardCase c = draw_backward(rng, n % 3 == 0);
    SCOPED_TRACE(c.describe);
    ASSERT_TRUE(mha_test::pair_products_backward(mha::DType::bf16, c.q.size(1), c.k.size(1), c.q.size(2), c.q.size(3),
                                                 c.v.size(3)));
    differs_from_float32 += mha_test::check_bf16_products_backward(c.q, c.k, c.v, c.grad, c.options, worst, worst32);
  }
  std::printf("largest relative error against float64: %.3g (the float32 path's on the same cases: %.3g)\n", worst, worst32);
  EXPECT_GT(differs_from_float32, kCases / 2);
}

}  // namespace
