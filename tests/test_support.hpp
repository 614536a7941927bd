// Shared by the C++ tests: seeds, random tensors, and the error measure they judge by.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include <string>

#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "mha/reference.hpp"

namespace mha_test {

// A fresh seed each run, or MHA_TEST_SEED's to replay one. Printed, so a failure can be replayed.
inline uint64_t test_seed() {
  uint64_t seed;
  if (const char* s = std::getenv("MHA_TEST_SEED")) {
    seed = std::strtoull(s, nullptr, 10);
  } else {
    seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  std::printf("seed %llu (MHA_TEST_SEED=%llu replays it)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  return seed;
}

// Whether the suite runs under a user-mode emulator (make test-aarch64 sets MHA_TEST_EMULATOR):
// qemu-user aborts a forked child of a process that runs threads, so the fork tests skip there.
inline bool under_user_mode_emulator() {
  const char* e = std::getenv("MHA_TEST_EMULATOR");
  return e != nullptr && *e != '\0';
}

// Standard normal values (never all zeros or ones), drawn in float64 and rounded to `dtype`.
inline mha::Tensor randn(const mha::Shape& shape, std::mt19937_64& rng, mha::DType dtype = mha::DType::f32) {
  mha::Tensor t = mha::Tensor::empty(shape, mha::DType::f64);
  std::normal_distribution<double> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = normal(rng);
  return dtype == mha::DType::f64 ? t : mha::Tensor::copy_of(t, dtype);
}

// Runs `f`, expecting an mha::Error whose message contains `needle`.
template <class F>
inline void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected mha::Error mentioning '" << needle << "'";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

inline double max_abs(const mha::TensorView& t) {
  const mha::Tensor d = mha::Tensor::copy_of(t, mha::DType::f64);
  double m = 0;
  for (int64_t i = 0; i < d.numel(); ++i) m = std::max(m, std::abs(d.data<double>()[i]));
  return m;
}

// |t| elementwise, in t's dtype: a reference on |dO| or |V| gives the sums whose cancellation a
// tolerance must not be judged against.
inline mha::Tensor abs_of(const mha::TensorView& t) {
  mha::Tensor a = mha::Tensor::copy_of(t, mha::DType::f64);
  for (int64_t i = 0; i < a.numel(); ++i) a.data<double>()[i] = std::abs(a.data<double>()[i]);
  return mha::Tensor::copy_of(a, t.dtype);
}

// The size of an attention output's terms p_j v_j without their cancellation: a quarter of the
// largest output of the reference with |V| for V. A bfloat16 or float16 output carries rounding
// relative to each term (P rounded to bfloat16 for P V: at most 2^-8 of sum_j p_j |v_j|; the
// output rounded once), so it is judged against the larger of this and its largest element:
// outputs whose few terms cancel (a head dim of 1, a handful of keys left by dropout) can all be
// small by chance (seed 7009772076767668900 of PairProducts: largest output 0.049 against terms
// of 0.98, off by 5.1e-4).
inline double terms_magnitude(const mha::TensorView& q, const mha::TensorView& k, const mha::TensorView& v,
                              const mha::SdpaOptions& options) {
  return 0.25 * max_abs(mha::reference::scaled_dot_product_attention(q, k, abs_of(v), options).output);
}

// Normwise relative error max|a - r| / max(max|r|, floor); infinite where one side is NaN and
// the other is not, and where the shapes differ.
inline double rel_error(const mha::TensorView& a, const mha::TensorView& r, double floor = 0.0) {
  if (a.sizes() != r.sizes()) return INFINITY;
  const mha::Tensor a64 = mha::Tensor::copy_of(a, mha::DType::f64), r64 = mha::Tensor::copy_of(r, mha::DType::f64);
  double d = 0, m = 0;
  for (int64_t i = 0; i < a64.numel(); ++i) {
    const double x = a64.data<double>()[i], y = r64.data<double>()[i];
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    if (std::isnan(x)) continue;
    d = std::max(d, std::abs(x - y));
    m = std::max(m, std::abs(y));
  }
  return d == 0 ? 0.0 : d / std::max({m, floor, 1e-300});
}

inline bool same_bits(const mha::TensorView& a, const mha::TensorView& b) {
  if (a.sizes() != b.sizes() || a.dtype != b.dtype || !a.is_contiguous() || !b.is_contiguous()) return false;
  const size_t bytes = static_cast<size_t>(a.numel() * mha::dtype_size(a.dtype));
  return bytes == 0 || std::memcmp(a.data, b.data, bytes) == 0;  // (an empty tensor's data may be null)
}

// The same bits, but for the sign of a zero (the gradient of a key no query sees is +0 in one
// schedule and may be -0 in another); float64 within 1e-13 of the largest value or of 1, whichever
// is larger (its kernel hands BLAS blocks whose extent may differ between two ways of writing one
// call: a few units of float64 rounding in sums of up to a few hundred O(1) terms).
inline ::testing::AssertionResult agree(const mha::TensorView& a, const mha::TensorView& b) {
  const bool same = a.dtype == mha::DType::f64 ? rel_error(a, b, 1.0) < 1e-13 : same_bits(a, b) || rel_error(a, b) == 0;
  if (same) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "relative difference " << rel_error(a, b);
}

// Whether a bfloat16 forward of these lengths and head dims runs with AVX512-BF16's bfloat16 pair
// products on the ISA in use (attention.cpp's rule): its output is within bfloat16 rounding of the
// float32 path's rather than its bits, and its log-sum-exp within a few units of float32 rounding.
// Up to 32 queries per head (the decoding kernel) every row count takes them (its dot mode's scores
// up to 32 query rows per key/value head, its panel schedule past them), but not where weights
// are returned: those come from the float32 dot mode.
inline bool pair_products_forward(mha::DType dtype, int64_t lq, int64_t dk, bool weights = false) {
  if (mha::detail::active_isa() != mha::detail::Isa::avx512_bf16 || dtype != mha::DType::bf16 || dk % 2 != 0) return false;
  if (mha::detail::bf16_pairs_take_shape(lq, dk)) return true;
  return lq <= mha::detail::kFewQueriesPerHead && !weights;
}

// Whether a bfloat16 forward (without weights) of this shape takes bfloat16 products on the ISA
// in use: AVX512-BF16's pairs, or the tile unit's (amx_bf16_takes_shape: head dims from 16, more
// than a few queries). Either rounds P to bfloat16 for P V: the output within bfloat16 rounding
// of the float32 path's, not its bits.
inline bool bf16_products_forward(mha::DType dtype, int64_t lq, int64_t lk, int64_t dk, int64_t dv) {
  if (pair_products_forward(dtype, lq, dk)) return true;
  return mha::detail::active_isa() == mha::detail::Isa::amx && dtype == mha::DType::bf16 &&
         mha::detail::amx_bf16_takes_shape(lq, lk, dk, dv);
}

// Whether a bfloat16 backward of this shape runs with AVX512-BF16's pair products on the ISA in
// use (bf16_pairs_backward_takes: even head dims, more query rows per key/value head than the
// decoding backward takes, no mask gradient): within bfloat16 rounding of the float32 path's
// gradients, not their bits.
inline bool pair_products_backward(mha::DType dtype, int64_t heads_q, int64_t heads_kv, int64_t lq, int64_t dk,
                                   int64_t dv, bool mask_grad = false) {
  return mha::detail::active_isa() == mha::detail::Isa::avx512_bf16 && dtype == mha::DType::bf16 && !mask_grad &&
         dk % 2 == 0 && dv % 2 == 0 && heads_q / heads_kv * lq > mha::detail::kFewQueryRowsBackward;
}

// Whether a bfloat16 backward of these lengths and head dims may run in bfloat16 products on the
// ISA in use: on the tile unit (cpu/amx.hpp's rule; never when the mask's gradient is asked for),
// or in AVX512-BF16's pairs (even head dims; decoding shapes, which depend on the heads too, keep
// the float32 path, whose bits are also within this bound). Either rounds P and dS to bfloat16
// for its products, so its gradients are within bfloat16 rounding of the float32 path's rather
// than its bits (AmxBackward.* and PairProducts.* judge them against float64).
inline bool tile_unit_backward(mha::DType dtype, int64_t lq, int64_t lk, int64_t dk, int64_t dv, bool mask_grad = false) {
  const mha::detail::Isa isa = mha::detail::active_isa();
  if (dtype != mha::DType::bf16 || mask_grad) return false;
  if (isa == mha::detail::Isa::avx512_bf16) return dk % 2 == 0 && dv % 2 == 0;
  return isa == mha::detail::Isa::amx && mha::detail::amx_bf16_takes_shape(lq, lk, dk, dv);
}

// Gradients of the tile unit within 2e-2 of the float32 path's, relative to the largest of the
// three or 5% of it where one cancels (AmxBackward's bound).
inline void expect_near_float32_path(const mha::AttentionGradients& g, const mha::AttentionGradients& g32) {
  const double floor = 0.05 * std::max({max_abs(g32.query), max_abs(g32.key), max_abs(g32.value)});
  EXPECT_LT(rel_error(g.query, g32.query, floor), 2e-2);
  EXPECT_LT(rel_error(g.key, g32.key, floor), 2e-2);
  EXPECT_LT(rel_error(g.value, g32.value, floor), 2e-2);
}

// One case of a backward in bfloat16 products (the tile unit's, AVX512-BF16's pairs) on the ISA in
// use, against the float64 reference on the same bfloat16 inputs: each gradient within 2e-2 of
// the largest of the three (5% of it where one cancels), or within twice the float32 path's
// error where that path is itself further off; within 2e-2 of the float32 path's (AVX-512)
// gradients; the same bits on 1 and 3 threads and for each gradient alone. worst and worst32
// gather the largest errors of the two paths; returns whether the gradients differ from the
// float32 path's bits (the kernel ran).
inline bool check_bf16_products_backward(const mha::TensorView& q, const mha::TensorView& k, const mha::TensorView& v,
                                         const mha::TensorView& grad, const mha::SdpaOptions& options, double& worst,
                                         double& worst32) {
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, options);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, options);
  const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, options);
  const double floor = 0.05 * std::max({max_abs(r.query), max_abs(r.key), max_abs(r.value)});
  const mha::detail::Isa isa = mha::detail::active_isa();
  mha::detail::force_isa(mha::detail::Isa::avx512);
  const auto g32 = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, options);
  mha::detail::force_isa(isa);
  const mha::TensorView ours[] = {g.query, g.key, g.value}, theirs[] = {g32.query, g32.key, g32.value},
                        exact[] = {r.query, r.key, r.value};
  for (int t = 0; t < 3; ++t) {
    const double e = rel_error(ours[t], exact[t], floor), e32 = rel_error(theirs[t], exact[t], floor);
    EXPECT_LT(e, std::max(2e-2, 2 * e32)) << "gradient " << t << "; the float32 path's error " << e32;
    EXPECT_LT(rel_error(ours[t], theirs[t], floor), 2e-2) << "gradient " << t;
    worst = std::max(worst, e), worst32 = std::max(worst32, e32);
  }
  for (int threads : {1, 3}) {
    mha::SdpaOptions o = options;
    o.num_threads = threads;
    const auto gt = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
    EXPECT_TRUE(same_bits(gt.query, g.query) && same_bits(gt.key, g.key) && same_bits(gt.value, g.value))
        << threads << " threads";
  }
  const mha::SdpaGradientsWanted subsets[] = {{.query = true, .key = false, .value = false},
                                              {.query = false, .key = true, .value = false},
                                              {.query = false, .key = false, .value = true}};
  for (const auto& wanted : subsets) {
    const auto gs = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, options, wanted);
    if (wanted.query) EXPECT_TRUE(same_bits(gs.query, g.query));
    if (wanted.key) EXPECT_TRUE(same_bits(gs.key, g.key));
    if (wanted.value) EXPECT_TRUE(same_bits(gs.value, g.value));
  }
  return !same_bits(g.query, g32.query) || !same_bits(g.key, g32.key) || !same_bits(g.value, g32.value);
}

// Keys [0, len) of a paged cache [pages, Hkv, page_size, D] (any strides) whose pages `pages`
// lists in order, gathered into [1, Hkv, len, D]: what a paged call over them must equal.
inline mha::Tensor gathered_pages(const mha::TensorView& cache, const int32_t* pages, int64_t len) {
  const int64_t page_size = cache.shape[2];
  mha::Tensor rows = mha::Tensor::empty({1, cache.shape[1], len, cache.shape[3]}, cache.dtype);
  for (int64_t j = 0; j < len; ++j)
    copy_into(cache.select(0, pages[j / page_size]).select(1, j % page_size), rows.view().select(0, 0).select(1, j));
  return rows;
}

// Two ways of writing one SDPA call (options `a` and `b`) agree on every public function: the
// output, the weights (bfloat16 and float32, float64), the training forward's output and
// log-sum-exp, and the gradients of q, k and v for `grad`.
inline void expect_same_calls(const mha::TensorView& q, const mha::TensorView& k, const mha::TensorView& v,
                              const mha::TensorView& grad, const mha::SdpaOptions& a, const mha::SdpaOptions& b) {
  EXPECT_TRUE(agree(mha::scaled_dot_product_attention(q, k, v, a), mha::scaled_dot_product_attention(q, k, v, b)));
  if (q.dtype != mha::DType::f16) {
    const auto wa = mha::scaled_dot_product_attention_with_weights(q, k, v, a);
    const auto wb = mha::scaled_dot_product_attention_with_weights(q, k, v, b);
    EXPECT_TRUE(agree(wa.output, wb.output));
    EXPECT_TRUE(agree(wa.weights, wb.weights));
  }
  const auto saved_a = mha::scaled_dot_product_attention_for_training(q, k, v, a);
  const auto saved_b = mha::scaled_dot_product_attention_for_training(q, k, v, b);
  EXPECT_TRUE(agree(saved_a.output, saved_b.output));
  EXPECT_TRUE(agree(saved_a.lse, saved_b.lse));
  const auto ga = mha::scaled_dot_product_attention_backward(q, k, v, saved_a, grad, a);
  const auto gb = mha::scaled_dot_product_attention_backward(q, k, v, saved_b, grad, b);
  EXPECT_TRUE(agree(ga.query, gb.query));
  EXPECT_TRUE(agree(ga.key, gb.key));
  EXPECT_TRUE(agree(ga.value, gb.value));
}

}  // namespace mha_test
