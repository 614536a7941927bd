// Variable-length (packed) attention: every sequence's output, log-sum-exp and gradients are
// those of scaled_dot_product_attention on that sequence alone, bit for bit, on every ISA and
// thread count, and within the stated tolerances of the float64 reference; bad offsets and
// shapes are clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/sequence_schedule.hpp"
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

// Rows [begin, end) of a packed [T, H, D] tensor as the [H, L, D] view one SDPA call takes.
mha::TensorView rows(const mha::TensorView& packed, int64_t begin, int64_t end) {
  return packed.slice(0, begin, end).transpose(0, 1);
}

mha::Tensor contiguous(const mha::TensorView& t) { return mha::Tensor::copy_of(t, t.dtype); }

struct VarlenCase {
  std::vector<int64_t> cu_q{0}, cu_k{0};
  mha::Tensor q_storage, kv_storage, grad;
  mha::TensorView q, k, v;  // packed [T, H, D] views, k and v slices of one [Tk, 2, Hkv, D] buffer
  mha::SdpaOptions options;
  std::string describe;
};

// Sequence lengths from 0 (a sequence without queries, or without keys) to past the kernels' tiles,
// GQA, Dk != Dv, both causal alignments, dropout, and one of float32, bfloat16, float16, float64.
VarlenCase draw_case(std::mt19937_64& rng, mha::DType dtype, int sequences) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  VarlenCase c;
  const bool self = pick(0, 1) == 1;  // self-attention: each sequence's keys are its queries' length
  for (int s = 0; s < sequences; ++s) {
    const int64_t lq = pick(0, 9) == 0 ? 0 : pick(1, pick(0, 3) == 0 ? 150 : 40);
    const int64_t lk = self ? lq : (pick(0, 9) == 0 ? 0 : pick(1, 120));
    c.cu_q.push_back(c.cu_q.back() + lq);
    c.cu_k.push_back(c.cu_k.back() + lk);
  }
  const int64_t hkv = pick(1, 3), hq = hkv * (pick(0, 1) == 1 ? 1 : pick(2, 3));
  const int64_t dk = std::vector<int64_t>{8, 16, 32, 40, 64}[pick(0, 4)];
  const int64_t dv = pick(0, 2) == 0 ? std::vector<int64_t>{4, 24, 64}[pick(0, 2)] : dk;
  const int64_t tq = c.cu_q.back(), tk = c.cu_k.back();
  c.q_storage = randn({tq, hq, dk + 3}, rng, dtype);  // rows padded by 3: strides that are not packed
  c.q = c.q_storage.view().slice(2, 0, dk);
  c.kv_storage = randn({tk, 2, hkv, std::max(dk, dv)}, rng, dtype);
  c.k = c.kv_storage.view().select(1, 0).slice(2, 0, dk);
  c.v = c.kv_storage.view().select(1, 1).slice(2, 0, dv);
  c.grad = randn({tq, hq, dv}, rng, dtype);
  c.options.is_causal = pick(0, 1) == 1;
  c.options.causal_alignment = pick(0, 1) == 1 ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
  c.options.enable_gqa = hq != hkv;
  if (pick(0, 3) == 0) c.options.scale = 0.05 + 0.3 * static_cast<double>(pick(0, 10)) / 10;
  if (pick(0, 3) == 0) c.options.dropout_p = 0.25, c.options.dropout_seed = static_cast<uint64_t>(pick(0, 1 << 30));
  c.options.num_threads = static_cast<int>(pick(1, 2));
  c.describe = "sequences " + std::to_string(sequences) + " Tq " + std::to_string(tq) + " Tk " + std::to_string(tk) +
               " Hq " + std::to_string(hq) + " Hkv " + std::to_string(hkv) + " Dk " + std::to_string(dk) + " Dv " +
               std::to_string(dv) + " causal " + std::to_string(c.options.is_causal) + " bottom-right " +
               std::to_string(c.options.causal_alignment == mha::CausalAlignment::BottomRight) + " dropout " +
               std::to_string(c.options.dropout_p) + " threads " + std::to_string(c.options.num_threads) + " dtype " +
               std::to_string(static_cast<int>(dtype));
  return c;
}

mha::SdpaOptions options_of_sequence(const VarlenCase& c, int64_t s) {
  mha::SdpaOptions o = c.options;
  o.dropout_seed = mha::varlen_dropout_seed(c.options.dropout_seed, s);
  return o;
}

TEST(Varlen, EachSequenceIsItsOwnSdpaCallBitForBit) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    for (int n = 0; n < 24; ++n) {
      const mha::DType dtype = std::vector<mha::DType>{mha::DType::f32, mha::DType::bf16, mha::DType::f16,
                                                       mha::DType::f64}[n % 4];
      const VarlenCase c = draw_case(rng, dtype, 1 + n % 7);
      SCOPED_TRACE(std::string(mha::detail::isa_name(isa)) + " " + c.describe);
      const mha::Tensor out = mha::scaled_dot_product_attention_varlen(c.q, c.k, c.v, c.cu_q, c.cu_k, c.options);
      const auto saved = mha::scaled_dot_product_attention_varlen_for_training(c.q, c.k, c.v, c.cu_q, c.cu_k, c.options);
      const auto g = mha::scaled_dot_product_attention_varlen_backward(c.q, c.k, c.v, c.cu_q, c.cu_k, saved, c.grad,
                                                                      c.options);
      ASSERT_EQ(out.sizes(), mha::Shape({c.q.size(0), c.q.size(1), c.v.size(2)}));
      ASSERT_EQ(saved.lse.sizes(), mha::Shape({c.q.size(1), c.q.size(0)}));
      EXPECT_TRUE(same_bits(out, saved.output));
      for (size_t s = 0; s + 1 < c.cu_q.size(); ++s) {
        SCOPED_TRACE("sequence " + std::to_string(s));
        const int64_t q0 = c.cu_q[s], q1 = c.cu_q[s + 1], k0 = c.cu_k[s], k1 = c.cu_k[s + 1];
        const mha::TensorView qs = rows(c.q, q0, q1), ks = rows(c.k, k0, k1), vs = rows(c.v, k0, k1);
        const auto alone = mha::scaled_dot_product_attention_for_training(qs, ks, vs, options_of_sequence(c, s));
        EXPECT_TRUE(same_bits(contiguous(rows(out, q0, q1)), alone.output));
        EXPECT_TRUE(same_bits(contiguous(saved.lse.view().slice(1, q0, q1)), alone.lse));
        const auto ga = mha::scaled_dot_product_attention_backward(qs, ks, vs, alone, rows(c.grad, q0, q1),
                                                                   options_of_sequence(c, s));
        EXPECT_TRUE(same_bits(contiguous(rows(g.query, q0, q1)), ga.query));
        EXPECT_TRUE(same_bits(contiguous(rows(g.key, k0, k1)), ga.key));
        EXPECT_TRUE(same_bits(contiguous(rows(g.value, k0, k1)), ga.value));
      }
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Against the float64 reference, sequence by sequence: float32 within 1e-5 of the largest output
// (2e-5 where scores are large; SDPA's own forward tests hold the kernels to the same), gradients
// within 1e-4 (longer float32 chains), judged against 5% of the sequence's largest gradient where
// an exact zero is what remains of cancelling sums; float64 within 1e-12.
TEST(Varlen, MatchesFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 16; ++n) {
    const mha::DType dtype = n % 4 == 3 ? mha::DType::f64 : mha::DType::f32;
    const double out_tol = dtype == mha::DType::f64 ? 1e-12 : 2e-5, grad_tol = dtype == mha::DType::f64 ? 1e-11 : 1e-4;
    const VarlenCase c = draw_case(rng, dtype, 1 + n % 5);
    SCOPED_TRACE(c.describe);
    const auto saved = mha::scaled_dot_product_attention_varlen_for_training(c.q, c.k, c.v, c.cu_q, c.cu_k, c.options);
    const auto g = mha::scaled_dot_product_attention_varlen_backward(c.q, c.k, c.v, c.cu_q, c.cu_k, saved, c.grad,
                                                                    c.options);
    for (size_t s = 0; s + 1 < c.cu_q.size(); ++s) {
      SCOPED_TRACE("sequence " + std::to_string(s));
      const int64_t q0 = c.cu_q[s], q1 = c.cu_q[s + 1], k0 = c.cu_k[s], k1 = c.cu_k[s + 1];
      const mha::TensorView qs = rows(c.q, q0, q1), ks = rows(c.k, k0, k1), vs = rows(c.v, k0, k1);
      const auto ref = mha::reference::scaled_dot_product_attention(qs, ks, vs, options_of_sequence(c, s));
      EXPECT_LT(rel_error(rows(saved.output, q0, q1), ref.output), out_tol);
      const auto r = mha::reference::scaled_dot_product_attention_backward(qs, ks, vs, rows(c.grad, q0, q1),
                                                                          options_of_sequence(c, s));
      const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
      EXPECT_LT(rel_error(rows(g.query, q0, q1), r.query, floor), grad_tol);
      EXPECT_LT(rel_error(rows(g.key, k0, k1), r.key, floor), grad_tol);
      EXPECT_LT(rel_error(rows(g.value, k0, k1), r.value, floor), grad_tol);
    }
  }
}

// Many short sequences (one per thread) next to a long one (on every thread): the same bits on
// one thread and two, and only the gradients asked for are computed.
TEST(Varlen, ThreadCountsAndWantedGradientsGiveTheSameBits) {
  std::mt19937_64 rng(test_seed());
  std::vector<int64_t> cu{0};
  for (int s = 0; s < 40; ++s) cu.push_back(cu.back() + 1 + static_cast<int64_t>(rng() % 24));
  cu.push_back(cu.back() + 700);
  const int64_t t = cu.back(), h = 4, d = 32;
  const mha::Tensor q = randn({t, h, d}, rng), k = randn({t, h, d}, rng), v = randn({t, h, d}, rng);
  const mha::Tensor grad = randn({t, h, d}, rng);
  mha::SdpaOptions one{.is_causal = true, .num_threads = 1}, two{.is_causal = true, .num_threads = 2};
  const auto a = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu, cu, one);
  const auto b = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu, cu, two);
  EXPECT_TRUE(same_bits(a.output, b.output));
  EXPECT_TRUE(same_bits(a.lse, b.lse));
  const auto ga = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu, cu, a, grad, one);
  const auto gb = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu, cu, b, grad, two);
  EXPECT_TRUE(same_bits(ga.query, gb.query));
  EXPECT_TRUE(same_bits(ga.key, gb.key));
  EXPECT_TRUE(same_bits(ga.value, gb.value));
  const auto only_kv = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu, cu, a, grad, two,
                                                                         {.query = false});
  EXPECT_FALSE(only_kv.query.defined());
  EXPECT_TRUE(same_bits(only_kv.key, ga.key));
  EXPECT_TRUE(same_bits(only_kv.value, ga.value));
}

// A sequence with queries and no keys gives zeros and +inf log-sum-exp (SDPA's convention for a
// row with no visible key), and keys no query reads get zero gradients.
TEST(Varlen, EmptySequences) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int64_t> cu_q{0, 3, 3, 8}, cu_k{0, 0, 4, 9};  // no keys; no queries; both
  const mha::Tensor q = randn({8, 2, 16}, rng), k = randn({9, 2, 16}, rng), v = randn({9, 2, 16}, rng);
  const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu_q, cu_k);
  EXPECT_EQ(max_abs(saved.output.view().slice(0, 0, 3)), 0.0);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(saved.lse.view().at({h, i}), INFINITY);
    for (int64_t i = 3; i < 8; ++i) EXPECT_TRUE(std::isfinite(saved.lse.view().at({h, i})));
  }
  const auto g = mha::scaled_dot_product_attention_varlen_backward(q, k, v, cu_q, cu_k, saved, randn({8, 2, 16}, rng));
  EXPECT_EQ(max_abs(g.query.view().slice(0, 0, 3)), 0.0);
  EXPECT_EQ(max_abs(g.key.view().slice(0, 0, 4)), 0.0);
  EXPECT_EQ(max_abs(g.value.view().slice(0, 0, 4)), 0.0);
  EXPECT_GT(max_abs(g.key.view().slice(0, 4, 9)), 0.0);
  const mha::Tensor none = mha::scaled_dot_product_attention_varlen(q.view().slice(0, 0, 0), k.view().slice(0, 0, 0),
                                                                     v.view().slice(0, 0, 0), std::vector<int64_t>{0},
                                                                     std::vector<int64_t>{0});
  EXPECT_EQ(none.sizes(), mha::Shape({0, 2, 16}));
}

TEST(Varlen, BadArgumentsAreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({10, 4, 16}, rng), k = randn({12, 2, 16}, rng), v = randn({12, 2, 8}, rng);
  const std::vector<int64_t> cq{0, 4, 10}, ck{0, 5, 12};
  auto call = [&](const mha::TensorView& q_, const mha::TensorView& k_, const mha::TensorView& v_,
                  std::vector<int64_t> a, std::vector<int64_t> b, mha::SdpaOptions o = {.enable_gqa = true}) {
    return [=] { (void)mha::scaled_dot_product_attention_varlen(q_, k_, v_, a, b, o); };
  };
  expect_error(call(q.view().unsqueeze(0), k, v, cq, ck), "query: expected a packed [Tq, Hq, Dk] tensor (rank 3)");
  expect_error(call(q, k, v.view().slice(0, 0, 11), cq, ck), "key/value: expected the same rows and heads");
  expect_error(call(q, k, v, {1, 4, 10}, ck), "cu_seqlens_q: expected the first offset to be 0, got 1");
  expect_error(call(q, k, v, {0, 6, 4, 10}, {0, 5, 6, 12}), "cu_seqlens_q: expected non-decreasing offsets");
  expect_error(call(q, k, v, cq, {0, 5, 11}), "cu_seqlens_k: expected the last offset to be the number of key/value "
                                              "rows, 12, got 11");
  expect_error(call(q, k, v, cq, {}), "cu_seqlens_k: expected one offset per sequence plus one");
  expect_error(call(q, k, v, cq, {0, 12}), "cu_seqlens_q/cu_seqlens_k: expected one offset per sequence plus one in "
                                           "each, got 3 and 2");
  expect_error(call(q, k, v, cq, ck, {}), "enable_gqa");
  const mha::Tensor mask = mha::Tensor::zeros({10, 12}, mha::DType::boolean);
  expect_error(call(q, k, v, cq, ck, {.attn_mask = mask.view(), .enable_gqa = true}),
               "attn_mask: not taken by the variable-length functions");
  expect_error(call(q, randn({12, 2, 16}, rng, mha::DType::bf16), v, cq, ck), "dtype");
  const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cq, ck, {.enable_gqa = true});
  expect_error([&] {
    (void)mha::scaled_dot_product_attention_varlen_backward(q, k, v, cq, ck, saved, randn({10, 4, 16}, rng),
                                                            {.enable_gqa = true});
  }, "grad_output");
  mha::AttentionForTraining wrong_lse{saved.output.clone(), mha::Tensor::zeros({10, 4})};
  expect_error([&] {
    (void)mha::scaled_dot_product_attention_varlen_backward(q, k, v, cq, ck, wrong_lse, randn({10, 4, 8}, rng),
                                                            {.enable_gqa = true});
  }, "saved.lse");
}

}  // namespace

// How a call of several sequences spreads them over the threads (for_each_sequence): whole on one
// thread each where that keeps the threads within an eighth of even (equal decoding steps of a
// batch: no thread waits on another inside a sequence), else the longest on every thread first.
// Every sequence with work runs exactly once; sequences without work do not run.
TEST(SequenceSchedule, WholeSequencesPerThreadWhereTheyBalance) {
  auto schedule = [](const std::vector<double>& cost, int threads) {
    std::mutex m;
    std::map<int64_t, int> runs;  // sequence -> the threads it ran on (a count of calls: -1 past one)
    mha::detail::for_each_sequence(cost, threads, [&](int64_t s, int call_threads) {
      std::lock_guard<std::mutex> lock(m);
      runs[s] = runs.count(s) ? -1 : call_threads;
    });
    return runs;
  };
  using Runs = std::map<int64_t, int>;
  EXPECT_EQ(schedule(std::vector<double>(8, 1.0), 2), (Runs{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1}}));
  EXPECT_EQ(schedule({1.0, 1.0}, 2), (Runs{{0, 1}, {1, 1}}));
  EXPECT_EQ(schedule({5.0}, 2), (Runs{{0, 2}}));
  EXPECT_EQ(schedule({5.0}, 1), (Runs{{0, 1}}));
  // three equal on two threads: one on both, then two whole; a long one and short ones: the long one on both
  EXPECT_EQ(schedule({1.0, 1.0, 1.0}, 2), (Runs{{0, 2}, {1, 1}, {2, 1}}));
  EXPECT_EQ(schedule({0.5, 8.0, 0.5, 0.0, 1.0}, 2), (Runs{{0, 1}, {1, 2}, {2, 1}, {4, 1}}));
  // uneven but balanced by whole sequences (4 + 1 against 3 + 2): each on one thread
  EXPECT_EQ(schedule({4.0, 3.0, 2.0, 1.0}, 2), (Runs{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));
}

