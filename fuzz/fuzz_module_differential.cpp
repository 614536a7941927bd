// Differential for the module: a small random MultiheadAttention call (float32, float64, bfloat16
// or float16) through the fused path and the float64 reference, with the inputs and the given parameters (forward_with) in fuzzed
// layouts: rows repeated by a stride of 0 (what expand() gives), overlapping rows, padded strides,
// permuted storage. The input picks the ISA, the options (bias, bias_k/bias_v, zero attention,
// kdim/vdim, batch_first, dropout), self- or cross-attention, masks, causality and threads.
// Aborts when
//   - an output, weight or gradient is NaN or infinite (the inputs are finite, |x| <= 3), or
//   - the output or the weights differ from the reference's by more than the dtype's tolerance
//     (see tolerance() below), normwise against the output's magnitude (the size of the terms it
//     sums, reference::multihead_attention's output_magnitude) and the weights' largest value, or
//   - the gradients of the call differ from those of the same call on contiguous copies of its
//     inputs by more than that.
// Every buffer sits between guards of NaN, so a read past a view shows as a non-finite value even
// where the sanitizers cannot see it (inside BLAS).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "fuzz_input.hpp"
#include "mha/mha.hpp"
#include "normwise.hpp"

#ifndef MHA_FUZZ_TOLERANCE
#define MHA_FUZZ_TOLERANCE 1e-4
#endif

namespace {

constexpr int64_t kGuard = 16;  // NaN elements on either side of every buffer

// A view of `shape` and `dtype` over its own buffer (kept in `owners`) of values uniform in
// [-amplitude, amplitude], in a layout the input picks: its dimensions stored in natural,
// swapped or reversed order, each with padding between entries, and each dimension but the last
// sometimes a stride of 0 (the same entry repeated); or rows one element apart (overlapping).
mha::TensorView fuzzed_view(FuzzInput& in, std::mt19937_64& rng, float amplitude, const mha::Shape& shape,
                            mha::DType dtype, std::vector<mha::Tensor>& owners) {
  const int rank = static_cast<int>(shape.size());
  std::vector<int> order(rank);  // order[0] is stored outermost
  for (int d = 0; d < rank; ++d) order[d] = d;
  switch (in.small(3)) {
    case 1: if (rank >= 2) std::swap(order[0], order[1]); break;
    case 2: std::reverse(order.begin(), order.end()); break;
    default: break;
  }
  mha::Shape strides(rank);
  int64_t span = 1;
  for (int i = rank - 1; i >= 0; --i) {
    const int d = order[i];
    strides[d] = span * (1 + in.small(3) / 3);  // now and then every other entry
    span = strides[d] * shape[d] + in.small(2);  // and sometimes a gap after each
  }
  for (int d = 0; d + 1 < rank; ++d) {
    if (in.small(4) == 0) strides[d] = 0;  // repeated
  }
  if (rank >= 2 && in.small(8) == 0) strides[rank - 2] = 1;  // rows one element apart
  int64_t extent = 1;
  for (int d = 0; d < rank; ++d) extent += (shape[d] - 1) * strides[d];
  mha::Tensor values = mha::Tensor::empty({kGuard + extent + kGuard});
  std::uniform_real_distribution<float> u(-amplitude, amplitude);
  for (int64_t i = 0; i < values.numel(); ++i) {
    const bool guard = i < kGuard || i >= kGuard + extent;
    values.data<float>()[i] = guard ? std::numeric_limits<float>::quiet_NaN() : u(rng);
  }
  owners.push_back(mha::Tensor::copy_of(values, dtype));  // NaN stays NaN in every floating dtype
  const auto* base = static_cast<const std::byte*>(owners.back().view().data);
  return mha::TensorView(base + kGuard * mha::dtype_size(dtype), dtype, shape, strides);
}

[[noreturn]] void fail(const char* what, double err, double scale, const std::string& call) {
  std::fprintf(stderr, "%s: normwise error %.3e (scale %.3e), ISA %s, %s\n", what, err, scale,
               std::string(mha::detail::isa_name(mha::detail::active_isa())).c_str(), call.c_str());
  __builtin_trap();
}

// float32 modules: sums of at most 32 products of values below 3 and weights below 1 are ~1e-6
// off. bfloat16/float16 modules compute in float32 and round their results once: 2^-9 and 2^-12
// of the largest value at most. float64 modules compute in float64, in another order than the
// reference: some hundreds of units of 2^-53.
double tolerance(mha::DType dtype) {
  if (dtype == mha::DType::f64) return std::min(1e-12, MHA_FUZZ_TOLERANCE);
  return dtype == mha::DType::bf16 ? 1e-2 : dtype == mha::DType::f16 ? 1e-3 : MHA_FUZZ_TOLERANCE;
}

void check(const char* what, const mha::TensorView& got, const mha::TensorView& ref, const std::string& call,
           const mha::Tensor& magnitude = {}) {
  double scale = 0;
  const double err = normwise(got, ref, &scale, magnitude);
  if (err > tolerance(got.dtype)) fail(what, err, scale, call);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  static const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  mha::detail::force_isa(isas[in.byte() % isas.size()]);

  const int64_t H = 1 + in.small(3), E = H * (1 + in.small(7));
  const bool cross = in.flag();
  mha::MultiheadAttentionOptions mo;
  mo.bias = in.small(3) != 0;
  mo.add_bias_kv = in.small(3) == 0;
  mo.add_zero_attn = in.small(3) == 0;
  if (cross && in.flag()) mo.kdim = 1 + in.small(11);
  if (cross && in.flag()) mo.vdim = 1 + in.small(11);
  mo.batch_first = in.flag();
  const bool dropout = in.small(3) == 0;
  mo.dropout = dropout ? 0.25 : 0.0;
  mo.seed = in.byte();
  static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::bf16, mha::DType::f16,
                                      mha::DType::f64};
  mo.dtype = dtypes[in.small(4)];
  mha::MultiheadAttention m(E, H, mo);
  m.train(dropout);

  const bool batched = in.small(4) != 0;
  const int64_t N = 1 + in.small(2), L = 1 + in.small(15), S = cross ? 1 + in.small(15) : L;
  auto shape = [&](int64_t len, int64_t width) -> mha::Shape {
    if (!batched) return {len, width};
    return mo.batch_first ? mha::Shape{N, len, width} : mha::Shape{len, N, width};
  };
  std::mt19937_64 rng(in.u64());
  static const float amplitudes[] = {0.25f, 1.0f, 3.0f};
  const float amplitude = amplitudes[in.small(2)];
  std::vector<mha::Tensor> owners;
  const mha::TensorView q = fuzzed_view(in, rng, amplitude, shape(L, E), mo.dtype, owners);
  const mha::TensorView k = cross ? fuzzed_view(in, rng, amplitude, shape(S, m.kdim()), mo.dtype, owners) : q;
  const mha::TensorView v = cross ? fuzzed_view(in, rng, amplitude, shape(S, m.vdim()), mo.dtype, owners) : q;

  mha::ForwardOptions f;
  f.need_weights = in.flag();
  f.average_attn_weights = in.flag();
  f.is_causal = in.small(3) == 0;
  f.dropout_seed = in.byte();
  f.num_threads = 1 + static_cast<int>(in.small(2));
  mha::Tensor attn_mask, key_padding_mask;
  switch (in.small(3)) {
    case 1: {  // bool [L, S], true = masked out (the module's convention)
      attn_mask = mha::Tensor::empty({L, S}, mha::DType::boolean);
      for (int64_t i = 0; i < attn_mask.numel(); ++i) attn_mask.data<bool>()[i] = rng() % 4 == 0;
      f.attn_mask = attn_mask.view();
      break;
    }
    case 2: {  // additive [L, S]
      attn_mask = mha::Tensor::empty({L, S});
      std::uniform_real_distribution<float> u(-4.0f, 4.0f);
      for (int64_t i = 0; i < attn_mask.numel(); ++i) attn_mask.data<float>()[i] = u(rng);
      f.attn_mask = attn_mask.view();
      break;
    }
    default: break;
  }
  if (in.small(2) == 0) {  // bool key padding, true = padded
    key_padding_mask = mha::Tensor::empty(batched ? mha::Shape{N, S} : mha::Shape{S}, mha::DType::boolean);
    for (int64_t i = 0; i < key_padding_mask.numel(); ++i) key_padding_mask.data<bool>()[i] = rng() % 4 == 0;
    f.key_padding_mask = key_padding_mask.view();
  }
  const std::string call = "E=" + std::to_string(E) + " H=" + std::to_string(H) + " N=" + std::to_string(N) +
                           " L=" + std::to_string(L) + " S=" + std::to_string(S) + (cross ? " cross" : " self") +
                           (batched ? "" : " unbatched") + (mo.batch_first ? " batch_first" : "") +
                           (mo.add_bias_kv ? " bias_kv" : "") + (mo.add_zero_attn ? " zero_attn" : "") +
                           (dropout ? " dropout" : "") + (f.is_causal ? " causal" : "") + " " +
                           std::string(mha::dtype_name(mo.dtype));

  // The reference reads contiguous float64 copies, so it does not depend on the layouts at all.
  const mha::Tensor q64 = mha::Tensor::copy_of(q, mha::DType::f64);
  const mha::Tensor k64 = cross ? mha::Tensor::copy_of(k, mha::DType::f64) : q64;
  const mha::Tensor v64 = cross ? mha::Tensor::copy_of(v, mha::DType::f64) : q64;

  // 1. The module's own parameters, inputs in their fuzzed layouts.
  const auto ours = m.forward(q, k, v, f);
  mha::Tensor magnitude;
  const auto ref = mha::reference::multihead_attention(m, q64, k64, v64, f, dropout, {}, &magnitude);
  check("output", ours.output, ref.output, call, magnitude);
  if (f.need_weights) check("weights", *ours.weights, *ref.weights, call);

  // 2. Other parameters, given as views in fuzzed layouts.
  mha::ParameterViews given;
  std::unordered_map<std::string, mha::TensorView> given64;
  std::vector<mha::Tensor> copies;
  for (const auto& [name, param_shape] : m.parameter_shapes()) {
    given[name] = fuzzed_view(in, rng, 1.0f / std::sqrt(static_cast<float>(param_shape.back())), param_shape,
                              mo.dtype, owners);
    copies.push_back(mha::Tensor::copy_of(given[name], mha::DType::f64));
    given64[name] = copies.back().view();
  }
  const auto with = m.forward_with(given, q, k, v, f);
  mha::Tensor magnitude_with;
  const auto ref_with = mha::reference::multihead_attention(m, q64, k64, v64, f, dropout, given64, &magnitude_with);
  check("output (given parameters)", with.output, ref_with.output, call, magnitude_with);
  if (f.need_weights) check("weights (given parameters)", *with.weights, *ref_with.weights, call);

  // 3. Forward and backward against the same call on contiguous copies of the inputs.
  const mha::Tensor qc = mha::Tensor::copy_of(q);
  const mha::Tensor kc = cross ? mha::Tensor::copy_of(k) : qc, vc = cross ? mha::Tensor::copy_of(v) : qc;
  mha::ForwardContext ctx, ctx_contiguous;
  const auto trained = m.forward_with(given, q, k, v, f, &ctx);
  const auto trained_contiguous = m.forward_with(given, qc, kc, vc, f, &ctx_contiguous);
  check("training output", trained.output, trained_contiguous.output, call);
  const mha::TensorView grad = fuzzed_view(in, rng, 1.0f, trained.output.sizes(), mo.dtype, owners);
  const auto g = m.backward_with(given, ctx, grad);
  const auto gc = m.backward_with(given, ctx_contiguous, mha::Tensor::copy_of(grad));
  check("query gradient", g.query, gc.query, call);
  if (cross) {
    check("key gradient", g.key, gc.key, call);
    check("value gradient", g.value, gc.value, call);
  }
  for (size_t i = 0; i < g.parameters.size(); ++i) {
    check(("gradient of " + g.parameters[i].first).c_str(), g.parameters[i].second, gc.parameters[i].second, call);
  }

  // 4. The contiguous call's context rebuilt from its activations, over the inputs in their
  //    fuzzed layouts (as a compiled graph's backward rebuilds it).
  const mha::SavedActivations saved = ctx_contiguous.activations();
  const auto gr = m.backward_with(given, m.restore_context(q, k, v, f, saved.views()), grad);
  check("query gradient (restored context)", gr.query, gc.query, call);
  for (size_t i = 0; i < gr.parameters.size(); ++i) {
    check(("gradient of " + gr.parameters[i].first + " (restored context)").c_str(), gr.parameters[i].second,
          gc.parameters[i].second, call);
  }
  return 0;
}
