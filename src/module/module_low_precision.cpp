// MultiheadAttention with bfloat16 or float16 parameters: the float32 module's forward and
// backward on widened copies of the parameters, inputs and masks; the output, the weights and
// the gradients rounded once to the module's dtype. Every product and softmax statistic is
// float32, so the only low-precision roundings are those of the values the caller hands in and
// gets back (PyTorch's CPU module also rounds each projection and the attention output on the way).
//
// On a CPU with bfloat16 products (oneDNN's bf16 matmul: AVX512-BF16 or AMX), a bfloat16 module
// rounds where PyTorch's does instead, and runs in those products: inference in
// module_bf16_forward.cpp, training (a forward that keeps a context, and its backward) as the
// forward_full / backward_full of T = bfloat16, where every projection and each of its gradient's
// products is a bfloat16 product rounded once, and the attention kernels read and write bfloat16.
//
// On a CPU without bfloat16/float16 arithmetic this is also the fast way: a float32 GEMM on
// widened operands is what a bf16 GEMM would do there, and the widening is a memory-bound copy
// split over the pool (the weights: 4 E^2 values per call; E = 1024 is about 2 ms). A projection
// of at most 64 rows (decoding steps) skips that copy: linear() reads the 16-bit weights as they
// are, one pass over half the bytes of a float32 weight.
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/threading.hpp"
#include "module/forward_context.hpp"
#include "module/module_bf16_forward.hpp"
#include "module/module_call.hpp"
#include "module/onednn_matmul.hpp"
#include "module/parameter_set.hpp"

namespace mha {

bool bfloat16_products() { return detail::bf16_matmul_available(); }

bool detail::bf16_products_training(const MultiheadAttention& m) {
  return m.options().dtype == DType::bf16 && bf16_matmul_available();
}

detail::WidenedCall detail::widened_call(const TensorView& query, const TensorView& key, const TensorView& value,
                                         const ForwardOptions& options, DType module_dtype, int threads) {
  auto widen = [&](const TensorView& t) { return parallel_copy_of(t, DType::f32, threads); };
  WidenedCall w;
  w.query = widen(query);
  w.key = same_view(key, query) ? w.query : widen(key);
  w.value = same_view(value, key) ? w.key : same_view(value, query) ? w.query : widen(value);
  w.options = options;
  if (options.attn_mask && options.attn_mask->dtype == module_dtype) {
    w.attn_mask = Tensor::copy_of(*options.attn_mask, DType::f32);
    w.options.attn_mask = w.attn_mask.view();
  }
  if (options.key_padding_mask && options.key_padding_mask->dtype == module_dtype) {
    w.key_padding_mask = Tensor::copy_of(*options.key_padding_mask, DType::f32);
    w.options.key_padding_mask = w.key_padding_mask.view();
  }
  return w;
}

ForwardResult MultiheadAttention::forward_low_precision(const std::vector<std::pair<std::string, TensorView>>& parameters,
                                                        const TensorView& query, const TensorView& key,
                                                        const TensorView& value, const ForwardOptions& options,
                                                        ForwardContext* context) const {
  detail::validate_module_call(*this, query, key, value, options);  // dtypes against the module's
  // bfloat16 inference on AMX: PyTorch's roundings, on the tile unit throughout.
  if (auto tiles = detail::bf16_inference_forward(*this, parameters, query, key, value, options, context)) return std::move(*tiles);
  const int threads = detail::resolve_threads(options.num_threads);
  if (context != nullptr && detail::bf16_products_training(*this)) {
    return forward_full<bfloat16>(detail::bfloat16_parameters(parameters, threads), query, key, value, options, context);
  }
  const MultiheadAttention wide(*this, DType::f32, /*parameters=*/false);  // the options, as float32
  // The projection weights stay 16-bit: linear() widens each for sgemm, or reads it as it is for
  // a few rows (a decoding step), which is one pass over half the bytes.
  const detail::ParameterSet wide_parameters = detail::float32_parameters(parameters, threads, true);

  detail::WidenedCall wide_call = detail::widened_call(query, key, value, options, options_.dtype, threads);
  ForwardOptions& o = wide_call.options;
  // This module's dropout stream, not the temporary one's.
  if (training_ && options_.dropout > 0 && !o.dropout_seed) o.dropout_seed = next_dropout_seed();

  ForwardResult r = wide.forward_full<float>(wide_parameters, wide_call.query, wide_call.key, wide_call.value, o, context);
  r.output = detail::parallel_copy_of(r.output.view(), options_.dtype, threads);
  if (r.weights) r.weights = detail::parallel_copy_of(r.weights->view(), options_.dtype, threads);
  if (context != nullptr) context->state_->module_dtype = options_.dtype;
  return r;
}

ModuleGradients MultiheadAttention::backward_low_precision(
    const std::vector<std::pair<std::string, TensorView>>& parameters, const ForwardContext& context,
    const TensorView& grad_output, const WantedGradients& wanted, const std::optional<TensorView>& grad_weights) const {
  require_cpu(grad_output, "grad_output");
  if (grad_output.dtype != options_.dtype) {
    throw Error("grad_output: expected dtype " + std::string(dtype_name(options_.dtype)) +
                " (the module's parameters' dtype), got " + std::string(dtype_name(grad_output.dtype)));
  }
  if (grad_output.numel() > 0 && grad_output.data == nullptr) throw Error("grad_output: data pointer is null");
  const int threads = context.state_->problem.num_threads;
  if (context.state_->q.dtype == DType::bf16) {  // a forward in bfloat16 products
    return backward_full<bfloat16>(detail::bfloat16_parameters(parameters, threads), context, grad_output, wanted,
                                   grad_weights);
  }
  const MultiheadAttention wide(*this, DType::f32, /*parameters=*/false);
  const detail::ParameterSet wide_parameters = detail::float32_parameters(parameters, threads);
  const Tensor grad = detail::parallel_copy_of(grad_output, DType::f32, threads);
  std::optional<TensorView> wide_grad_weights;
  Tensor grad_weights_copy;
  if (grad_weights) {
    require_cpu(*grad_weights, "grad_weights");
    if (grad_weights->dtype != options_.dtype) {
      throw Error("grad_weights: expected dtype " + std::string(dtype_name(options_.dtype)) +
                  " (the weights' dtype), got " + std::string(dtype_name(grad_weights->dtype)));
    }
    grad_weights_copy = detail::parallel_copy_of(*grad_weights, DType::f32, threads);
    wide_grad_weights = grad_weights_copy.view();
  }
  ModuleGradients g = wide.backward_full<float>(wide_parameters, context, grad.view(), wanted, wide_grad_weights);
  auto round = [&](Tensor& t) {
    if (t.defined()) t = detail::parallel_copy_of(t.view(), options_.dtype, threads);
  };
  round(g.query);
  round(g.key);
  round(g.value);
  for (auto& [name, t] : g.parameters) round(t);
  return g;
}

}  // namespace mha
