// MultiheadAttention::forward: projections (BLAS), heads as strided views, the fused attention
// kernel, the output projection. The steps mirror PyTorch's multi_head_attention_forward.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/dropout.hpp"
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_f64.hpp"
#include "cpu/attention_kernel.hpp"
#include "mha/multihead_attention.hpp"
#include "module/linear.hpp"
#include "module/module_bf16_forward.hpp"
#include "module/forward_context.hpp"
#include "module/module_call.hpp"
#include "module/parameter_set.hpp"

namespace mha {
namespace {

// Row `row` of every batch entry of a [N, rows, E] view of T, set to `values` (or zero).
template <typename T>
void set_row(const TensorView& t, int64_t row, const T* values) {
  const int64_t E = t.shape[2];
  for (int64_t n = 0; n < t.shape[0]; ++n) {
    T* dst = t.data_as<T>() + n * t.strides[0] + row * t.strides[1];
    if (values) std::memcpy(dst, values, sizeof(T) * E);
    else std::fill_n(dst, E, T());
  }
}

// The float64 attention (cpu/attention_f64.hpp) with the float32 kernel's outputs: the weights
// averaged over the heads are the per-head weights' mean, in a temporary [N, H, L, S'].
void run_attention_f64(const detail::AttentionProblem& p, const TensorView& heads_out, double* weights,
                       const int64_t* weights_strides, double* average_weights, double* lse) {
  detail::Float64Outputs o;
  o.out = heads_out.data_as<double>();
  for (int d = 0; d < 4; ++d) o.out_strides[d] = heads_out.strides[d];
  o.lse = lse;
  Tensor per_head;
  if (average_weights != nullptr) {
    per_head = Tensor::empty({p.batch, p.heads_q, p.len_q, p.len_k}, DType::f64);
    o.weights = per_head.data<double>();
    for (int d = 0; d < 4; ++d) o.weights_strides[d] = per_head.view().strides[d];
  } else if (weights != nullptr) {
    o.weights = weights;
    for (int d = 0; d < 4; ++d) o.weights_strides[d] = weights_strides[d];
  }
  detail::attention_forward_f64(p, o);
  if (average_weights == nullptr) return;
  const int64_t H = p.heads_q, rows = p.len_q * p.len_k;
  const double* w = per_head.data<double>();
  detail::parallel_for(p.batch, detail::resolve_threads(p.num_threads), [&](int64_t n, int) {
    double* avg = average_weights + n * rows;
    std::fill_n(avg, rows, 0.0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < rows; ++r) avg[r] += w[(n * H + h) * rows + r];
    for (int64_t r = 0; r < rows; ++r) avg[r] /= static_cast<double>(H);
  });
}

}  // namespace

uint64_t MultiheadAttention::next_dropout_seed() const {
  return detail::splitmix64(options_.seed ^ (0x632be59bd9b4e019ull * ++dropout_calls_));
}

ForwardContext::ForwardContext() = default;
ForwardContext::~ForwardContext() = default;
ForwardContext::ForwardContext(ForwardContext&&) noexcept = default;
ForwardContext& ForwardContext::operator=(ForwardContext&&) noexcept = default;

ForwardResult MultiheadAttention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                                          const ForwardOptions& options) const {
  return forward(query, key, value, options, nullptr);
}

ForwardResult MultiheadAttention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                                          const ForwardOptions& options, ForwardContext* context) const {
  return forward_any(parameters_for_call(nullptr, "forward"), query, key, value, options, context);
}

ForwardResult MultiheadAttention::forward_with(const ParameterViews& parameters, const TensorView& query,
                                               const TensorView& key, const TensorView& value,
                                               const ForwardOptions& options, ForwardContext* context) const {
  return forward_any(parameters_for_call(&parameters, "forward_with"), query, key, value, options, context);
}

ForwardResult MultiheadAttention::forward_any(const std::vector<std::pair<std::string, TensorView>>& parameters,
                                              const TensorView& query, const TensorView& key, const TensorView& value,
                                              const ForwardOptions& options, ForwardContext* context) const {
  if (options_.dtype != DType::f32 && options_.dtype != DType::f64) {
    return forward_low_precision(parameters, query, key, value, options, context);
  }
  detail::validate_module_call(*this, query, key, value, options);  // (num_threads) before any copy
  const int threads = detail::resolve_threads(options.num_threads);
  if (options_.dtype == DType::f64) {
    return forward_full<double>(detail::float64_parameters(parameters, threads), query, key, value, options, context);
  }
  return forward_full<float>(detail::float32_parameters(parameters, threads), query, key, value, options, context);
}

template <typename T>
ForwardResult MultiheadAttention::forward_full(const detail::ParameterSet& parameters, const TensorView& query_in,
                                               const TensorView& key_in, const TensorView& value_in,
                                               const ForwardOptions& options_in, ForwardContext* context) const {
  constexpr DType dtype = dtype_of<T>();
  detail::validate_module_call(*this, query_in, key_in, value_in, options_in);  // before any copy
  // A training forward keeps its own copies of the inputs and masks, so the backward does not
  // depend on the caller's buffers; the self-attention case stays one shared copy.
  std::unique_ptr<ForwardContext::State> st;
  TensorView query = query_in, key = key_in, value = value_in;
  ForwardOptions options = options_in;
  if (context != nullptr) {
    st = std::make_unique<ForwardContext::State>();
    auto keep = [&](const TensorView& t) {
      st->inputs.push_back(Tensor::copy_of(t));
      return st->inputs.back().view();
    };
    query = keep(query_in);
    key = detail::same_view(key_in, query_in) ? query : keep(key_in);
    value = detail::same_view(value_in, key_in) ? key : keep(value_in);
    if (options.attn_mask) options.attn_mask = keep(*options.attn_mask);
    if (options.key_padding_mask) options.key_padding_mask = keep(*options.key_padding_mask);
  }
  const detail::ModuleCall c = detail::validate_module_call(*this, query, key, value, options);
  const int threads = detail::resolve_threads(options.num_threads);
  const int64_t E = embed_dim_, H = num_heads_;
  const int64_t N = c.batch, L = c.len_q, S = c.len_k, St = c.total_keys();
  const T* in_bias = options_.bias ? parameters.data<T>("in_proj_bias") : nullptr;
  constexpr bool bf16 = std::is_same_v<T, bfloat16>;

  // 1. Projections, each into rows of its own (bias_k / bias_v and the zero rows follow S), in one
  //    pass of the threads. (Self-attention's packed [3E, E] weight as one product wrote
  //    [N, L, 3E] rows in column parts, each through a dense buffer copied into place.)
  TensorView wq, wk, wv;
  if (qkv_same_embed_dim()) {
    const TensorView& w = parameters.view("in_proj_weight");
    wq = w.slice(0, 0, E), wk = w.slice(0, E, 2 * E), wv = w.slice(0, 2 * E, 3 * E);
  } else {
    wq = parameters.view("q_proj_weight"), wk = parameters.view("k_proj_weight");
    wv = parameters.view("v_proj_weight");
  }
  const detail::RowBuffer q_buf = detail::rows_like(c.query, L, E, dtype),
                          k_buf = detail::rows_like(c.key, St, E, dtype),
                          v_buf = detail::rows_like(c.value, St, E, dtype);
  const TensorView q = q_buf.view, k = k_buf.view, v = v_buf.view;  // [N, L, E], [N, St, E], [N, St, E]
  if constexpr (std::is_same_v<T, float>) {
    detail::linear({{c.query, wq, in_bias, q},
                    {c.key, wk, in_bias ? in_bias + E : nullptr, k.slice(1, 0, S)},
                    {c.value, wv, in_bias ? in_bias + 2 * E : nullptr, v.slice(1, 0, S)}},
                   threads);
  } else if constexpr (bf16) {  // bfloat16 Linears, their float32 sums with the bias rounded once
    const std::vector<float> b = in_bias ? detail::widened_bias(parameters.view("in_proj_bias"), 0, 3 * E)
                                         : std::vector<float>();
    auto bias_at = [&](int64_t i) { return in_bias ? b.data() + i * E : nullptr; };
    detail::linear_bf16({{c.query, wq, bias_at(0), q},
                         {c.key, wk, bias_at(1), k.slice(1, 0, S)},
                         {c.value, wv, bias_at(2), v.slice(1, 0, S)}},
                        threads);
  } else {
    detail::linear(c.query, wq, in_bias, q, threads);
    detail::linear(c.key, wk, in_bias ? in_bias + E : nullptr, k.slice(1, 0, S), threads);
    detail::linear(c.value, wv, in_bias ? in_bias + 2 * E : nullptr, v.slice(1, 0, S), threads);
  }

  // 2. bias_k / bias_v, then the zero key/value, appended along the sequence.
  int64_t row = S;
  if (options_.add_bias_kv) {
    set_row(k, row, parameters.data<T>("bias_k"));
    set_row(v, row, parameters.data<T>("bias_v"));
    ++row;
  }
  if (options_.add_zero_attn) {
    set_row<T>(k, row, nullptr);
    set_row<T>(v, row, nullptr);
  }

  // 3. Heads as views: [N, L, E] -> [N, H, L, hd]. The attention output is written straight into
  //    a buffer laid out like the final output, so the output projection is one sgemm.
  ForwardResult result;
  result.output = Tensor::empty(detail::module_output_shape(c, *this, options_.batch_first), dtype);
  auto as_nle = [&](const TensorView& t) {
    if (!c.batched) return t.unsqueeze(0);
    return options_.batch_first ? t : t.transpose(0, 1);
  };
  const Tensor attn = Tensor::empty(result.output.sizes(), dtype);
  detail::MaskTerms masks = detail::module_mask_terms(c, H);
  detail::AttentionProblem p = detail::module_attention_problem(c, masks, H, q, k, v, threads);
  p.dropout_p = training_ ? options_.dropout : 0.0;
  if (p.dropout_p > 0) {
    p.dropout_seed = options.dropout_seed ? *options.dropout_seed : next_dropout_seed();
  }

  const TensorView heads_out = as_nle(attn.view()).split_dim(2, H).transpose(1, 2);
  // The weights per head, or only their mean over the heads, which the kernel sums as it goes
  // (float32 for a bfloat16 module, rounded once below).
  using W = std::conditional_t<std::is_same_v<T, double>, double, float>;
  Tensor weights;
  W* weights_data = nullptr;
  W* average_data = nullptr;
  int64_t weights_strides[4] = {};
  if (options.need_weights && options.average_attn_weights) {
    weights = Tensor::empty(detail::module_weights_shape(c, H, true), dtype_of<W>());
    average_data = weights.data<W>();
  } else if (options.need_weights) {
    weights = Tensor::empty(detail::module_weights_shape(c, H, false), dtype_of<W>());  // [N,] H, L, S
    weights_data = weights.data<W>();
    // The tensor's own strides (sizes whose product overflows, with an empty batch, are its business).
    const TensorView& w = weights.view();
    for (int d = 0; d < 3; ++d) weights_strides[d + 1] = w.strides[w.ndim - 3 + d];
    weights_strides[0] = c.batched ? w.strides[0] : 0;
  }
  Tensor lse;
  if (st) lse = Tensor::empty({N, H, L}, std::is_same_v<T, double> ? DType::f64 : DType::f32);
  if constexpr (std::is_same_v<T, double>) {
    run_attention_f64(p, heads_out, weights_data, weights_strides, average_data, st ? lse.data<double>() : nullptr);
  } else {
    detail::ForwardOutputs o;
    o.out = heads_out.data;
    o.out_dtype = dtype;
    for (int d = 0; d < 4; ++d) o.out_strides[d] = heads_out.strides[d];
    o.average_weights = average_data;
    o.weights = weights_data;
    for (int d = 0; d < 4; ++d) o.weights_strides[d] = weights_strides[d];
    if (st) o.lse = lse.data<float>();
    detail::run_attention(p, o);
  }
  if (bf16 && weights.defined()) weights = detail::parallel_copy_of(weights.view(), dtype, threads);

  // 4. Output projection.
  const T* out_bias = options_.bias ? parameters.data<T>("out_proj.bias") : nullptr;
  if constexpr (bf16) {
    const std::vector<float> b = out_bias ? detail::widened_bias(parameters.view("out_proj.bias"), 0, E)
                                          : std::vector<float>();
    detail::linear_bf16(as_nle(attn.view()), parameters.view("out_proj.weight"), out_bias ? b.data() : nullptr,
                        as_nle(result.output.view()), threads);
  } else {
    detail::linear(as_nle(attn.view()), parameters.view("out_proj.weight"), out_bias, as_nle(result.output.view()),
                   threads);
  }

  if (options.need_weights) result.weights = weights;
  if (st) {
    st->call = c;
    st->masks = std::move(masks);
    st->q = q, st->k = k, st->v = v, st->attn = attn.view(), st->lse = lse.view();
    st->storage = {q_buf.storage, k_buf.storage, v_buf.storage, attn, lse};
    st->problem = p;
    st->query_shape = query_in.sizes(), st->key_shape = key_in.sizes(), st->value_shape = value_in.sizes();
    st->output_shape = result.output.sizes();
    st->module_dtype = dtype;
    if (options.need_weights) st->weights_shape = weights.sizes(), st->weights_averaged = options.average_attn_weights;
    context->state_ = std::move(st);
  }
  return result;
}

template ForwardResult MultiheadAttention::forward_full<float>(const detail::ParameterSet&, const TensorView&,
                                                                const TensorView&, const TensorView&,
                                                                const ForwardOptions&, ForwardContext*) const;
template ForwardResult MultiheadAttention::forward_full<double>(const detail::ParameterSet&, const TensorView&,
                                                                 const TensorView&, const TensorView&,
                                                                 const ForwardOptions&, ForwardContext*) const;
template ForwardResult MultiheadAttention::forward_full<bfloat16>(const detail::ParameterSet&, const TensorView&,
                                                                   const TensorView&, const TensorView&,
                                                                   const ForwardOptions&, ForwardContext*) const;

}  // namespace mha
