// The public scaled_dot_product_attention functions: validate, allocate, run the fused kernel.
#include "mha/sdpa.hpp"

#include <algorithm>

#include "core/attention_problem.hpp"
#include "cpu/attention_kernel.hpp"

namespace mha {
namespace {

using detail::AttentionProblem;

void set_strides(const TensorView& view4d, int64_t* strides) {
  for (int d = 0; d < 4; ++d) strides[d] = view4d.strides[d];
}

void run(const AttentionProblem& p, const TensorView& out, const TensorView* weights) {
  detail::ForwardOutputs o;
  const TensorView out4 = detail::as_4d(out, "out");
  o.out = out4.data_as<float>();
  set_strides(out4, o.out_strides);
  if (weights) {
    const TensorView w4 = detail::as_4d(*weights, "weights");
    o.weights = w4.data_as<float>();
    set_strides(w4, o.weights_strides);
  }
  detail::run_attention(p, o);
}

}  // namespace

Tensor scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options) {
  const AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, /*any_float=*/false);
  Tensor out = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v));
  run(p, out, nullptr);
  return out;
}

AttentionWithWeights scaled_dot_product_attention_with_weights(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options) {
  const AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, /*any_float=*/false);
  AttentionWithWeights r;
  r.output = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v));
  r.weights = Tensor::empty(detail::output_shape(q, p.len_q, p.len_k));
  run(p, r.output, &r.weights.view());
  return r;
}

void scaled_dot_product_attention_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const SdpaOptions& options,
                                       const std::optional<TensorView>& weights) {
  const AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, /*any_float=*/false);
  detail::check_output_view(out, detail::output_shape(q, p.len_q, p.dim_v), DType::f32, "out");
  if (weights) detail::check_output_view(*weights, detail::output_shape(q, p.len_q, p.len_k), DType::f32, "weights");
  run(p, out, weights ? &*weights : nullptr);
}

double attention_flops(int64_t batch, int64_t heads, int64_t len_q, int64_t len_k, int64_t dim_qk, int64_t dim_v,
                       bool causal, CausalAlignment alignment) {
  double pairs = static_cast<double>(len_q) * static_cast<double>(len_k);
  if (causal) {
    const int64_t offset = alignment == CausalAlignment::BottomRight ? len_k - len_q : 0;
    pairs = 0;
    for (int64_t i = 0; i < len_q; ++i) pairs += static_cast<double>(std::clamp<int64_t>(i + offset + 1, 0, len_k));
  }
  return 2.0 * pairs * static_cast<double>(dim_qk + dim_v) * static_cast<double>(batch * heads);
}

}  // namespace mha
