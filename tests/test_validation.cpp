// Every invalid input is an mha::Error whose message names the argument; tensors and views.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#include <random>
#include <string>

#include "core/attention_problem.hpp"
#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

mha::Tensor randn(const mha::Shape& shape, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  return mha_test::randn(shape, rng);
}

using mha_test::expect_error;

TEST(Errors, ModuleConstruction) {
  expect_error([] { mha::MultiheadAttention(10, 3); }, "divisible by num_heads");
  expect_error([] { mha::MultiheadAttention(8, 0); }, "num_heads");
  expect_error([] { mha::MultiheadAttention(8, -2); }, "num_heads");
  expect_error([] { mha::MultiheadAttention(0, 1); }, "embed_dim");
  expect_error([] { mha::MultiheadAttention(8, 2, {.kdim = 0}); }, "kdim");
  expect_error([] { mha::MultiheadAttention(8, 2, {.vdim = -1}); }, "vdim");
  expect_error([] { mha::MultiheadAttention(8, 2, {.dropout = 1.5}); }, "dropout");
  expect_error([] { mha::MultiheadAttention(8, 2).parameter("nope"); }, "nope");
}

TEST(Errors, ModuleForward) {
  mha::MultiheadAttention m(8, 2, {.kdim = 4});
  const mha::Tensor x = randn({5, 3, 8}), k = randn({6, 3, 4}), v = randn({6, 3, 8});
  expect_error([&] { m(randn({5, 3, 7}), k, v); }, "query");
  expect_error([&] { m(randn({5, 3, 8, 1}), k, v); }, "query");
  expect_error([&] { m(x, randn({6, 2, 4}), randn({6, 2, 8})); }, "batch");
  expect_error([&] { m(x, k, randn({7, 3, 8})); }, "value");
  expect_error([&] { m(x, randn({6, 3, 8}), v); }, "key");
  expect_error([&] { m(x, randn({6, 4}), randn({6, 8})); }, "key");  // unbatched key for a batched query
  const mha::Tensor bad_mask = randn({5, 5});
  expect_error([&] { m(x, k, v, {.attn_mask = bad_mask.view()}); }, "attn_mask");
  const mha::Tensor mask3 = randn({3, 5, 6});  // needs N * H = 6
  expect_error([&] { m(x, k, v, {.attn_mask = mask3.view()}); }, "attn_mask");
  const mha::Tensor mask64 = mha::Tensor::zeros({5, 6}, mha::DType::f64);
  expect_error([&] { m(x, k, v, {.attn_mask = mask64.view()}); }, "attn_mask");
  const mha::Tensor kpm = mha::Tensor::zeros({3, 5}, mha::DType::boolean);
  expect_error([&] { m(x, k, v, {.key_padding_mask = kpm.view()}); }, "key_padding_mask");
  const mha::Tensor kpm_bf16 = mha::Tensor::zeros({3, 6}, mha::DType::bf16);
  expect_error([&] { m(x, k, v, {.key_padding_mask = kpm_bf16.view()}); }, "key_padding_mask");
  const mha::Tensor bf16 = mha::Tensor::copy_of(x, mha::DType::bf16);
  expect_error([&] { m(bf16, k, v); }, "query");
  mha::TensorView null_view(static_cast<const float*>(nullptr), {5, 3, 8});
  expect_error([&] { m(null_view, k, v); }, "null");
  expect_error([&] { m(x, k, v, {.num_threads = -1}); }, "num_threads");
}

TEST(Errors, Sdpa) {
  const mha::Tensor q = randn({2, 4, 5, 8}), k = randn({2, 2, 6, 8}), v = randn({2, 2, 6, 3});
  expect_error([&] { mha::scaled_dot_product_attention(q, k, v); }, "enable_gqa");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({2, 3, 6, 8}), randn({2, 3, 6, 3}), {.enable_gqa = true}); },
               "enable_gqa");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({2, 4, 6, 7}), randn({2, 4, 6, 3})); }, "key");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({2, 4, 6, 8}), randn({2, 4, 5, 3})); }, "value");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({3, 4, 6, 8}), randn({3, 4, 6, 3})); }, "batch");
  expect_error([&] { mha::scaled_dot_product_attention(randn({8}), randn({8}), randn({8})); }, "query");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({8}), randn({4, 6, 3})); }, "dimensions");
  // Batch dimensions broadcast as in PyTorch, but must agree where neither is 1.
  expect_error([&] { mha::scaled_dot_product_attention(randn({2, 3, 4, 5, 8}), randn({3, 3, 4, 6, 8}), randn({4, 6, 3})); },
               "do not broadcast");
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({2, 2, 6, 8}), randn({2, 3, 6, 3}), {.enable_gqa = true}); },
               "multiple of value heads");
  expect_error([&] { mha::scaled_dot_product_attention(randn({2, 1, 5, 8}), randn({2, 2, 6, 8}), randn({2, 2, 6, 3}), {.enable_gqa = true}); },
               "multiple");
  const mha::Tensor mask3 = randn({2, 5, 6});  // [2, 5, 6] against weights [2, 4, 5, 6]: 2 is not 4
  expect_error([&] { mha::scaled_dot_product_attention(q, randn({4, 6, 8}), randn({4, 6, 3}), {.attn_mask = mask3.view()}); },
               "attn_mask");
  // Batch sizes whose product overflows (empty tensors, so nothing is allocated): an error, not UB.
  const mha::TensorView huge_q(static_cast<const float*>(nullptr), {int64_t{1} << 40, 1, 1, 0, 8});
  const mha::TensorView huge_k(static_cast<const float*>(nullptr), {1, int64_t{1} << 40, 1, 0, 8});
  expect_error([&] { mha::scaled_dot_product_attention(huge_q, huge_k, huge_k); }, "overflow");
  const mha::Tensor kk = randn({2, 4, 6, 8}), vv = randn({2, 4, 6, 3});
  expect_error([&] { mha::scaled_dot_product_attention(q, kk, vv, {.dropout_p = -0.1}); }, "dropout_p");
  expect_error([&] { mha::scaled_dot_product_attention(q, kk, vv, {.dropout_p = 1.01}); }, "dropout_p");
  expect_error([&] { mha::scaled_dot_product_attention(q, kk, vv, {.scale = std::numeric_limits<double>::infinity()}); },
               "scale");
  const mha::Tensor wide = randn({5, 7});
  expect_error([&] { mha::scaled_dot_product_attention(q, kk, vv, {.attn_mask = wide.view()}); }, "attn_mask");
  const mha::Tensor m64 = mha::Tensor::zeros({5, 6}, mha::DType::f64);
  expect_error([&] { mha::scaled_dot_product_attention(q, kk, vv, {.attn_mask = m64.view()}); }, "attn_mask");
  const mha::Tensor q16 = mha::Tensor::copy_of(q, mha::DType::f16);
  expect_error([&] { mha::scaled_dot_product_attention(q16, kk, vv); }, "query");
  const mha::Tensor out = randn({2, 4, 5, 4});
  expect_error([&] { mha::scaled_dot_product_attention_into(q, kk, vv, out); }, "out");
  mha::TensorView null_k(static_cast<const float*>(nullptr), {2, 4, 6, 8});
  expect_error([&] { mha::scaled_dot_product_attention(q, null_k, vv); }, "key");
}

TEST(Errors, SizesThatOverflow) {
  expect_error([] { mha::checked_numel({int64_t{1} << 40, int64_t{1} << 40}, "shape"); }, "overflow");
  expect_error([] { mha::Tensor::empty({int64_t{1} << 62, 4}); }, "overflow");
  expect_error([] { mha::checked_numel({3, -1}, "shape"); }, ">= 0");
  expect_error([] { mha::TensorView(static_cast<const float*>(nullptr), {int64_t{1} << 32, int64_t{1} << 32}); },
               "overflow");
  // Offsets that overflow even though the element count does not.
  expect_error([] { mha::TensorView(static_cast<const float*>(nullptr), {4, 4}, {int64_t{1} << 62, 1}); }, "overflow");
  expect_error([] { mha::set_num_threads(0); }, "set_num_threads");
  // An empty input (L = 0) may have a batch of 2^62; N * num_heads for a 3-D attn_mask then
  // overflows, and that must be an error naming the mask, not an overflow (found by fuzzing).
  const mha::TensorView empty_batch(static_cast<const float*>(nullptr), {0, int64_t{1} << 62, 8});
  const mha::TensorView mask(static_cast<const float*>(nullptr), {5, 0, 1});
  const mha::MultiheadAttention m(8, 4);
  expect_error([&] { m.forward(empty_batch, empty_batch, empty_batch, {.attn_mask = mask}); }, "attn_mask");
}

TEST(Errors, AllocationBeyondMemoryIsAnError) {
  // 2^44 floats = 64 TiB: the count fits, the allocation cannot succeed.
  expect_error([] { mha::Tensor::empty({int64_t{1} << 44}); }, "allocate");
}

TEST(Tensor, ViewsShareStorageAndKeepStrides) {
  mha::Tensor t = randn({2, 3, 4});
  EXPECT_TRUE(t.view().is_contiguous());
  const mha::TensorView tr = t.view().transpose(0, 2);
  EXPECT_EQ(tr.sizes(), (mha::Shape{4, 3, 2}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.at({3, 2, 1}), t.at({1, 2, 3}));
  const mha::TensorView p = t.view().permute({1, 2, 0});
  EXPECT_EQ(p.at({2, 3, 1}), t.at({1, 2, 3}));
  const mha::TensorView s = t.view().select(1, 2);
  EXPECT_EQ(s.sizes(), (mha::Shape{2, 4}));
  EXPECT_EQ(s.at({1, 3}), t.at({1, 2, 3}));
  const mha::TensorView sl = t.view().slice(2, 1, 3);
  EXPECT_EQ(sl.at({1, 2, 0}), t.at({1, 2, 1}));
  const mha::TensorView u = t.view().unsqueeze(1);
  EXPECT_EQ(u.sizes(), (mha::Shape{2, 1, 3, 4}));
  EXPECT_EQ(u.at({1, 0, 2, 3}), t.at({1, 2, 3}));
  const mha::TensorView sp = t.view().split_dim(2, 2);
  EXPECT_EQ(sp.sizes(), (mha::Shape{2, 3, 2, 2}));
  EXPECT_EQ(sp.at({1, 2, 1, 1}), t.at({1, 2, 3}));
  mha::Tensor shared = t;  // a Tensor copy shares storage...
  shared.data<float>()[0] = 42.0f;
  EXPECT_EQ(t.data<float>()[0], 42.0f);
  mha::Tensor deep = t.clone();  // ...clone() does not
  deep.data<float>()[0] = 7.0f;
  EXPECT_EQ(t.data<float>()[0], 42.0f);
  expect_error([&] { t.view().select(1, 3); }, "select");
  expect_error([&] { t.view().slice(0, 1, 3); }, "slice");
  expect_error([&] { t.view().split_dim(2, 3); }, "split_dim");
  expect_error([&] { t.view().permute({0, 0, 1}); }, "permute");
  expect_error([&] { t.view().transpose(0, 3); }, "dimension");
}

TEST(Tensor, DtypeConversionsRoundTrip) {
  {  // a copy of a bool tensor holds exactly 0 or 1, whatever nonzero bytes the source had
    const uint8_t bytes[4] = {0, 2, 255, 1};
    const mha::Tensor c = mha::Tensor::copy_of(mha::TensorView(bytes, mha::DType::boolean, {4}));
    const uint8_t* d = c.data<uint8_t>();
    EXPECT_TRUE(d[0] == 0 && d[1] == 1 && d[2] == 1 && d[3] == 1);
  }
  std::mt19937_64 rng(mha_test::test_seed());
  std::normal_distribution<float> normal;
  mha::Tensor t = mha::Tensor::empty({1000});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(rng) * 100;
  // Rounding to nearest: bf16 keeps 8 significant bits (relative error <= 2^-8), fp16 11 bits
  // (<= 2^-11 in its normal range).
  const mha::Tensor bf = mha::Tensor::copy_of(t, mha::DType::bf16), h = mha::Tensor::copy_of(t, mha::DType::f16);
  const mha::Tensor back_bf = mha::Tensor::copy_of(bf, mha::DType::f32), back_h = mha::Tensor::copy_of(h, mha::DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = t.data<float>()[i];
    EXPECT_LE(std::abs(back_bf.data<float>()[i] - x), std::abs(x) * 0x1p-8f);
    if (std::abs(x) > 6.2e-5f) EXPECT_LE(std::abs(back_h.data<float>()[i] - x), std::abs(x) * 0x1p-11f);
  }
  EXPECT_EQ(static_cast<float>(mha::float16(70000.0f)), INFINITY);
  EXPECT_TRUE(std::isnan(static_cast<float>(mha::bfloat16(NAN))));
  EXPECT_EQ(static_cast<float>(mha::float16(5.9604645e-8f)), 5.9604645e-8f);  // the smallest subnormal
}

// Tensor's conversions between float32 and the 16-bit types run in vectors on AVX2 and above
// (cpu/convert_16bit.hpp): on every ISA, each element gets the bits of the scalar conversion, over
// random bit patterns (NaNs with payloads, signalling ones, infinities, subnormals) and values
// halfway between two 16-bit neighbours (ties to even), in spans with a partial last vector.
TEST(Tensor, SixteenBitConversionsAreTheScalarOnesOnEveryIsa) {
  std::mt19937_64 rng(mha_test::test_seed());
  const int64_t n = 4099;
  mha::Tensor wide = mha::Tensor::empty({n});
  mha::Tensor half_bits = mha::Tensor::empty({n}, mha::DType::f16);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 4 == 1) u = (u & 0x8fffe000u) | 0x00001000u;  // a float16 tie (or subnormal-range tie)
    if (i % 4 == 2) u = (u & 0xffff0000u) | 0x00008000u;  // a bfloat16 tie
    std::memcpy(wide.data<float>() + i, &u, 4);
    half_bits.data<uint16_t>()[i] = static_cast<uint16_t>(rng());
  }
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)));
    const mha::Tensor h = mha::Tensor::copy_of(wide, mha::DType::f16), bf = mha::Tensor::copy_of(wide, mha::DType::bf16);
    const mha::Tensor back = mha::Tensor::copy_of(half_bits, mha::DType::f32);
    int wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = wide.data<float>()[i];
      wrong += h.data<uint16_t>()[i] != mha::float16(x).bits;
      wrong += bf.data<uint16_t>()[i] != mha::bfloat16(x).bits;
      const float y = static_cast<float>(mha::float16::from_bits(half_bits.data<uint16_t>()[i]));
      wrong += std::memcmp(back.data<float>() + i, &y, 4) != 0;
    }
    EXPECT_EQ(wrong, 0);
  }
  mha::detail::force_isa(std::nullopt);
}

// copy_into between strided views, every pair of dtypes: whole-row spans where both last
// dimensions are unit-stride (permuted leading dimensions, sliced rows), element by element
// elsewhere; each element must be the source's value rounded once to the destination's dtype.
TEST(Tensor, StridedCopiesConvertEveryElement) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f64, mha::DType::bf16, mha::DType::f16, mha::DType::boolean};
  auto rounded = [](double x, mha::DType to) -> double {
    switch (to) {
      case mha::DType::f32: return static_cast<float>(x);
      case mha::DType::f64: return x;
      case mha::DType::bf16: return static_cast<float>(mha::bfloat16(static_cast<float>(x)));
      case mha::DType::f16: return static_cast<float>(mha::float16(static_cast<float>(x)));
      case mha::DType::boolean: return x != 0.0 ? 1.0 : 0.0;
    }
    return NAN;
  };
  mha::Tensor values = mha_test::randn({3, 4, 5, 6}, rng, mha::DType::f64);
  for (int64_t i = 0; i < values.numel(); i += 7) values.data<double>()[i] = 0.0;  // bool sees both values
  for (mha::DType from : dtypes) {
    const mha::Tensor src = mha::Tensor::copy_of(values, from);
    const mha::TensorView views[] = {
        src.view().permute({1, 0, 2, 3}),       // rows in another order
        src.view().slice(3, 1, 5),              // rows with gaps between them
        src.view().slice(3, 2, 3),              // one-element rows
        src.view().permute({0, 1, 3, 2}),       // a strided last dimension: element by element
        src.view().select(2, 1).transpose(0, 1),
    };
    for (mha::DType to : dtypes) {
      for (const mha::TensorView& v : views) {
        // Into a contiguous tensor, and into a view whose leading dimensions are transposed.
        mha::Shape swapped = v.sizes();
        std::swap(swapped[0], swapped[1]);
        const mha::Tensor plain = mha::Tensor::empty(v.sizes(), to), other = mha::Tensor::empty(swapped, to);
        for (const mha::TensorView& dst : {plain.view(), other.view().transpose(0, 1)}) {
          mha::copy_into(v, dst);
          int wrong = 0;
          std::vector<int64_t> idx(static_cast<size_t>(v.ndim), 0);
          for (int64_t e = 0; e < v.numel(); ++e) {
            if (dst.at(idx) != rounded(v.at(idx), to)) ++wrong;
            for (int d = v.ndim - 1; d >= 0 && ++idx[d] == v.shape[d]; --d) idx[d] = 0;
          }
          EXPECT_EQ(wrong, 0) << mha::dtype_name(from) << " -> " << mha::dtype_name(to) << " view " << v.shape_str();
        }
      }
    }
  }
}

}  // namespace

namespace {

// Regressions found by fuzzing: empty tensors next to absurd sizes, empty operands, bool bytes
// other than 0 and 1. Each must give a defined result or an mha::Error, never undefined behaviour
// (the sanitizer builds of this suite check the "never").
TEST(Edges, EmptyAndAbsurdShapes) {
  // A view with a zero size may have any other sizes: its element count is 0.
  const mha::TensorView empty(static_cast<const float*>(nullptr), {0, int64_t{1} << 62, int64_t{1} << 62});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.unsqueeze(0).numel(), 0);
  EXPECT_EQ(empty.slice(1, 5, 7).numel(), 0);
  EXPECT_EQ(empty.select(1, 3).numel(), 0);
  const mha::TensorView zero_last(static_cast<const float*>(nullptr), {int64_t{1} << 62, int64_t{1} << 62, 0});
  EXPECT_EQ(zero_last.numel(), 0);
  EXPECT_EQ(zero_last.slice(0, 3, 9).numel(), 0);
  expect_error([] { mha::MultiheadAttention(int64_t{1} << 62, 1); }, "embed_dim");
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor q = mha_test::randn({2, 3, 5, 8}, rng);
  // No key at all: every row is fully masked, so the output is zero.
  const mha::Tensor k0 = mha::Tensor::empty({2, 3, 0, 8}), v0 = mha::Tensor::empty({2, 3, 0, 4});
  const mha::Tensor none = mha::scaled_dot_product_attention(q, k0, v0);
  for (int64_t i = 0; i < none.numel(); ++i) ASSERT_EQ(none.data<float>()[i], 0.0f);
  // Value width 0: an empty output, weights still defined, and a backward that runs.
  const mha::Tensor k = mha_test::randn({2, 3, 6, 8}, rng), v = mha::Tensor::empty({2, 3, 6, 0});
  const auto r = mha::scaled_dot_product_attention_with_weights(q, k, v);
  EXPECT_EQ(r.output.numel(), 0);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v);
  EXPECT_LT(mha_test::rel_error(r.weights, ref.weights), 1e-5);
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, mha::Tensor::empty({2, 3, 5, 0}));
  for (int64_t i = 0; i < g.query.numel(); ++i) ASSERT_EQ(g.query.data<float>()[i], 0.0f);
  // A module call with no query rows.
  mha::MultiheadAttention m(8, 2);
  const mha::Tensor x = mha_test::randn({4, 2, 8}, rng), nothing = mha::Tensor::empty({0, 2, 8});
  const auto out = m(nothing, x, x);
  EXPECT_EQ(out.output.sizes(), (mha::Shape{0, 2, 8}));
  // Empty sequences in a batch of 2^43: no work, and empty weights of the batch's shape. (Without
  // optimisation the head averaging once looped over every batch entry and head: minutes.)
  const mha::TensorView empty_rows(static_cast<const float*>(nullptr), {0, int64_t{1} << 43, 8}, {0, 0, 0});
  const auto empty_out = m(empty_rows, empty_rows, empty_rows);
  EXPECT_EQ(empty_out.output.numel(), 0);
  EXPECT_EQ(empty_out.weights->sizes(), (mha::Shape{int64_t{1} << 43, 0, 0}));
  mha::ForwardContext ctx;  // and their backward, whose zero gradients are empty too
  m.forward(empty_rows, empty_rows, empty_rows, {}, &ctx);
  const auto empty_grads = m.backward(ctx, empty_rows);
  EXPECT_EQ(empty_grads.query.numel(), 0);
  for (const auto& [name, t] : empty_grads.parameters)
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.data<float>()[i], 0.0f) << name;
}

TEST(Edges, BoolMasksReadAnyNonzeroByteAsTrue) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor q = mha_test::randn({1, 4, 8}, rng), k = mha_test::randn({1, 6, 8}, rng);
  mha::Tensor ones = mha::Tensor::empty({4, 6}, mha::DType::boolean), bytes = mha::Tensor::empty({4, 6}, mha::DType::boolean);
  for (int64_t i = 0; i < 24; ++i) {
    const bool keep = i % 3 != 0;
    ones.data<bool>()[i] = keep;
    reinterpret_cast<uint8_t*>(bytes.data<bool>())[i] = keep ? static_cast<uint8_t>(2 + i) : 0;  // not 0/1
  }
  const mha::Tensor a = mha::scaled_dot_product_attention(q, k, k, {.attn_mask = ones.view()});
  const mha::Tensor b = mha::scaled_dot_product_attention(q, k, k, {.attn_mask = bytes.view()});
  EXPECT_TRUE(mha_test::same_bits(a, b));
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, k, {.attn_mask = bytes.view()});
  EXPECT_LT(mha_test::rel_error(b, ref.output), 1e-5);
}

// The validator never reads data (the fuzzers hand it views of storage that does not exist):
// keys and values with head counts of their own are repeated by materialise_inputs, not by it.
TEST(Validation, ValidatorReadsNoDataWhenKeyAndValueHeadCountsDiffer) {
  void* const nowhere = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never mapped
  const mha::TensorView q(nowhere, mha::DType::f32, {2, 8, 5, 16});
  const mha::TensorView k(nowhere, mha::DType::f32, {2, 2, 7, 16}), v(nowhere, mha::DType::f32, {2, 4, 7, 16});
  const auto p = mha::detail::make_sdpa_problem(q, k, v, {.enable_gqa = true}, mha::detail::InputDtypes::fused);
  EXPECT_EQ(p.heads_kv, 4);
  EXPECT_EQ(p.k.size(1), 4);
}

// Windows on sequences near the int64 limit (views of storage that does not exist, as the fuzzers
// pass them): the offsets saturate, no overflow (the sanitizer build found Lq + Lk overflowing);
// a side as long as the longer sequence is no bound.
TEST(Validation, WindowOffsetsOfSequencesNearTheInt64Limit) {
  void* const nowhere = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never mapped
  const int64_t huge = std::numeric_limits<int64_t>::max() - 1;
  const mha::TensorView q(nowhere, mha::DType::f32, {1, 1, 3, 1}), k(nowhere, mha::DType::f32, {1, 1, huge, 1});
  for (const auto alignment : {mha::CausalAlignment::TopLeft, mha::CausalAlignment::BottomRight}) {
    for (const int64_t side : {int64_t{3}, huge - 1, huge}) {
      const mha::SdpaOptions o{.causal_alignment = alignment, .window_left = side, .window_right = side};
      const auto p = mha::detail::make_sdpa_problem(q, k, k, o, mha::detail::InputDtypes::fused);
      const auto pq = mha::detail::make_sdpa_problem(k, q, q, o, mha::detail::InputDtypes::fused);  // Lq huge
      EXPECT_EQ(p.causal, side < huge);  // (huge: no bound)
      EXPECT_EQ(pq.windowed, side < huge);
      if (side < huge) {
        EXPECT_GT(p.causal_offset, 0);      // Lk - Lq + side: saturated, not wrapped to negative
        EXPECT_LT(pq.window_offset, 0);     // (Lk - Lq or 0) - side: saturated, not wrapped to positive
      }
    }
  }
}

// Calls without heads: empty results and gradients, float64 included (whose backward divided by
// the zero key/value head count).
TEST(Validation, CallsWithoutHeadsGiveEmptyGradients) {
  for (const mha::DType dtype : {mha::DType::f32, mha::DType::f64}) {
    const mha::Tensor q = mha::Tensor::empty({2, 0, 5, 8}, dtype), k = mha::Tensor::empty({2, 0, 6, 8}, dtype);
    const auto saved = mha::scaled_dot_product_attention_for_training(q, k, k, {.enable_gqa = true});
    const auto g = mha::scaled_dot_product_attention_backward(q, k, k, saved, saved.output, {.enable_gqa = true});
    EXPECT_EQ(g.query.numel(), 0);
    EXPECT_EQ(g.key.numel(), 0);
  }
}

}  // namespace
