// MultiheadAttention in bfloat16 and float16: the forward against the float64 module reference
// (with the module's own rounded parameters), the few-row projections on 16-bit weights, the
// forward and backward bit for bit against the float32 module on widened copies, conversion with
// to(), state dicts and the errors.
// Fresh seed each run (printed; MHA_TEST_SEED replays).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <random>
#include <vector>
#include <string>

#include "cpu/amx.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/few_rows_gemm.hpp"
#include "module/onednn_matmul.hpp"
#include "module/linear.hpp"
#include "module/parameter_set.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::expect_error;
using mha_test::max_abs;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;
using mha_test::test_seed;

// Unit roundoff: half the spacing of the format's numbers in [1, 2).
double unit_roundoff(mha::DType t) { return t == mha::DType::bf16 ? 0x1p-8 : 0x1p-11; }

// Half the spacing of the format's subnormals: the rounding error of a result below the normal
// range is up to this in absolute terms, not u relative (a float16 module with E=1 and tiny
// weights can put every output near 3e-5, where float16 spacing is 2^-24).
double subnormal_roundoff(mha::DType t) { return t == mha::DType::bf16 ? 0x1p-134 : 0x1p-25; }

mha::Tensor widened(const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); }

TEST(ModuleLowPrecision, ForwardAgainstFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  for (int n = 0; n < 80; ++n) {
    const mha::DType dtype = coin(0.5) ? mha::DType::bf16 : mha::DType::f16;
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
    const int64_t N = pick(1, 3), L = pick(1, 24), S = cross ? pick(1, 24) : L;
    auto shape = [&](int64_t len, int64_t width) -> mha::Shape {
      if (!batched) return {len, width};
      return o.batch_first ? mha::Shape{N, len, width} : mha::Shape{len, N, width};
    };
    const mha::Tensor query = randn(shape(L, E), rng, dtype);
    const mha::Tensor key = cross ? randn(shape(S, m.kdim()), rng, dtype) : query;
    const mha::Tensor value = cross ? randn(shape(S, m.vdim()), rng, dtype) : query;
    mha::ForwardOptions f;
    f.need_weights = coin(0.6);
    f.average_attn_weights = coin(0.5);
    f.is_causal = coin(0.2);
    if (training) f.dropout_seed = rng();
    mha::Tensor attn_mask, kpm;
    const int mask_kind = static_cast<int>(pick(0, 3));  // none, bool, float32, the module's dtype
    if (mask_kind > 0) {
      const mha::Shape ms = coin(0.5) ? mha::Shape{L, S} : mha::Shape{(batched ? N : 1) * H, L, S};
      if (mask_kind == 1) {
        attn_mask = mha::Tensor::empty(ms, mha::DType::boolean);
        for (int64_t i = 0; i < attn_mask.numel(); ++i) attn_mask.data<bool>()[i] = coin(0.2);  // true: masked
      } else {
        attn_mask = randn(ms, rng, mask_kind == 2 ? mha::DType::f32 : dtype);
      }
      f.attn_mask = attn_mask.view();
    }
    if (coin(0.5)) {
      kpm = randn(batched ? mha::Shape{N, S} : mha::Shape{S}, rng, coin(0.5) ? dtype : mha::DType::f32);
      f.key_padding_mask = kpm.view();
    }
    SCOPED_TRACE("case " + std::to_string(n) + ": " + std::string(mha::dtype_name(dtype)) + " E=" + std::to_string(E) +
                 " H=" + std::to_string(H) + " L=" + std::to_string(L) + " S=" + std::to_string(S) +
                 " cross=" + std::to_string(cross) + " bias_kv=" + std::to_string(o.add_bias_kv) +
                 " zero_attn=" + std::to_string(o.add_zero_attn) + " mask=" + std::to_string(mask_kind) +
                 " causal=" + std::to_string(f.is_causal) + " training=" + std::to_string(training));
    const mha::ForwardResult ours = m.forward(query, key, value, f);
    const mha::ForwardResult ref = mha::reference::multihead_attention(m, query, key, value, f, training);
    EXPECT_EQ(ours.output.dtype(), dtype);
    // Everything is computed in float32 and rounded once at the end: the error is that rounding
    // (at most u relative to each value, so to the largest, or half a subnormal spacing) plus the
    // float32 error (< 1e-5).
    auto tol = [&](const mha::TensorView& r) {
      return unit_roundoff(dtype) + 1e-5 + subnormal_roundoff(dtype) / std::max(max_abs(r), 1e-300);
    };
    EXPECT_LT(rel_error(ours.output, ref.output), tol(ref.output));
    ASSERT_EQ(ours.weights.has_value(), f.need_weights);
    if (f.need_weights) {
      EXPECT_EQ(ours.weights->dtype(), dtype);
      EXPECT_LT(rel_error(*ours.weights, *ref.weights), tol(*ref.weights));
    }
  }
}

// Up to 64 rows (decoding steps) project against the 16-bit weights as they are (few_rows_gemm),
// on every ISA this CPU runs: each output against a float64 sum of the same products, for row
// counts around its groups of four and weight rows across its blocks of 64. float32 sums of k
// terms are within k * 2^-24 of sum |x w| (a loose bound; summing in 16 lanes and then across
// them is far tighter).
TEST(ModuleLowPrecision, FewRowsReadSixteenBitWeightsOnEveryIsa) {
  std::mt19937_64 rng(test_seed());
  for (const mha::detail::Isa isa : mha::detail::supported_isas()) {
    for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
      for (const int64_t k : {1, 15, 16, 17, 100, 1024}) {
        static const int kRows[] = {1, 2, 3, 4, 5, 6, 7, 9, 64};
        const int rows = kRows[rng() % std::size(kRows)];
        const int64_t n = 150, stride = k + 3;  // rows of the weight 3 elements apart
        const mha::Tensor w = randn({n, stride}, rng, dtype), x = randn({rows, k}, rng);
        mha::Tensor y = randn({rows, n}, rng);
        const mha::Tensor y0 = y.clone();
        std::vector<const float*> x_rows(rows);
        std::vector<float*> y_rows(rows);
        for (int r = 0; r < rows; ++r) x_rows[r] = x.data<float>() + r * k, y_rows[r] = y.data<float>() + r * n;
        mha::detail::FewRowsGemm g;
        g.rows = rows;
        g.x = x_rows.data();
        g.y = y_rows.data();
        g.w = static_cast<const uint16_t*>(w.view().data);
        g.w_row_stride = stride;
        g.w_dtype = dtype;
        g.k = k;
        mha::detail::few_rows_gemm(isa, g, 0, 20);  // column ranges, as tasks would take them
        mha::detail::few_rows_gemm(isa, g, 20, n);
        const mha::Tensor w64 = mha::Tensor::copy_of(w, mha::DType::f64);
        for (int r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < n; ++j) {
            double sum = y0.data<float>()[r * n + j], magnitude = std::abs(sum);
            for (int64_t i = 0; i < k; ++i) {
              const double p = static_cast<double>(x.data<float>()[r * k + i]) * w64.data<double>()[j * stride + i];
              sum += p;
              magnitude += std::abs(p);
            }
            ASSERT_NEAR(y.data<float>()[r * n + j], sum, (k + 1) * 0x1p-24 * magnitude)
                << mha::detail::isa_name(isa) << " " << mha::dtype_name(dtype) << " k=" << k << " row " << r << " col " << j;
          }
        }
      }
    }
    // Through the module: 1 to 64 query rows (and 65, through sgemm), self- and cross-attention,
    // against the reference.
    for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
      for (const auto& [L, N] : {std::pair<int64_t, int64_t>{1, 1}, {1, 4}, {2, 2}, {4, 1}, {3, 3}, {16, 4}, {13, 5}}) {
        mha::detail::force_isa(isa);
        mha::MultiheadAttention m(48, 4, {.add_bias_kv = true, .seed = rng(), .dtype = dtype});
        m.eval();
        const mha::Tensor q = randn({L, N, 48}, rng, dtype), kv = randn({9, N, 48}, rng, dtype);
        for (const bool self : {true, false}) {
          const mha::TensorView key = self ? q.view() : kv.view();
          const auto ours = m.forward(q, key, key);
          const auto ref = mha::reference::multihead_attention(m, q, key, key, {}, false);
          const double tol = unit_roundoff(dtype) + 1e-5 + subnormal_roundoff(dtype) / max_abs(ref.output);
          EXPECT_LT(rel_error(ours.output, ref.output), tol)
              << mha::detail::isa_name(isa) << " " << mha::dtype_name(dtype) << " L=" << L << " N=" << N << " self=" << self;
        }
        mha::detail::force_isa(std::nullopt);
      }
    }
  }
}

// Parameters a bfloat16/float16 call is given (forward_with) reach linear() in their own dtype
// whatever their layout: a weight stored transposed is compacted, not widened, so that it takes
// the path the same weight stored contiguously takes (few_rows_gemm up to 64 rows, sgemm on a
// widened copy beyond), and the results do not depend on the layout. Biases are widened.
TEST(ModuleLowPrecision, GivenWeightsKeepTheirDtypeWhateverTheirLayout) {
  std::mt19937_64 rng(test_seed());
  for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
    const mha::Tensor w = randn({36, 12}, rng, dtype), bias = randn({36}, rng, dtype);
    const mha::Tensor stored_transposed = mha::Tensor::copy_of(w.view().transpose(0, 1));
    const mha::detail::NamedViews views = {{"contiguous", w.view()},
                                           {"transposed", stored_transposed.view().transpose(0, 1)},
                                           {"bias", bias.view()}};
    const mha::detail::ParameterSet as_they_are = mha::detail::float32_parameters(views, 2, true);
    for (const char* name : {"contiguous", "transposed"}) {
      const mha::TensorView& v = as_they_are.view(name);
      EXPECT_EQ(v.dtype, dtype) << name;
      EXPECT_TRUE(v.is_contiguous()) << name;
      EXPECT_TRUE(same_bits(mha::Tensor::copy_of(v), w)) << name;
    }
    EXPECT_EQ(as_they_are.view("bias").dtype, mha::DType::f32);
    const mha::detail::ParameterSet widened = mha::detail::float32_parameters(views, 2);
    for (const char* name : {"contiguous", "transposed"}) {
      EXPECT_EQ(widened.view(name).dtype, mha::DType::f32) << name;
      EXPECT_TRUE(same_bits(mha::Tensor::copy_of(widened.view(name)), mha::Tensor::copy_of(w, mha::DType::f32))) << name;
    }
  }
}

// The low-precision module is exactly the float32 module on widened parameters and inputs, with
// the results rounded once: forward (dropout stream included) and backward, bit for bit. (With
// more than 64 rows: fewer read the 16-bit weights as they are, summing in another order; the
// test above holds those to the reference. bf16 projections through oneDNN, which also sum in
// another order, are turned off here and tested below.)
TEST(ModuleLowPrecision, IsTheFloat32ModuleRoundedOnce) {
  std::mt19937_64 rng(test_seed());
  mha::detail::disable_bf16_matmul(true);
  struct Restore {
    ~Restore() { mha::detail::disable_bf16_matmul(false); }
  } restore;
  for (const mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
    for (const bool cross : {false, true}) {
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + (cross ? " cross-attention" : " self-attention"));
      mha::MultiheadAttentionOptions o{.dropout = 0.2, .add_bias_kv = true, .seed = rng(), .dtype = dtype};
      if (cross) o.kdim = 24, o.vdim = 40;
      mha::MultiheadAttention low(64, 4, o);
      mha::MultiheadAttention wide = low;
      wide.to(mha::DType::f32);
      const mha::Tensor x = randn({37, 3, 64}, rng, dtype);
      const mha::Tensor k = cross ? randn({29, 3, 24}, rng, dtype) : x, v = cross ? randn({29, 3, 40}, rng, dtype) : x;
      const mha::Tensor x32 = widened(x), k32 = cross ? widened(k) : x32, v32 = cross ? widened(v) : x32;
      const mha::Tensor mask = randn({37, k.size(0)}, rng, dtype), mask32 = widened(mask);
      for (int call = 0; call < 2; ++call) {  // two calls: the dropout stream advances alike
        mha::ForwardContext ctx_low, ctx_wide;
        const mha::ForwardResult a = low.forward(x, k, v, {.attn_mask = mask.view(), .is_causal = !cross}, &ctx_low);
        const mha::ForwardResult b = wide.forward(x32, k32, v32, {.attn_mask = mask32.view(), .is_causal = !cross}, &ctx_wide);
        EXPECT_TRUE(same_bits(a.output, mha::Tensor::copy_of(b.output, dtype))) << "output, call " << call;
        EXPECT_TRUE(same_bits(*a.weights, mha::Tensor::copy_of(*b.weights, dtype))) << "weights, call " << call;
        const mha::Tensor grad = randn(a.output.sizes(), rng, dtype);
        const mha::ModuleGradients ga = low.backward(ctx_low, grad), gb = wide.backward(ctx_wide, widened(grad));
        EXPECT_TRUE(same_bits(ga.query, mha::Tensor::copy_of(gb.query, dtype)));
        EXPECT_TRUE(same_bits(ga.key, mha::Tensor::copy_of(gb.key, dtype)));
        EXPECT_TRUE(same_bits(ga.value, mha::Tensor::copy_of(gb.value, dtype)));
        ASSERT_EQ(ga.parameters.size(), gb.parameters.size());
        for (const auto& [name, t] : ga.parameters) {
          EXPECT_EQ(t.dtype(), dtype) << name;
          EXPECT_TRUE(same_bits(t, mha::Tensor::copy_of(gb.parameter(name), dtype))) << name;
        }
      }
    }
  }
}

// bf16 projections of more than 64 rows through oneDNN's matmul (CPUs with AVX512-BF16): x W^T + b
// against float64 for inputs whose values are bfloat16, in both row orders and with row strides
// wider than the rows; the same bits on 1, 2 and 3 threads; inputs that are not bfloat16 values
// (the attention output) keep the float32 path, bit for bit; and the module through it against
// the float64 reference. Skipped where the path is not available.
TEST(ModuleLowPrecision, Bf16ProjectionsThroughOneDnn) {
  if (!mha::detail::bf16_matmul_available()) GTEST_SKIP() << "oneDNN or AVX512-BF16 not available";
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 6; ++n) {
    const int64_t N = 1 + n % 3, L = 70 + 61 * n, in = n % 2 ? 96 : 200, out = n % 3 ? 64 : 300;
    const bool seq_first = n % 2 == 1;
    SCOPED_TRACE("case " + std::to_string(n) + ": N=" + std::to_string(N) + " L=" + std::to_string(L) +
                 " in=" + std::to_string(in) + " out=" + std::to_string(out));
    const mha::Tensor w = randn({out, in + 8}, rng, mha::DType::bf16);  // rows wider than used
    const mha::TensorView wv = w.view().slice(1, 0, in);
    const mha::Tensor bias = randn({out}, rng);
    const mha::Tensor x16 = randn(seq_first ? mha::Shape{L, N, in} : mha::Shape{N, L, in}, rng, mha::DType::bf16);
    const mha::Tensor x = widened(x16);  // [L, N, in] or [N, L, in] in memory, as x16
    const mha::TensorView xv = seq_first ? x.view().transpose(0, 1) : x.view();  // [N, L, in]
    auto project = [&](const mha::TensorView& input, int threads) {
      mha::Tensor y = mha::Tensor::empty(seq_first ? mha::Shape{L, N, out} : mha::Shape{N, L, out});
      const mha::TensorView yv = seq_first ? y.view().transpose(0, 1) : y.view();
      mha::detail::linear(input, wv, bias.data<float>(), yv, threads);
      return mha::Tensor::copy_of(yv);
    };
    const mha::Tensor y = project(xv, 2);
    double worst = 0;
    for (int64_t b = 0; b < N; ++b) {
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t o = 0; o < out; o += 7) {
          double exact = bias.data<float>()[o], magnitude = std::abs(exact);
          for (int64_t c = 0; c < in; ++c) {
            const double p = static_cast<double>(x.data<float>()[b * xv.strides[0] + l * xv.strides[1] + c]) *
                             static_cast<float>(mha::bfloat16::from_bits(w.data<uint16_t>()[o * (in + 8) + c]));
            exact += p, magnitude += std::abs(p);
          }
          // float32 sums of exact products: within in * 2^-24 of the sum of magnitudes
          worst = std::max(worst, std::abs(y.data<float>()[(b * L + l) * out + o] - exact) / magnitude);
        }
      }
    }
    EXPECT_LT(worst, static_cast<double>(in) * 0x1p-24);
    EXPECT_TRUE(same_bits(project(xv, 1), y));
    EXPECT_TRUE(same_bits(project(xv, 3), y));
    // Not bfloat16 values: the float32 path, whichever way the switch is set.
    mha::Tensor rough = mha::Tensor::copy_of(xv);
    rough.data<float>()[rough.numel() / 2] += 1e-3f;
    const mha::Tensor with_path = project(rough.view(), 2);
    mha::detail::disable_bf16_matmul(true);
    const mha::Tensor without = project(rough.view(), 2);
    const mha::Tensor float32_path = project(xv, 2);
    mha::detail::disable_bf16_matmul(false);
    EXPECT_TRUE(same_bits(with_path, without));
    EXPECT_LT(rel_error(y, float32_path), static_cast<double>(in) * 0x1p-23);
  }
  // The module: in-projections of 111 rows through oneDNN, against the float64 reference.
  for (const bool cross : {false, true}) {
    mha::MultiheadAttentionOptions o{.bias = true, .batch_first = cross, .seed = rng(), .dtype = mha::DType::bf16};
    if (cross) o.kdim = 24, o.vdim = 40;
    mha::MultiheadAttention m(64, 4, o);
    const mha::Tensor q = randn({3, 37, 64}, rng, mha::DType::bf16);
    const mha::Tensor k = cross ? randn({3, 29, 24}, rng, mha::DType::bf16) : q;
    const mha::Tensor v = cross ? randn({3, 29, 40}, rng, mha::DType::bf16) : q;
    const mha::ForwardResult ours = m.forward(q, k, v, {});
    const mha::ForwardResult ref = mha::reference::multihead_attention(m, q, k, v, {}, false);
    EXPECT_LT(rel_error(ours.output, ref.output), unit_roundoff(mha::DType::bf16) + 1e-5) << "cross " << cross;
  }
}

// bfloat16 inference in bfloat16 products (module_bf16_forward.cpp, CPUs with AMX or AVX512-BF16
// and oneDNN; the attention on the tile unit or in the fused kernel's pair products): head
// dims of 32, 64 and 96, self-attention (one packed product) and cross-attention with other kdim/vdim,
// both layouts and unbatched, bool and float masks, key padding, causality. Against the float64
// module reference: the projections, the probabilities and the attention output are each rounded
// to bfloat16 on the way (as PyTorch's bf16 module rounds them), so a few units of 2^-8 reach the
// output through the softmax: 2.5e-2 of its largest value (observed about 5e-3). The path is
// taken (its bits differ from the float32 module's, which need_weights still runs, bit for bit),
// its bits do not depend on the thread count, and parameters given through forward_with in other
// layouts (transposed storage, strided biases) give the same bits.
// A weight packed in slices by our own code (cpu/weight_packing.hpp, on any threads) holds the
// bytes of oneDNN's reorder, padding included, for the bfloat16 blocks of the tile unit and the
// float32 blocks of AVX-512: k and columns off the layouts' blocks (32 or 16, and 64), rows of b
// wider than k, an odd k or row stride (bfloat16 pairs split across rows) and even ones.
TEST(ModuleLowPrecision, WeightSlicesMatchOneDnnsPacking) {
  if (!mha::detail::f32_matmul_available()) GTEST_SKIP() << "no oneDNN or AVX-512 here";
  std::mt19937_64 rng(test_seed());
  const int64_t shapes[][3] = {{256, 1024, 1024}, {37, 100, 40}, {64, 64, 32}, {300, 200, 72}, {5, 7, 3}, {20, 130, 37}};
  for (const auto output : {mha::detail::MatmulOutput::bf16_plus_bias, mha::detail::MatmulOutput::f32_plus_bias}) {
    const bool bf16 = output == mha::detail::MatmulOutput::bf16_plus_bias;
    if (bf16 && !mha::detail::bf16_matmul_available()) continue;  // (f32 still runs)
    for (size_t n = 0; n < std::size(shapes); ++n) {
      const auto& shape = shapes[n];
      // Even rows (bfloat16 pairs whole: the transposing path) and odd ones (the scalar path).
      const int64_t rows = shape[0], cols = shape[1], k = shape[2], ldb = k + (n % 2 ? 5 : 6);
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "f32") + " rows " + std::to_string(rows) + " cols " +
                   std::to_string(cols) + " k " + std::to_string(k));
      const mha::Tensor b = randn({cols, ldb}, rng, bf16 ? mha::DType::bf16 : mha::DType::f32);
      const mha::detail::MatmulBlock block(rows, cols, k, k, ldb, cols, output);
      ASSERT_GT(block.pack_slices(), 0) << "the kernel chose another weight layout";
      EXPECT_EQ(block.pack_slices(), (cols + 63) / 64);
      std::vector<uint8_t> by_onednn(block.packed_bytes(), 0xab), by_slices(block.packed_bytes(), 0x12);
      block.pack(b.view().data, by_onednn.data());
      for (int64_t s = block.pack_slices() - 1; s >= 0; --s) block.pack_slice(b.view().data, by_slices.data(), s);
      EXPECT_EQ(by_onednn, by_slices);
    }
  }
}

// Case n of the bfloat16-products tests: query, key and value of module m (self-attention, or
// cross-attention; [N,] len, width in the module's layout, or unbatched), and the case's masks:
// a bool attn_mask (n % 3 == 2) or a bfloat16 one (n % 4 == 1), padded key tails (batched, even
// n), causal (self-attention, n % 3 == 0). Weights not returned.
struct Bf16Case {
  mha::Tensor query, key, value, attn_mask, key_padding_mask;
  mha::ForwardOptions options{.need_weights = false};
};
Bf16Case bf16_case(const mha::MultiheadAttention& m, int n, int64_t N, int64_t L, int64_t S, bool cross, bool batched,
                   std::mt19937_64& rng) {
  auto shape = [&](int64_t len, int64_t width) -> mha::Shape {
    if (!batched) return {len, width};
    return m.options().batch_first ? mha::Shape{N, len, width} : mha::Shape{len, N, width};
  };
  Bf16Case c;
  c.query = randn(shape(L, m.embed_dim()), rng, mha::DType::bf16);
  c.key = cross ? randn(shape(S, m.kdim()), rng, mha::DType::bf16) : c.query;
  c.value = cross ? randn(shape(S, m.vdim()), rng, mha::DType::bf16) : c.query;
  c.options.is_causal = !cross && n % 3 == 0;
  if (n % 3 == 2) {
    c.attn_mask = mha::Tensor::empty({L, S}, mha::DType::boolean);
    for (int64_t i = 0; i < c.attn_mask.numel(); ++i)
      c.attn_mask.data<bool>()[i] = std::bernoulli_distribution(0.2)(rng) && i % S != 0;
    c.options.attn_mask = c.attn_mask.view();
  } else if (n % 4 == 1) {
    c.attn_mask = randn({L, S}, rng, mha::DType::bf16);
    c.options.attn_mask = c.attn_mask.view();
  }
  if (batched && n % 2 == 0) {
    c.key_padding_mask = mha::Tensor::zeros({N, S}, mha::DType::boolean);
    for (int64_t b = 0; b < N; ++b)
      for (int64_t j = S - b * 5; j < S; ++j) c.key_padding_mask.data<bool>()[b * S + j] = true;  // padded tails
    c.options.key_padding_mask = c.key_padding_mask.view();
  }
  return c;
}

TEST(ModuleLowPrecision, Bf16InferenceInBfloat16Products) {
  const bool products = mha::detail::amx_usable() || mha::detail::active_isa() == mha::detail::Isa::avx512_bf16;
  if (!products || !mha::detail::bf16_matmul_available()) GTEST_SKIP() << "no AMX or AVX512-BF16, or no oneDNN here";
  std::mt19937_64 rng(test_seed());
  double worst = 0;
  for (int n = 0; n < 12; ++n) {
    // E = 640 in one case: the out-projection, alone in its call, in two parts of 320 columns
    // written through a block's own buffer (linear.cpp), the weight's 64-column slices ragged,
    // over 300 rows (blocks of 256 rows and a last of 44).
    const int64_t H = n % 2 == 0 ? 4 : 2, E = n == 6 ? 640 : 128;
    const bool cross = n % 3 == 1, batched = n % 4 != 3;
    mha::MultiheadAttentionOptions o{.bias = n % 5 != 4, .batch_first = n % 2 == 1, .seed = rng(), .dtype = mha::DType::bf16};
    if (cross && n % 2 == 0) o.kdim = 48, o.vdim = 80;
    mha::MultiheadAttention m(E, H, o);
    m.eval();
    const int64_t N = 3, L = n == 6 ? 100 : 37 + 11 * (n % 4), S = cross ? 29 + 23 * (n % 3) : L;
    Bf16Case in = bf16_case(m, n, N, L, S, cross, batched, rng);
    const mha::Tensor &query = in.query, &key = in.key, &value = in.value;
    mha::ForwardOptions& f = in.options;
    SCOPED_TRACE("case " + std::to_string(n) + ": H=" + std::to_string(H) + " L=" + std::to_string(L) + " S=" +
                 std::to_string(S) + " cross=" + std::to_string(cross) + " batched=" + std::to_string(batched) +
                 " batch_first=" + std::to_string(o.batch_first) + " causal=" + std::to_string(f.is_causal));
    f.num_threads = 2;
    const mha::ForwardResult ours = m.forward(query, key, value, f);
    const mha::ForwardResult ref = mha::reference::multihead_attention(m, query, key, value, f, false);
    EXPECT_EQ(ours.output.dtype(), mha::DType::bf16);
    EXPECT_EQ(ours.output.sizes(), ref.output.sizes());
    EXPECT_LT(rel_error(ours.output, ref.output), 2.5e-2);
    worst = std::max(worst, rel_error(ours.output, ref.output));
    for (const int threads : {1, 3}) {
      f.num_threads = threads;
      EXPECT_TRUE(same_bits(m.forward(query, key, value, f).output, ours.output)) << threads << " threads";
    }
    f.num_threads = 2;
    if (n < 2) {  // parameters given as views of other layouts (copied for the matmul): the same bits
      std::vector<mha::Tensor> storage;
      mha::ParameterViews given;
      for (const auto& [name, t] : m.named_parameters()) {
        if (t.view().ndim == 2) {
          storage.push_back(mha::Tensor::copy_of(t.view().transpose(0, 1)));
          given[name] = storage.back().view().transpose(0, 1);
        } else {  // a bias, every other element of a wider buffer
          storage.push_back(mha::Tensor::zeros({2 * t.numel()}, t.dtype()));
          const mha::TensorView strided(storage.back().view().data, t.dtype(), {t.numel()}, {2});
          for (int64_t i = 0; i < t.numel(); ++i) strided.data_as<uint16_t>()[2 * i] = t.data<uint16_t>()[i];
          given[name] = strided;
        }
      }
      EXPECT_TRUE(same_bits(m.forward_with(given, query, key, value, f).output, ours.output));
    }
    mha::detail::disable_bf16_matmul(true);  // the float32 module on widened copies
    const mha::Tensor wide = m.forward(query, key, value, f).output;
    mha::detail::disable_bf16_matmul(false);
    EXPECT_FALSE(same_bits(wide, ours.output));
    EXPECT_LT(rel_error(wide, ref.output), unit_roundoff(mha::DType::bf16) + 1e-5);
    f.need_weights = true;  // (returned weights keep the float32 module)
    const mha::ForwardResult with_weights = m.forward(query, key, value, f);
    mha::detail::disable_bf16_matmul(true);
    const mha::ForwardResult with_weights_wide = m.forward(query, key, value, f);
    mha::detail::disable_bf16_matmul(false);
    EXPECT_LT(rel_error(with_weights.output, ref.output), unit_roundoff(mha::DType::bf16) + 1e-5);
    EXPECT_LT(rel_error(with_weights.output, with_weights_wide.output), 2 * unit_roundoff(mha::DType::bf16));
  }
  std::printf("bf16 module inference in bfloat16 products: largest error %.3g of the largest output\n", worst);
}

// A bfloat16 module's training (a forward that keeps a context, and its backward) on a CPU with
// bfloat16 products: each projection, the attention and every product of the backward in them,
// rounded where PyTorch's bf16 module rounds. Against the float64 module (the same rounded
// parameters and inputs, random biases): the output within 2.5e-2 of its largest value (as the
// inference above), every gradient within 2^-4 = 16u of the largest of its tensor. A gradient
// passes through up to five bfloat16 roundings (dA, the attention's dQ/dK/dV, the projections' own
// products), and dQ = dS K carries the cancellation of dP - rowsum(dA O) on rounded dA and O:
// PyTorch's bf16 module measures up to 0.034 (9u) on the query's gradient of such cases, and
// this path 0.034 too (python/tests/test_parity_grad.py holds the two side by side). Self- and
// cross-attention, masks (a float mask's
// gradient too), bias_k/bias_v and the zero key, frozen parameters, the weights returned (and a
// gradient of them, through the float64 kernel of the explicit weights); the q activation is all
// bfloat16 values (the path ran); the same bits on 1 and 3 threads; a context rebuilt from the
// activations (dropout included) gives the backward's bits.
TEST(ModuleLowPrecision, Bf16TrainingInBfloat16Products) {
  if (!mha::detail::bf16_matmul_available()) GTEST_SKIP() << "no AVX512-BF16 or AMX, or no oneDNN here";
  std::mt19937_64 rng(test_seed());
  const double tolerance = 0x1p-4;
  double worst = 0;
  for (int n = 0; n < 10; ++n) {
    const int64_t H = n % 2 == 0 ? 4 : 2, E = 64;
    const bool cross = n % 3 == 1, batched = n % 4 != 3;
    mha::MultiheadAttentionOptions o{.bias = n % 5 != 4, .add_bias_kv = n == 2, .add_zero_attn = n == 5,
                                     .batch_first = n % 2 == 1, .seed = rng(), .dtype = mha::DType::bf16};
    if (cross && n % 2 == 0) o.kdim = 24, o.vdim = 40;
    mha::MultiheadAttention m(E, H, o);
    for (const auto& [name, t] : m.named_parameters()) {  // biases random too (PyTorch's start at zero)
      if (name.find("weight") != std::string::npos) continue;
      const mha::Tensor values = randn(t.sizes(), rng, mha::DType::bf16);
      std::memcpy(t.view().data, values.view().data, static_cast<size_t>(2 * t.numel()));
    }
    const int64_t N = 2, L = 40 + 9 * (n % 4), S = cross ? 29 + 23 * (n % 3) : L;
    Bf16Case in = bf16_case(m, n, N, L, S, cross, batched, rng);
    const mha::Tensor &query = in.query, &key = in.key, &value = in.value, &attn_mask = in.attn_mask;
    mha::ForwardOptions& f = in.options;
    mha::WantedGradients wanted;
    wanted.attn_mask = attn_mask.defined() && attn_mask.dtype() != mha::DType::boolean;  // (a float mask's gradient)
    if (n % 4 == 2) wanted.frozen_parameters = {"out_proj.weight", o.bias ? "in_proj_bias" : "out_proj.weight"};
    if (n == 7) wanted.query = false;
    if (n % 5 == 3) f.need_weights = true, f.average_attn_weights = n % 2 == 0;  // (their gradient too)
    SCOPED_TRACE("case " + std::to_string(n) + ": H=" + std::to_string(H) + " L=" + std::to_string(L) + " S=" +
                 std::to_string(S) + " cross=" + std::to_string(cross) + " batched=" + std::to_string(batched) +
                 " causal=" + std::to_string(f.is_causal));
    f.num_threads = 2;
    mha::ForwardContext ctx;
    const mha::ForwardResult ours = m.forward(query, key, value, f, &ctx);
    const mha::Tensor grad = randn(ours.output.sizes(), rng, mha::DType::bf16);
    const mha::Tensor grad_weights = f.need_weights ? randn(ours.weights->sizes(), rng, mha::DType::bf16) : mha::Tensor();
    std::optional<mha::TensorView> gw;
    if (f.need_weights) gw = grad_weights.view();
    const mha::ModuleGradients g = m.backward(ctx, grad, wanted, gw);
    const mha::Tensor q_act = ctx.activations().q;  // bfloat16 values, widened: the path ran
    int64_t low_bits = 0;
    for (int64_t i = 0; i < q_act.numel(); ++i) low_bits += (std::bit_cast<uint32_t>(q_act.data<float>()[i]) & 0xffffu) != 0;
    EXPECT_EQ(low_bits, 0);

    mha::MultiheadAttention m64 = m;
    m64.to(mha::DType::f64);
    auto f64 = [](const mha::Tensor& t) { return t.defined() ? mha::Tensor::copy_of(t, mha::DType::f64) : t; };
    const mha::Tensor q64 = f64(query), k64 = cross ? f64(key) : q64, v64 = cross ? f64(value) : q64;
    const mha::Tensor mask64 = attn_mask.defined() && attn_mask.dtype() != mha::DType::boolean ? f64(attn_mask) : attn_mask;
    mha::ForwardOptions f_ref = f;
    if (mask64.defined()) f_ref.attn_mask = mask64.view();
    mha::ForwardContext ctx64;
    const mha::ForwardResult ref = m64.forward(q64, k64, v64, f_ref, &ctx64);
    const mha::Tensor grad_weights64 = f64(grad_weights);
    std::optional<mha::TensorView> gw64;
    if (f.need_weights) gw64 = grad_weights64.view();
    const mha::ModuleGradients g64 = m64.backward(ctx64, f64(grad), wanted, gw64);
    EXPECT_EQ(ours.output.dtype(), mha::DType::bf16);
    EXPECT_LT(rel_error(ours.output, ref.output), 2.5e-2);
    if (f.need_weights) {
      EXPECT_EQ(ours.weights->dtype(), mha::DType::bf16);
      EXPECT_LT(rel_error(*ours.weights, *ref.weights), 2.5e-2);
    }
    auto check = [&](const mha::Tensor& a, const mha::Tensor& r, const std::string& name, mha::DType dtype) {
      ASSERT_EQ(a.defined(), r.defined()) << name;
      if (!a.defined()) return;
      EXPECT_EQ(a.dtype(), dtype) << name;
      const double e = rel_error(a, r);
      EXPECT_LT(e, tolerance) << name;
      worst = std::max(worst, e);
    };
    check(g.query, g64.query, "query", mha::DType::bf16);
    check(g.key, g64.key, "key", mha::DType::bf16);
    check(g.value, g64.value, "value", mha::DType::bf16);
    check(g.attn_mask, g64.attn_mask, "attn_mask", mha::DType::f32);
    ASSERT_EQ(g.parameters.size(), g64.parameters.size());
    for (size_t i = 0; i < g.parameters.size(); ++i)
      check(g.parameters[i].second, g64.parameters[i].second, g.parameters[i].first, mha::DType::bf16);

    auto same = [](const mha::Tensor& a, const mha::Tensor& b) {  // (undefined: not wanted, or frozen)
      return a.defined() == b.defined() && (!a.defined() || same_bits(a, b));
    };
    auto same_gradients = [&](const mha::ModuleGradients& a, const std::string& what) {
      EXPECT_TRUE(same(a.query, g.query) && same(a.key, g.key) && same(a.value, g.value)) << what;
      EXPECT_TRUE(same(a.attn_mask, g.attn_mask)) << what;
      for (size_t i = 0; i < g.parameters.size(); ++i)
        EXPECT_TRUE(same(a.parameters[i].second, g.parameters[i].second)) << what << " " << g.parameters[i].first;
    };
    for (const int threads : {1, 3}) {
      f.num_threads = threads;
      mha::ForwardContext c;
      EXPECT_TRUE(same_bits(m.forward(query, key, value, f, &c).output, ours.output)) << threads << " threads";
      same_gradients(m.backward(c, grad, wanted, gw), std::to_string(threads) + " threads");
    }
    f.num_threads = 2;
    const mha::SavedActivations saved = ctx.activations();
    same_gradients(m.backward(m.restore_context(query, key, value, f, saved.views()), grad, wanted, gw), "restored");
  }
  // Dropout: the forward's seed reaches the rebuilt context, whose backward has the same bits.
  mha::MultiheadAttention m(64, 4, {.dropout = 0.3, .seed = rng(), .dtype = mha::DType::bf16});
  const mha::Tensor x = randn({45, 2, 64}, rng, mha::DType::bf16);
  mha::ForwardOptions f{.need_weights = false, .dropout_seed = rng()};
  mha::ForwardContext ctx;
  const mha::Tensor grad = randn(m.forward(x, x, x, f, &ctx).output.sizes(), rng, mha::DType::bf16);
  const mha::ModuleGradients g = m.backward(ctx, grad);
  const mha::ModuleGradients restored = m.backward(m.restore_context(x, x, x, f, ctx.activations().views()), grad);
  EXPECT_TRUE(same_bits(g.query, restored.query));
  for (size_t i = 0; i < g.parameters.size(); ++i)
    EXPECT_TRUE(same_bits(g.parameters[i].second, restored.parameters[i].second)) << g.parameters[i].first;
  std::printf("bf16 module training in bfloat16 products: largest gradient error %.3g of its largest value\n", worst);
}

TEST(ModuleLowPrecision, ConversionStateDictsAndErrors) {
  std::mt19937_64 rng(test_seed());
  mha::MultiheadAttention f32(32, 4, {.add_bias_kv = true, .seed = 11});
  mha::MultiheadAttention bf16 = f32;
  bf16.to(mha::DType::bf16);
  EXPECT_EQ(bf16.dtype(), mha::DType::bf16);
  for (const auto& [name, t] : bf16.named_parameters()) {
    EXPECT_EQ(t.dtype(), mha::DType::bf16) << name;
    EXPECT_TRUE(same_bits(t, mha::Tensor::copy_of(f32.parameter(name), mha::DType::bf16))) << name;
  }
  // Built in bfloat16, the initialisation is the float32 one rounded.
  const mha::MultiheadAttention built(32, 4, {.add_bias_kv = true, .seed = 11, .dtype = mha::DType::bf16});
  for (const auto& [name, t] : built.named_parameters()) EXPECT_TRUE(same_bits(t, bf16.parameter(name))) << name;
  // load_state_dict converts, as torch's does.
  mha::MultiheadAttention other(32, 4, {.add_bias_kv = true, .seed = 12, .dtype = mha::DType::f16});
  std::unordered_map<std::string, mha::TensorView> state;
  for (const auto& [name, t] : f32.named_parameters()) state[name] = t.view();
  other.load_state_dict(state);
  for (const auto& [name, t] : other.named_parameters()) {
    EXPECT_TRUE(same_bits(t, mha::Tensor::copy_of(f32.parameter(name), mha::DType::f16))) << name;
  }
  // A bfloat16 checkpoint makes a bfloat16 module.
  mha::TensorMap checkpoint;
  for (const auto& [name, t] : bf16.named_parameters()) checkpoint.emplace(name, t);
  EXPECT_EQ(mha::module_from_state_dict(checkpoint, 4).dtype(), mha::DType::bf16);
  // A float64 one a float64 module, with the weights' bits (a float32 one a float32 module).
  mha::TensorMap checkpoint64, checkpoint32;
  for (const auto& [name, t] : f32.named_parameters()) {
    mha::Tensor wide = mha::Tensor::copy_of(t, mha::DType::f64);
    for (int64_t i = 0; i < wide.numel(); ++i) wide.data<double>()[i] += 1e-12 * static_cast<double>(i % 7);
    checkpoint64.emplace(name, wide);
    checkpoint32.emplace(name, t);
  }
  const mha::MultiheadAttention from64 = mha::module_from_state_dict(checkpoint64, 4);
  EXPECT_EQ(from64.dtype(), mha::DType::f64);
  for (const auto& [name, t] : from64.named_parameters()) EXPECT_TRUE(same_bits(t, checkpoint64.at(name))) << name;
  EXPECT_EQ(mha::module_from_state_dict(checkpoint32, 4).dtype(), mha::DType::f32);

  expect_error([] { mha::MultiheadAttention(8, 2, {.dtype = mha::DType::boolean}); },
               "dtype: expected float32, float64, bfloat16 or float16");
  expect_error([&] { bf16.to(mha::DType::boolean); }, "dtype: expected float32, float64, bfloat16 or float16");
  const mha::Tensor x = randn({5, 2, 32}, rng, mha::DType::bf16), x32 = widened(x);
  expect_error([&] { bf16.forward(x32, x32, x32); }, "query: expected dtype bfloat16");
  expect_error([&] { bf16.forward(x, x, x32); }, "value: expected dtype bfloat16");
  expect_error([&] { f32.forward(x, x, x); }, "query: expected dtype float32");
  const mha::Tensor half_mask = randn({5, 5}, rng, mha::DType::f16);
  expect_error([&] { bf16.forward(x, x, x, {.attn_mask = half_mask.view()}); }, "attn_mask: expected dtype bool, float32");
  mha::ForwardContext ctx;
  const mha::ForwardResult r = bf16.forward(x, x, x, {}, &ctx);
  expect_error([&] { bf16.backward(ctx, widened(r.output)); }, "grad_output: expected dtype bfloat16");
  mha::MultiheadAttention converted = bf16;
  converted.to(mha::DType::f32);
  expect_error([&] { converted.backward(ctx, widened(r.output)); }, "context comes from a bfloat16 forward");
}

}  // namespace
