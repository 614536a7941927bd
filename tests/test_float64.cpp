// float64 SDPA (cpu/attention_f64.hpp): forward, weights, training forward and backward against the
// float64 reference, on random shapes with every option. Both compute in float64, in different
// orders (BLAS products and a log-sum-exp against plain sums), so they agree to a few hundred
// units of 2^-53 of the largest value: 1e-12 relative.
#include <random>

#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;

constexpr double kTol = 1e-12;

}  // namespace

TEST(Float64, MatchesReferenceForwardAndBackward) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::DType f64 = mha::DType::f64;
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t B = 1 + static_cast<int64_t>(rng() % 2), Hkv = 1 + static_cast<int64_t>(rng() % 2);
    const int64_t Hq = Hkv * (1 + static_cast<int64_t>(rng() % 2));
    const int64_t L = 1 + static_cast<int64_t>(rng() % 70), S = 1 + static_cast<int64_t>(rng() % 70);
    const int64_t D = 1 + static_cast<int64_t>(rng() % 40), Dv = 1 + static_cast<int64_t>(rng() % 40);
    // Inputs in [B, H, L, D] storage, or [B, L, H, D] (rows a wider stride apart, which BLAS reads
    // in place), or [B, H, D, L] (elements of a row apart, which it cannot: copied).
    const int layout = trial % 3;
    auto input = [&](int64_t h, int64_t l, int64_t d, mha::Tensor& owner) -> mha::TensorView {
      if (layout == 1) return (owner = randn({B, l, h, d}, rng, f64)).view().transpose(1, 2);
      if (layout == 2) return (owner = randn({B, h, d, l}, rng, f64)).view().transpose(2, 3);
      return (owner = randn({B, h, l, d}, rng, f64)).view();
    };
    mha::Tensor qs, ks, vs;
    const mha::TensorView q = input(Hq, L, D, qs), k = input(Hkv, S, D, ks), v = input(Hkv, S, Dv, vs);
    mha::SdpaOptions o{.enable_gqa = Hq != Hkv};
    o.is_causal = trial % 3 == 1;
    if (trial % 6 == 4) o.is_causal = true, o.causal_alignment = mha::CausalAlignment::BottomRight;
    if (trial % 5 == 2) o.dropout_p = 0.3, o.dropout_seed = rng();
    if (trial % 7 == 3) o.scale = 0.37;
    mha::Tensor mask;
    const int kind = static_cast<int>(rng() % 3);
    if (kind == 1) {  // float64, additive, some keys at -inf, broadcast over the batch
      mask = randn({Hq, L, S}, rng, f64);
      for (int64_t e = 0; e < mask.numel(); ++e)
        if (rng() % 5 == 0) mask.data<double>()[e] = -INFINITY;
      o.attn_mask = mask.view();
    } else if (kind == 2) {  // bool key padding, true = attend
      mask = mha::Tensor::empty({B, 1, 1, S}, mha::DType::boolean);
      for (int64_t e = 0; e < mask.numel(); ++e) mask.data<uint8_t>()[e] = rng() % 4 != 0;
      o.attn_mask = mask.view();
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": B=" + std::to_string(B) + " Hq=" + std::to_string(Hq) +
                 " Hkv=" + std::to_string(Hkv) + " L=" + std::to_string(L) + " S=" + std::to_string(S) +
                 " D=" + std::to_string(D) + " Dv=" + std::to_string(Dv) + " mask=" + std::to_string(kind) +
                 " layout=" + std::to_string(layout) +
                 (o.is_causal ? " causal" : "") + (o.dropout_p > 0 ? " dropout" : ""));

    const mha::reference::Result r = mha::reference::scaled_dot_product_attention(q, k, v, o);
    const mha::AttentionWithWeights w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    ASSERT_EQ(w.output.dtype(), f64);
    ASSERT_EQ(w.weights.dtype(), f64);
    EXPECT_LT(rel_error(w.output, r.output), kTol);
    EXPECT_LT(rel_error(w.weights, r.weights), kTol);
    EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, o), w.output));

    const mha::AttentionForTraining saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    ASSERT_EQ(saved.lse.dtype(), f64);
    EXPECT_TRUE(same_bits(saved.output, w.output));
    const mha::Tensor grad = randn(saved.output.sizes(), rng, f64);
    const bool mask_grad = kind == 1;
    const mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o, mask_grad);
    const mha::reference::Gradients rg = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
    ASSERT_EQ(g.query.dtype(), f64);
    EXPECT_LT(rel_error(g.query, rg.query, 1.0), kTol);
    EXPECT_LT(rel_error(g.key, rg.key, 1.0), kTol);
    EXPECT_LT(rel_error(g.value, rg.value, 1.0), kTol);
    if (mask_grad) EXPECT_LT(rel_error(*g.attn_mask, rg.attn_mask, 1.0), kTol);

    // The same bits on one thread and on three (each task writes its own rows).
    mha::SdpaOptions one = o, three = o;
    one.num_threads = 1, three.num_threads = 3;
    EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(q, k, v, one), mha::scaled_dot_product_attention(q, k, v, three)));
    const auto g1 = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, one, mask_grad);
    const auto g3 = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, three, mask_grad);
    EXPECT_TRUE(same_bits(g1.query, g3.query) && same_bits(g1.key, g3.key) && same_bits(g1.value, g3.value));
  }
}

TEST(Float64, RowsThatSeeNoKeyAreZeroAndErrorsNameTheDtype) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::DType f64 = mha::DType::f64;
  const mha::Tensor q = randn({1, 2, 6, 8}, rng, f64), k = randn({1, 2, 4, 8}, rng, f64), v = randn({1, 2, 4, 5}, rng, f64);
  mha::Tensor mask = mha::Tensor::empty({6, 4}, mha::DType::boolean);
  for (int64_t e = 0; e < mask.numel(); ++e) mask.data<uint8_t>()[e] = e / 4 != 2;  // row 2 sees no key
  const mha::SdpaOptions o{.attn_mask = mask.view()};
  const mha::AttentionForTraining saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(saved.lse.at({0, h, 2}), INFINITY);
    for (int64_t d = 0; d < 5; ++d) EXPECT_EQ(saved.output.at({0, h, 2, d}), 0.0);
  }
  const mha::Tensor grad = randn({1, 2, 6, 5}, rng, f64);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(g.query.at({0, h, 2, d}), 0.0);
  EXPECT_LT(rel_error(g.key, mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o).key, 1.0), kTol);

  // Rows whose every score is one huge mask value (Hugging Face's finfo.min): uniform weights, and
  // the backward forms them the same way (exp(s - lse) would give 1 per key: -3.4e38 + log n
  // rounds to -3.4e38 in float64 too).
  mha::Tensor huge = mha::Tensor::zeros({1, 1, 6, 4}, f64);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) huge.data<double>()[i * 4 + j] = -3.4028234663852886e38;
  const mha::SdpaOptions ho{.attn_mask = huge.view()};
  const mha::AttentionForTraining hs = mha::scaled_dot_product_attention_for_training(q, k, v, ho);
  const auto hg = mha::scaled_dot_product_attention_backward(q, k, v, hs, grad, ho, true);
  const auto hr = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, ho);
  EXPECT_LT(rel_error(hs.output, mha::reference::scaled_dot_product_attention(q, k, v, ho).output), kTol);
  EXPECT_LT(rel_error(hg.query, hr.query, 1.0), kTol);
  EXPECT_LT(rel_error(hg.key, hr.key, 1.0), kTol);
  EXPECT_LT(rel_error(hg.value, hr.value, 1.0), kTol);
  EXPECT_LT(rel_error(*hg.attn_mask, hr.attn_mask, 1.0), kTol);

  // A float64 mask with float32 inputs, and mixed input dtypes, are errors; so is a float32
  // log-sum-exp handed to a float64 backward.
  const mha::Tensor q32 = randn({1, 2, 6, 8}, rng), k32 = randn({1, 2, 4, 8}, rng), v32 = randn({1, 2, 4, 5}, rng);
  const mha::Tensor m64 = randn({6, 4}, rng, f64);
  mha_test::expect_error([&] { mha::scaled_dot_product_attention(q32, k32, v32, {.attn_mask = m64.view()}); }, "float64");
  mha_test::expect_error([&] { mha::scaled_dot_product_attention(q, k32, v32); }, "one dtype");
  const mha::AttentionForTraining wrong{saved.output, mha::Tensor::copy_of(saved.lse, mha::DType::f32)};
  mha_test::expect_error([&] { mha::scaled_dot_product_attention_backward(q, k, v, wrong, grad, o); }, "saved.lse");
}
