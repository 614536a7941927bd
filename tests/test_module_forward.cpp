// MultiheadAttention against the float64 module reference over randomized combinations of every
// constructor and forward option; PyTorch's parameter names, shapes and initialisation; state
// dicts; train/eval and dropout. Fresh seed each run (printed; MHA_TEST_SEED replays).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

// fp32 projections and attention against float64 (sums of <= ~100 terms), normwise relative to
// the output's magnitude (reference::multihead_attention's output_magnitude): relative to the
// output itself, fp32's error grows without bound where the terms of an output cancel.
constexpr double kTolerance = 1e-5;
// A float64 module against the same reference: both in float64, in different orders (BLAS blocks,
// a log-sum-exp), so they differ by some hundreds of units of 2^-53 of the terms' magnitude.
constexpr double kTolerance64 = 1e-12;

// `cases` random modules of `dtype` (float32 or float64) with random options, inputs and masks,
// against the reference.
void check_randomized_options(mha::DType dtype, int cases, double tolerance) {
  std::mt19937_64 rng(test_seed());
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  for (int n = 0; n < cases; ++n) {
    const int64_t H = pick(1, 4), E = H * pick(1, 12);
    const bool cross = coin(0.5);
    mha::MultiheadAttentionOptions o;
    o.dropout = coin(0.3) ? 0.25 : 0.0;
    o.bias = coin(0.7);
    o.add_bias_kv = coin(0.3);
    o.add_zero_attn = coin(0.3);
    if (cross && coin(0.5)) o.kdim = pick(1, 20);
    if (cross && coin(0.5)) o.vdim = pick(1, 20);
    o.batch_first = coin(0.5);
    o.seed = rng();
    o.dtype = dtype;
    mha::MultiheadAttention m(E, H, o);
    const bool training = o.dropout > 0 && coin(0.5);
    m.train(training);
    const bool batched = coin(0.8);
    const int64_t N = pick(1, 3), L = pick(1, 20), S = cross ? pick(1, 20) : L;
    auto shape = [&](int64_t len, int64_t width) -> mha::Shape {
      if (!batched) return {len, width};
      return o.batch_first ? mha::Shape{N, len, width} : mha::Shape{len, N, width};
    };
    const mha::Tensor query = randn(shape(L, E), rng, dtype);
    const mha::Tensor key = cross ? randn(shape(S, m.kdim()), rng, dtype) : query;
    const mha::Tensor value = cross ? randn(shape(S, m.vdim()), rng, dtype) : query;
    // A float mask is float32 or (a float64 module's own dtype) float64.
    auto float_mask = [&](const mha::Shape& s) { return randn(s, rng, coin(0.5) ? dtype : mha::DType::f32); };
    mha::ForwardOptions f;
    f.need_weights = coin(0.6);
    f.average_attn_weights = coin(0.5);
    f.is_causal = coin(0.2);
    if (training) f.dropout_seed = rng();
    mha::Tensor attn_mask, kpm;
    const int mask_kind = static_cast<int>(pick(0, 4));  // none, 2-D bool, 2-D float, 3-D bool, 3-D float
    if (mask_kind > 0) {
      const mha::Shape ms = mask_kind <= 2 ? mha::Shape{L, S} : mha::Shape{(batched ? N : 1) * H, L, S};
      if (mask_kind % 2 == 1) {
        attn_mask = mha::Tensor::empty(ms, mha::DType::boolean);
        for (int64_t i = 0; i < attn_mask.numel(); ++i) attn_mask.data<bool>()[i] = coin(0.2);  // true: masked
      } else {
        attn_mask = float_mask(ms);
      }
      f.attn_mask = attn_mask.view();
    }
    if (coin(0.5)) {
      const mha::Shape ks = batched ? mha::Shape{N, S} : mha::Shape{S};
      if (coin(0.5)) {
        kpm = mha::Tensor::empty(ks, mha::DType::boolean);
        for (int64_t i = 0; i < kpm.numel(); ++i) kpm.data<bool>()[i] = coin(0.25);
      } else {
        kpm = float_mask(ks);
      }
      f.key_padding_mask = kpm.view();
    }
    // Sometimes a strided (non-contiguous) query: stored with its two leading dims swapped.
    mha::Tensor swapped;
    mha::TensorView q_in = query.view();
    if (cross && batched && coin(0.3)) {
      swapped = mha::Tensor::copy_of(query.view().transpose(0, 1));
      q_in = swapped.view().transpose(0, 1);
    }
    SCOPED_TRACE("case " + std::to_string(n) + ": E=" + std::to_string(E) + " H=" + std::to_string(H) +
                 " cross=" + std::to_string(cross) + " bias_kv=" + std::to_string(o.add_bias_kv) +
                 " zero_attn=" + std::to_string(o.add_zero_attn) + " batch_first=" + std::to_string(o.batch_first) +
                 " batched=" + std::to_string(batched) + " mask=" + std::to_string(mask_kind) +
                 " causal=" + std::to_string(f.is_causal) + " training=" + std::to_string(training));
    const mha::ForwardResult ours = m.forward(q_in, cross ? key.view() : q_in, cross ? value.view() : q_in, f);
    mha::Tensor magnitude;
    const mha::ForwardResult ref =
        mha::reference::multihead_attention(m, query, key, value, f, training, {}, &magnitude);
    EXPECT_EQ(ours.output.sizes(), query.sizes()[0] == 0 ? ours.output.sizes() : ref.output.sizes());
    EXPECT_EQ(ours.output.dtype(), dtype);
    EXPECT_LT(rel_error(ours.output, ref.output, max_abs(magnitude)), tolerance);
    for (int64_t i = 0; i < magnitude.numel(); ++i)  // the magnitude bounds the output it describes
      ASSERT_LE(std::abs(ref.output.data<double>()[i]), magnitude.data<double>()[i] * (1 + 1e-12));
    ASSERT_EQ(ours.weights.has_value(), f.need_weights);
    if (f.need_weights) EXPECT_EQ(ours.weights->dtype(), dtype);
    if (f.need_weights) EXPECT_LT(rel_error(*ours.weights, *ref.weights), tolerance);
  }
}

TEST(Module, RandomizedOptionsAgainstReference) { check_randomized_options(mha::DType::f32, 200, kTolerance); }

// A float64 module computes in float64 throughout (dgemm projections, the float64 attention), as
// PyTorch's float64 module does: what gradient checks rely on.
TEST(Module, Float64ModuleMatchesTheReferenceToFloat64Rounding) {
  check_randomized_options(mha::DType::f64, 120, kTolerance64);
}

// to(float64) widens every parameter exactly (and back again); a float64 module takes float64
// inputs only, float32 or float64 float masks, and a float64 grad_output; its context belongs to it.
TEST(Module, Float64ConversionAndErrors) {
  std::mt19937_64 rng(test_seed());
  mha::MultiheadAttention f32(16, 2, {.add_bias_kv = true, .seed = 5});
  mha::MultiheadAttention f64 = f32;
  f64.to(mha::DType::f64);
  EXPECT_EQ(f64.dtype(), mha::DType::f64);
  for (const auto& [name, t] : f64.named_parameters()) {
    EXPECT_EQ(t.dtype(), mha::DType::f64) << name;
    EXPECT_TRUE(mha_test::same_bits(mha::Tensor::copy_of(t, mha::DType::f32), f32.parameter(name))) << name;
  }
  const mha::Tensor x = randn({5, 2, 16}, rng, mha::DType::f64), x32 = mha::Tensor::copy_of(x, mha::DType::f32);
  mha_test::expect_error([&] { f64.forward(x32, x32, x32); }, "query: expected dtype float64");
  mha_test::expect_error([&] { f64.forward(x, x, x32); }, "value: expected dtype float64");
  const mha::Tensor half_mask = randn({5, 5}, rng, mha::DType::f16);
  mha_test::expect_error([&] { f64.forward(x, x, x, {.attn_mask = half_mask.view()}); },
                         "attn_mask: expected dtype bool, float32 or the module's float64");
  // A float32 mask and its float64 copy give the same result (the values are the same).
  const mha::Tensor mask32 = randn({5, 5}, rng), mask64 = mha::Tensor::copy_of(mask32, mha::DType::f64);
  EXPECT_TRUE(mha_test::same_bits(f64.forward(x, x, x, {.attn_mask = mask32.view()}).output,
                                  f64.forward(x, x, x, {.attn_mask = mask64.view()}).output));
  mha::ForwardContext ctx;
  const mha::ForwardResult r = f64.forward(x, x, x, {}, &ctx);
  EXPECT_EQ(r.output.dtype(), mha::DType::f64);
  EXPECT_EQ(r.weights->dtype(), mha::DType::f64);
  mha_test::expect_error([&] { f64.backward(ctx, mha::Tensor::copy_of(r.output, mha::DType::f32)); },
                         "grad_output: expected float64 of shape [5, 2, 16]");
  mha_test::expect_error([&] { f32.backward(ctx, r.output); }, "context comes from a float64 forward");
  f64.to(mha::DType::f32);  // exact: the values were float32's
  for (const auto& [name, t] : f64.named_parameters()) {
    EXPECT_TRUE(mha_test::same_bits(t, f32.parameter(name))) << name;
  }
}

TEST(Module, ParametersHavePyTorchNamesShapesAndInitialisation) {
  mha::MultiheadAttention packed(16, 4, {.add_bias_kv = true, .seed = 1});
  std::vector<std::string> names;
  for (const auto& [name, t] : packed.named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
                                             "out_proj.bias"}));
  EXPECT_EQ(packed.parameter("in_proj_weight").sizes(), (mha::Shape{48, 16}));
  EXPECT_EQ(packed.parameter("bias_k").sizes(), (mha::Shape{1, 1, 16}));
  mha::MultiheadAttention split(16, 4, {.bias = false, .kdim = 5, .vdim = 7});
  names.clear();
  for (const auto& [name, t] : split.named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}));
  EXPECT_EQ(split.parameter("k_proj_weight").sizes(), (mha::Shape{16, 5}));
  EXPECT_EQ(split.parameter("v_proj_weight").sizes(), (mha::Shape{16, 7}));

  // xavier_uniform on [3E, E]: U(-a, a), a = sqrt(6 / (E + 3E)); its variance is a^2 / 3.
  const int64_t E = 64;
  mha::MultiheadAttention m(E, 8, {.seed = test_seed()});
  const mha::Tensor w = m.parameter("in_proj_weight");
  const double bound = std::sqrt(6.0 / (E + 3 * E));
  double sum_sq = 0, max = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    sum_sq += w.data<float>()[i] * w.data<float>()[i];
    max = std::max(max, std::abs(static_cast<double>(w.data<float>()[i])));
  }
  EXPECT_LE(max, bound);
  EXPECT_GT(max, 0.95 * bound);
  EXPECT_NEAR(sum_sq / w.numel(), bound * bound / 3, 0.05 * bound * bound / 3);
  for (const char* zero : {"in_proj_bias", "out_proj.bias"})
    for (int64_t i = 0; i < E; ++i) EXPECT_EQ(m.parameter(zero).data<float>()[i], 0.0f);
  const mha::Tensor wo = m.parameter("out_proj.weight");  // kaiming_uniform(a=sqrt(5)): U(-1/sqrt(E), 1/sqrt(E))
  for (int64_t i = 0; i < wo.numel(); ++i) ASSERT_LE(std::abs(wo.data<float>()[i]), 1.0 / std::sqrt(double(E)));

  // The same seed gives the same parameters; another seed, others.
  mha::MultiheadAttention a(E, 8, {.seed = 5}), b(E, 8, {.seed = 5}), c(E, 8, {.seed = 6});
  EXPECT_EQ(std::memcmp(a.parameter("in_proj_weight").data<float>(), b.parameter("in_proj_weight").data<float>(), w.numel() * 4), 0);
  EXPECT_NE(std::memcmp(a.parameter("in_proj_weight").data<float>(), c.parameter("in_proj_weight").data<float>(), w.numel() * 4), 0);
}

TEST(Module, StateDictRoundTripAndStrictness) {
  std::mt19937_64 rng(test_seed());
  mha::MultiheadAttention src(12, 3, {.add_bias_kv = true, .kdim = 4, .vdim = 6, .seed = 2});
  mha::MultiheadAttention dst(12, 3, {.add_bias_kv = true, .kdim = 4, .vdim = 6, .seed = 3});
  std::unordered_map<std::string, mha::TensorView> state;
  for (const auto& [name, t] : src.named_parameters()) state[name] = t.view();
  dst.load_state_dict(state);
  const mha::Tensor x = randn({5, 2, 12}, rng), k = randn({4, 2, 4}, rng), v = randn({4, 2, 6}, rng);
  src.eval();
  dst.eval();
  EXPECT_EQ(rel_error(src(x, k, v).output, dst(x, k, v).output), 0.0);
  // A copy is deep: changing it leaves the original alone.
  mha::MultiheadAttention copy = src;
  copy.parameter("bias_k").data<float>()[0] += 1.0f;
  EXPECT_NE(copy.parameter("bias_k").data<float>()[0], src.parameter("bias_k").data<float>()[0]);

  auto missing = state;
  missing.erase("bias_v");
  EXPECT_THROW(dst.load_state_dict(missing), mha::Error);
  EXPECT_NO_THROW(dst.load_state_dict(missing, /*strict=*/false));
  auto extra = state;
  const mha::Tensor junk = randn({3}, rng);
  extra["junk"] = junk.view();
  EXPECT_THROW(dst.load_state_dict(extra), mha::Error);
  auto wrong = state;
  const mha::Tensor bad = randn({12, 5}, rng);
  wrong["k_proj_weight"] = bad.view();
  try {
    dst.load_state_dict(wrong);
    FAIL() << "expected mha::Error";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_proj_weight"), std::string::npos) << e.what();
  }
  // float64 values are converted.
  const mha::Tensor w64 = mha::Tensor::copy_of(src.parameter("out_proj.weight"), mha::DType::f64);
  auto as64 = state;
  as64["out_proj.weight"] = w64.view();
  EXPECT_NO_THROW(dst.load_state_dict(as64));
}

TEST(Module, TrainingModeAppliesDropoutAndEvalDoesNot) {
  std::mt19937_64 rng(test_seed());
  mha::MultiheadAttention m(16, 2, {.dropout = 0.5, .seed = 4});
  const mha::Tensor x = randn({9, 2, 16}, rng);
  EXPECT_TRUE(m.is_training());
  const auto a = m(x, x, x), b = m(x, x, x);  // a new dropout stream each call
  EXPECT_GT(rel_error(a.output, b.output), 1e-3);
  const auto s1 = m(x, x, x, {.dropout_seed = 5}), s2 = m(x, x, x, {.dropout_seed = 5});
  EXPECT_EQ(rel_error(s1.output, s2.output), 0.0);
  m.eval();
  const auto e1 = m(x, x, x), e2 = m(x, x, x);
  EXPECT_EQ(rel_error(e1.output, e2.output), 0.0);
  const auto ref = mha::reference::multihead_attention(m, x, x, x, {}, false);
  EXPECT_LT(rel_error(e1.output, ref.output), kTolerance);
}

// Inputs in any layout a view can have: rows repeated by a stride of 0 (what expand() gives),
// overlapping rows, features a stride apart, size-1 dimensions with any stride, batch-major
// storage of a sequence-first input. Each must give what its contiguous copy gives, forward and
// backward, and the forward must match the float64 reference. (BLAS reads rows a fixed leading
// dimension apart, which must be at least the row length: repeated or overlapping rows are not
// something it can be handed as they are.)
TEST(Module, EveryInputLayoutMatchesItsContiguousCopy) {
  std::mt19937_64 rng(test_seed());
  struct Layout {
    const char* name;
    mha::Shape strides;  // of the [L, N, E] view; -1: the contiguous stride
  };
  for (const int64_t E : {1, 8}) {
    for (const auto& [L, N] : {std::pair<int64_t, int64_t>{5, 3}, {1, 2}, {2, 1}, {1, 1}}) {
      const Layout layouts[] = {
          {"contiguous", {N * E, E, 1}},
          {"repeated over L (stride 0)", {0, E, 1}},
          {"repeated over N (stride 0)", {E, 0, 1}},
          {"one row repeated (strides 0, 0, 1)", {0, 0, 1}},
          {"one value everywhere", {0, 0, 0}},
          {"overlapping rows (stride 1)", {N, 1, 1}},
          {"features 2 apart", {2 * N * E, 2 * E, 2}},
          {"batch-major storage", {E, L * E, 1}},
          {"rows 3 apart in odd order", {3 * E + 1, 3 * E * L + 2, 1}},
      };
      for (const Layout& layout : layouts) {
        int64_t span = 1;
        for (int d = 0; d < 3; ++d) span += (mha::Shape{L, N, E}[d] - 1) * layout.strides[d];
        const mha::Tensor storage = randn({span}, rng);
        const mha::TensorView view(storage.data<float>(), mha::DType::f32, {L, N, E}, layout.strides);
        const mha::Tensor dense = mha::Tensor::copy_of(view);
        for (const bool self : {true, false}) {
          SCOPED_TRACE(std::string(layout.name) + " E=" + std::to_string(E) + " L=" + std::to_string(L) +
                       " N=" + std::to_string(N) + (self ? " self" : " cross (query contiguous)"));
          mha::MultiheadAttention m(E, 1, {.add_bias_kv = E > 1, .seed = rng()});
          const mha::Tensor other = randn({L, N, E}, rng);
          const mha::TensorView q = self ? view : other.view(), dq = self ? dense.view() : other.view();
          const auto ours = m.forward(q, view, view);  // (the training forward below copies its inputs first)
          mha::Tensor magnitude;
          const auto ref =
              mha::reference::multihead_attention(m, mha::Tensor::copy_of(dq), dense, dense, {}, false, {}, &magnitude);
          EXPECT_LT(rel_error(ours.output, ref.output, max_abs(magnitude)), kTolerance);
          mha::ForwardContext ctx, dense_ctx;
          const auto trained = m.forward(q, view, view, {}, &ctx);
          const auto copy = m.forward(dq, dense.view(), dense.view(), {}, &dense_ctx);
          EXPECT_LT(rel_error(trained.output, copy.output), kTolerance);
          const mha::Tensor grad = randn({L, N, E}, rng);
          const auto g = m.backward(ctx, grad.view()), dense_g = m.backward(dense_ctx, grad.view());
          EXPECT_LT(rel_error(g.query, dense_g.query), kTolerance);
          EXPECT_LT(rel_error(g.key, dense_g.key), kTolerance);
          EXPECT_LT(rel_error(g.value, dense_g.value), kTolerance);
          for (size_t i = 0; i < g.parameters.size(); ++i)
            EXPECT_LT(rel_error(g.parameters[i].second, dense_g.parameters[i].second), kTolerance) << g.parameters[i].first;
        }
      }
    }
  }
}

// forward_with / backward_with read the given views, never the module's own parameters: a module
// run with another module's parameters gives that module's results and gradients, bit for bit
// (the same code in the same order), whatever the views' layout; its own parameters stay as they
// were. Wrong names, shapes and dtypes are errors naming the parameter. A module built without
// parameters of its own (own_parameters = false) runs only this way.
TEST(Module, ForwardWithGivenParametersIsTheirModule) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
    for (const bool packed : {true, false}) {
      mha::MultiheadAttentionOptions o{.add_bias_kv = true, .dtype = dtype};
      if (!packed) o.kdim = 5, o.vdim = 7;
      o.seed = rng();
      mha::MultiheadAttention owner(12, 3, o);
      o.seed = rng();
      mha::MultiheadAttention runner(12, 3, o);
      owner.eval();
      runner.eval();
      const std::vector<std::pair<std::string, mha::Tensor>> runner_before = [&] {
        auto p = runner.named_parameters();
        for (auto& [name, t] : p) t = t.clone();
        return p;
      }();
      // The owner's parameters as views; every other one stored transposed (a strided view).
      std::vector<mha::Tensor> keep;
      mha::ParameterViews views;
      int i = 0;
      for (const auto& [name, t] : owner.named_parameters()) {
        if (t.ndim() == 2 && i++ % 2 == 0) {
          keep.push_back(mha::Tensor::copy_of(t.view().transpose(0, 1)));
          views[name] = keep.back().view().transpose(0, 1);
        } else {
          views[name] = t.view();
        }
      }
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + (packed ? " packed" : " kdim/vdim"));
      // 60 query rows and 42 key rows: a bfloat16 module projects them from the 16-bit weights as
      // they are (up to 64 rows), whatever the views' layout.
      const mha::Tensor x = randn({20, 3, 12}, rng, dtype);
      const mha::Tensor k = packed ? x : randn({14, 3, 5}, rng, dtype), v = packed ? x : randn({14, 3, 7}, rng, dtype);
      mha::ForwardContext ctx_owner, ctx_runner;
      const auto expected = owner.forward(x, k, v, {}, &ctx_owner);
      const auto got = runner.forward_with(views, x, k, v, {}, &ctx_runner);
      EXPECT_TRUE(mha_test::same_bits(got.output, expected.output));
      EXPECT_TRUE(mha_test::same_bits(*got.weights, *expected.weights));
      const mha::Tensor grad = randn(expected.output.sizes(), rng, dtype);
      const auto g_expected = owner.backward(ctx_owner, grad);
      const auto g = runner.backward_with(views, ctx_runner, grad);
      EXPECT_TRUE(mha_test::same_bits(g.query, g_expected.query));
      EXPECT_TRUE(mha_test::same_bits(g.key, g_expected.key));
      EXPECT_TRUE(mha_test::same_bits(g.value, g_expected.value));
      ASSERT_EQ(g.parameters.size(), g_expected.parameters.size());
      for (size_t j = 0; j < g.parameters.size(); ++j) {
        EXPECT_EQ(g.parameters[j].first, g_expected.parameters[j].first);
        EXPECT_TRUE(mha_test::same_bits(g.parameters[j].second, g_expected.parameters[j].second)) << g.parameters[j].first;
      }
      for (const auto& [name, t] : runner_before) EXPECT_TRUE(mha_test::same_bits(runner.parameter(name), t)) << name;

      auto without = views;
      without.erase("out_proj.weight");
      mha_test::expect_error([&] { runner.forward_with(without, x, k, v); }, "missing 'out_proj.weight'");
      auto extra = views;
      extra["junk"] = views.at("bias_k");
      mha_test::expect_error([&] { runner.forward_with(extra, x, k, v); }, "unexpected 'junk'");
      auto wrong_shape = views;
      wrong_shape["bias_v"] = mha::TensorView(views.at("bias_v").data, dtype, {12});
      mha_test::expect_error([&] { runner.backward_with(wrong_shape, ctx_runner, grad); }, "['bias_v']: expected");
      // A module that holds no parameters runs the same on given ones, and on nothing else.
      mha::MultiheadAttentionOptions none = o;
      none.own_parameters = false;
      mha::MultiheadAttention bare(12, 3, none);
      bare.eval();
      EXPECT_TRUE(bare.named_parameters().empty());
      EXPECT_EQ(bare.parameter_shapes().size(), owner.named_parameters().size());
      // (Against the owner's inference call: a bfloat16 module's training forward may run in
      // bfloat16 products where its inference of few rows does not.)
      EXPECT_TRUE(mha_test::same_bits(bare.forward_with(views, x, k, v).output, owner.forward(x, k, v).output));
      mha_test::expect_error([&] { bare.forward(x, k, v); }, "holds no parameters");
      mha_test::expect_error([&] { bare.backward(ctx_runner, grad); }, "holds no parameters");
      mha_test::expect_error([&] { bare.load_state_dict(views); }, "holds no parameters");
      mha_test::expect_error([&] { bare.parameter("out_proj.weight"); }, "holds no parameters");
      const mha::Tensor other_dtype =
          mha::Tensor::copy_of(views.at("out_proj.weight"), dtype == mha::DType::f32 ? mha::DType::f64 : mha::DType::f32);
      auto wrong_dtype = views;
      wrong_dtype["out_proj.weight"] = other_dtype.view();
      mha_test::expect_error([&] { runner.forward_with(wrong_dtype, x, k, v); }, "['out_proj.weight']: expected");
    }
  }
}

}  // namespace
