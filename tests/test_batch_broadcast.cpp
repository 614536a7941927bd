// Batch dimensions broadcast as in PyTorch: a call whose q, k, v and mask broadcast (fewer
// dimensions, size-1 dimensions, up to 6-D) must give what the same call gives on inputs
// materialised to the full batch shape, and a broadcast input's gradient must be the full one
// summed over the dimensions it broadcasts along. The materialised call runs the float64
// reference; the sums here are written independently of the library's.
#include <random>
#include <utility>
#include <vector>

#include "core/batch_dims.hpp"
#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::rel_error;

// The view of t ([..., rows, cols]) expanded to batch + [rows, cols]: stride 0 where it broadcasts.
mha::TensorView expanded(const mha::TensorView& t, const mha::Shape& batch) {
  mha::Shape shape = batch, strides(batch.size() + 2, 0);
  shape.push_back(t.size(-2));
  shape.push_back(t.size(-1));
  const int n = static_cast<int>(batch.size()), tb = t.ndim - 2;
  for (int i = 0; i < n; ++i) {
    const int ti = i - (n - tb);
    if (ti >= 0 && t.shape[ti] != 1) strides[i] = t.strides[ti];
  }
  strides[n] = t.strides[t.ndim - 2];
  strides[n + 1] = t.strides[t.ndim - 1];
  return mha::TensorView(t.data, t.dtype, shape, strides);
}

// full (float64, contiguous) summed over the dimensions `shape` broadcasts along, element by
// element through multi-indices.
mha::Tensor summed_to(const mha::Tensor& full, const mha::Shape& shape) {
  mha::Tensor r = mha::Tensor::zeros(shape, mha::DType::f64);
  const mha::Shape fs = full.sizes();
  const size_t n = fs.size(), m = shape.size();
  std::vector<int64_t> idx(n, 0);
  for (int64_t e = 0; e < full.numel(); ++e) {
    int64_t off = 0;
    for (size_t d = 0; d < m; ++d) {
      const int64_t i = shape[d] == 1 ? 0 : idx[n - m + d];
      off = off * shape[d] + i;
    }
    r.data<double>()[off] += full.data<double>()[e];
    for (size_t d = n; d-- > 0;) {
      if (++idx[d] < fs[d]) break;
      idx[d] = 0;
    }
  }
  return r;
}

// A random shape for one input: its batch dimensions are a suffix of `batch` (some leading ones
// dropped), each kept or set to 1.
mha::Shape broadcast_form(const mha::Shape& batch, int64_t rows, int64_t cols, std::mt19937_64& rng, bool heads_kept) {
  const size_t drop = std::uniform_int_distribution<size_t>(0, batch.size())(rng);
  mha::Shape s;
  for (size_t i = drop; i < batch.size(); ++i) {
    const bool last = i + 1 == batch.size();
    s.push_back((last && heads_kept) || rng() % 2 ? batch[i] : 1);
  }
  s.push_back(rows);
  s.push_back(cols);
  return s;
}

mha::Shape with_tail(mha::Shape batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

}  // namespace

TEST(BatchBroadcast, MatchesMaterialisedInputsForwardAndBackward) {
  std::mt19937_64 rng(mha_test::test_seed());
  for (int trial = 0; trial < 40; ++trial) {
    const mha::DType dtype = trial % 4 == 3 ? mha::DType::bf16 : mha::DType::f32;
    // Full batch shape: 0 to 3 leading dimensions, then the heads.
    const int lead = static_cast<int>(rng() % 4);
    mha::Shape batch;
    for (int i = 0; i < lead; ++i) batch.push_back(1 + static_cast<int64_t>(rng() % 3));
    const int64_t heads = 1 + static_cast<int64_t>(rng() % 4);
    batch.push_back(heads);
    const bool gqa = heads % 2 == 0 && rng() % 3 == 0;
    const int64_t heads_kv = gqa ? heads / 2 : heads;
    mha::Shape kv_batch = batch;
    kv_batch.back() = heads_kv;
    const int64_t L = 1 + static_cast<int64_t>(rng() % 20), S = 1 + static_cast<int64_t>(rng() % 20);
    const int64_t D = 1 + static_cast<int64_t>(rng() % 24), Dv = 1 + static_cast<int64_t>(rng() % 24);

    mha::Shape qs = broadcast_form(batch, L, D, rng, gqa || rng() % 2 == 0);
    if (gqa && qs.size() < 3) qs.insert(qs.begin(), heads);  // grouped: the query shows its heads
    // Keys and values broadcast their own leading dimensions; their heads are all kept (grouped
    // attention) or, without it, kept or 1 each.
    const mha::Shape ks = broadcast_form(kv_batch, S, D, rng, gqa || rng() % 2 == 0);
    mha::Shape vs = broadcast_form(kv_batch, S, Dv, rng, gqa || rng() % 2 == 0);
    if (gqa) {  // the same head count for both: it must show in both shapes
      if (ks.size() < 3) continue;
      if (vs.size() < 3) vs.insert(vs.begin(), heads_kv);
    }
    const mha::Tensor q = randn(qs, rng, dtype), k = randn(ks, rng, dtype), v = randn(vs, rng, dtype);
    // The full batch shape is what the three give together (a dimension none keeps is 1).
    auto full_of = [&](const mha::Shape& b) {
      mha::Shape f = b;
      const size_t n = f.size();
      for (size_t i = 0; i < n; ++i) {
        int64_t size = 1;
        for (const mha::Shape* s : {&std::as_const(qs), &ks, &std::as_const(vs)}) {
          const int64_t si = static_cast<int64_t>(i) - static_cast<int64_t>(n) + static_cast<int64_t>(s->size()) - 2;
          if (si >= 0) size = std::max(size, (*s)[si]);
        }
        f[i] = i + 1 == n && gqa ? b[i] : size;
      }
      return f;
    };
    mha::Shape out_batch = full_of(batch);
    out_batch.back() = gqa ? heads : std::max({qs.size() > 2 ? qs[qs.size() - 3] : 1, ks.size() > 2 ? ks[ks.size() - 3] : 1,
                                                vs.size() > 2 ? vs[vs.size() - 3] : 1});
    mha::Shape out_kv_batch = out_batch;
    const int64_t kv_heads_seen = std::max(ks.size() > 2 ? ks[ks.size() - 3] : 1, vs.size() > 2 ? vs[vs.size() - 3] : 1);
    out_kv_batch.back() = gqa ? heads_kv : (kv_heads_seen == 1 ? 1 : out_batch.back());
    // The output has as many batch dimensions as the input with the most.
    const size_t rank = std::max({qs.size(), ks.size(), vs.size()}) - 2;
    out_batch.erase(out_batch.begin(), out_batch.end() - static_cast<std::ptrdiff_t>(rank));
    out_kv_batch.erase(out_kv_batch.begin(), out_kv_batch.end() - static_cast<std::ptrdiff_t>(rank));

    mha::SdpaOptions o{.is_causal = rng() % 3 == 0, .enable_gqa = gqa};
    mha::Tensor mask;
    if (rng() % 2) {
      mha::Shape ms = broadcast_form(out_batch, L, S, rng, rng() % 2 == 0);
      if (rng() % 2) ms[ms.size() - 2] = 1;  // a key padding mask
      mask = randn(ms, rng);
      o.attn_mask = mask.view();
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": q " + q.shape_str() + " k " + k.shape_str() + " v " +
                 v.shape_str() + (mask.defined() ? " mask " + mask.shape_str() : "") + (gqa ? " gqa" : "") +
                 (dtype == mha::DType::bf16 ? " bf16" : ""));

    // The call as given: output, then every gradient.
    const mha::AttentionForTraining saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
    ASSERT_EQ(saved.output.sizes(), with_tail(out_batch, L, Dv));
    const mha::Tensor grad = randn(saved.output.sizes(), rng, dtype);
    const mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(
        q, k, v, saved, grad, o, mha::SdpaGradientsWanted{.attn_mask = mask.defined()});

    // The same call on materialised inputs, in float64.
    const mha::Tensor qf = mha::Tensor::copy_of(expanded(q, out_batch), mha::DType::f64);
    const mha::Tensor kf = mha::Tensor::copy_of(expanded(k, out_kv_batch), mha::DType::f64);
    const mha::Tensor vf = mha::Tensor::copy_of(expanded(v, out_kv_batch), mha::DType::f64);
    mha::SdpaOptions of = o;
    mha::Tensor mf;
    if (mask.defined()) {
      mf = mha::Tensor::copy_of(expanded(mask, out_batch));
      of.attn_mask = mf.view();
    }
    const mha::reference::Result r = mha::reference::scaled_dot_product_attention(qf, kf, vf, of);
    const mha::reference::Gradients rg = mha::reference::scaled_dot_product_attention_backward(qf, kf, vf, grad, of);

    // float32: a few roundings per term (about 1e-6 of the largest value); bfloat16: the output
    // rounded to 8 bits (2^-9 relative) from float32 arithmetic on exact inputs (P to bfloat16 too
    // for AVX512-BF16's pairs). Either of the larger of the largest output and its terms' size.
    const double tol = dtype == mha::DType::f32 ? 2e-5 : 1e-2;
    const double terms = mha_test::terms_magnitude(qf, kf, vf, of);
    EXPECT_LT(rel_error(saved.output, r.output, terms), tol);
    EXPECT_EQ(g.query.dtype(), dtype);
    if (dtype == mha::DType::f32) {
      EXPECT_LT(rel_error(g.query, summed_to(rg.query, qs), 1.0), tol);
      EXPECT_LT(rel_error(g.key, summed_to(rg.key, ks), 1.0), tol);
      EXPECT_LT(rel_error(g.value, summed_to(rg.value, vs), 1.0), tol);
      if (mask.defined()) EXPECT_LT(rel_error(*g.attn_mask, summed_to(rg.attn_mask, mask.sizes()), 1.0), tol);
    } else {
      // bfloat16 gradients: those of the float32 call on widened inputs (judged above, in other
      // trials), rounded once. Not against float64: D = rowsum(dO O) takes the rounded output, as
      // PyTorch's does, and gradients that cancel keep that rounding.
      auto wide = [](const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); };
      const mha::AttentionForTraining saved32{wide(saved.output), saved.lse};
      const mha::AttentionGradients g32 = mha::scaled_dot_product_attention_backward(
          wide(q), wide(k), wide(v), saved32, wide(grad), o, mha::SdpaGradientsWanted{.attn_mask = mask.defined()});
      if (mha_test::tile_unit_backward(dtype, L, S, D, Dv, mask.defined())) {  // within bfloat16 rounding there
        mha_test::expect_near_float32_path(g, g32);
      } else {
        EXPECT_TRUE(mha_test::same_bits(g.query, mha::Tensor::copy_of(g32.query, dtype)));
        EXPECT_TRUE(mha_test::same_bits(g.key, mha::Tensor::copy_of(g32.key, dtype)));
        EXPECT_TRUE(mha_test::same_bits(g.value, mha::Tensor::copy_of(g32.value, dtype)));
        if (mask.defined()) EXPECT_TRUE(mha_test::same_bits(*g.attn_mask, *g32.attn_mask));
      }
    }

    // The plain forward and the weights agree with the training forward's output.
    EXPECT_LT(rel_error(mha::scaled_dot_product_attention(q, k, v, o), r.output, terms), tol);
    const mha::AttentionWithWeights w = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    EXPECT_LT(rel_error(w.weights, r.weights), tol);
  }
}

TEST(BatchBroadcast, LeadingDimensionsThatDoNotFoldAreCopied) {
  std::mt19937_64 rng(mha_test::test_seed());
  // q [2, 3, 4, L, D]; k, v [2, 1, 4, S, D] (broadcast along the middle dimension: strides that
  // do not fold into one); the output written into a view whose leading dimensions are permuted.
  const mha::Tensor q = randn({2, 3, 4, 9, 16}, rng), k = randn({2, 1, 4, 11, 16}, rng), v = randn({2, 1, 4, 11, 8}, rng);
  const mha::Tensor qf = mha::Tensor::copy_of(q, mha::DType::f64);
  const mha::Tensor kf = mha::Tensor::copy_of(expanded(k, {2, 3, 4}), mha::DType::f64);
  const mha::Tensor vf = mha::Tensor::copy_of(expanded(v, {2, 3, 4}), mha::DType::f64);
  // A float mask [2, 1, 4, 9, 11], which does not fold either.
  const mha::Tensor mask = randn({2, 1, 4, 9, 11}, rng);
  const mha::Tensor mf = mha::Tensor::copy_of(expanded(mask, {2, 3, 4}));
  const mha::reference::Result r =
      mha::reference::scaled_dot_product_attention(qf, kf, vf, {.attn_mask = mf.view(), .is_causal = true});
  const mha::SdpaOptions o{.attn_mask = mask.view(), .is_causal = true};
  mha::Tensor storage = mha::Tensor::zeros({3, 2, 4, 9, 8});
  const mha::TensorView out = storage.view().transpose(0, 1);  // [2, 3, 4, 9, 8], leading strides swapped
  mha::scaled_dot_product_attention_into(q, k, v, out, o);
  EXPECT_LT(rel_error(mha::Tensor::copy_of(out), r.output), 1e-5);
  // A query given the same way (permuted leading dimensions) reads through a copy too.
  mha::Tensor q_storage = mha::Tensor::copy_of(q.view().transpose(0, 1));  // [3, 2, 4, 9, 16]
  const mha::Tensor o2 = mha::scaled_dot_product_attention(q_storage.view().transpose(0, 1), k, v, o);
  EXPECT_LT(rel_error(o2, r.output), 1e-5);
}

// An empty query (L = 0) may carry any strides: a leading stride near 2^63 must not overflow
// while checking whether the leading dimensions fold (found by fuzz_validation under UBSan).
TEST(BatchBroadcast, AbsurdStridesOfAnEmptyInputDoNotOverflow) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor k = randn({2, 3, 4, 5, 8}, rng), v = randn({2, 3, 4, 5, 8}, rng);
  float storage[1] = {0.0f};
  const mha::TensorView q(storage, mha::DType::f32, {2, 3, 4, 0, 8}, {1, int64_t{1} << 62, 1, 8, 1});
  const mha::Tensor out = mha::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.sizes(), (mha::Shape{2, 3, 4, 0, 8}));
}

// sum_to_shape, which reduces every gradient of a broadcast input or mask: float32 sums in one
// fixed order (each target element adds its terms in the order of their indices), so the bits are
// those of a plain element-by-element loop on any thread count; and within float32 rounding of the
// float64 sums. Shapes that reduce leading, middle and several dimensions (a mask [1, H, L, S] or
// [B, 1, 1, S] against [B, H, L, S] scores), a strided source, a kept last dimension of size 1,
// an empty one.
TEST(SumToShape, FixedOrderOnAnyThreadCount) {
  std::mt19937_64 rng(mha_test::test_seed());
  struct Case {
    mha::Shape full, target;
  };
  const Case cases[] = {{{4, 3, 37, 50}, {1, 3, 37, 50}}, {{4, 3, 37, 50}, {4, 1, 1, 50}},
                        {{4, 3, 37, 50}, {37, 50}},       {{2, 3, 5, 7, 33}, {3, 1, 7, 33}},
                        {{6, 9, 1}, {1, 9, 1}},           {{5, 1, 17}, {17}},
                        {{3, 0, 16}, {1, 0, 16}},         {{3, 4, 0, 16}, {4, 1, 16}},
                        {{300, 70, 2}, {70, 2}}};
  for (const Case& c : cases) {
    for (const bool strided : {false, true}) {
      SCOPED_TRACE(mha::Tensor::empty(c.full).shape_str() + " to " + mha::Tensor::empty(c.target).shape_str() +
                   (strided ? ", strided" : ""));
      // A strided source: the leading dimension of a tensor twice as long, every other entry.
      mha::Shape storage_shape = c.full;
      if (strided) storage_shape[0] *= 2;
      const mha::Tensor storage = randn(storage_shape, rng);
      const mha::TensorView dense_view = storage.view();
      mha::Shape strides(dense_view.strides.begin(), dense_view.strides.begin() + dense_view.ndim);
      strides[0] *= 2;
      const mha::TensorView full = strided ? mha::TensorView(dense_view.data, mha::DType::f32, c.full, strides)
                                           : storage.view();
      // The expected bits: float sums element by element in index order.
      mha::Tensor expected = mha::Tensor::zeros(c.target);
      mha::Tensor exact = mha::Tensor::zeros(c.target, mha::DType::f64);
      const size_t n = c.full.size(), m = c.target.size();
      std::vector<int64_t> idx(n, 0);
      const mha::Tensor dense = mha::Tensor::copy_of(full);
      for (int64_t e = 0; e < dense.numel(); ++e) {
        int64_t off = 0;
        for (size_t d = 0; d < m; ++d) off = off * c.target[d] + (c.target[d] == 1 ? 0 : idx[n - m + d]);
        expected.data<float>()[off] += dense.data<float>()[e];
        exact.data<double>()[off] += dense.data<float>()[e];
        for (size_t d = n; d-- > 0;) {
          if (++idx[d] < c.full[d]) break;
          idx[d] = 0;
        }
      }
      for (const int threads : {1, 3}) {
        const mha::Tensor got = mha::detail::sum_to_shape(full, c.target, mha::DType::f32, threads);
        EXPECT_EQ(got.sizes(), c.target);
        EXPECT_TRUE(mha_test::same_bits(got, expected)) << threads << " threads";
        // float32 sums of up to 300 terms of |x| < ~5: within 1e-5 of the largest
        EXPECT_LT(rel_error(got, exact), 1e-5) << threads << " threads";
      }
      const mha::Tensor wide = mha::detail::sum_to_shape(full, c.target, mha::DType::f64, 3);  // summed in float64
      EXPECT_LT(rel_error(wide, exact), 1e-12);
    }
  }
}
