// The public scaled_dot_product_attention functions: validate, allocate, run the fused kernel.
#include "mha/sdpa.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/batch_dims.hpp"
#include "core/parallel_copy.hpp"
#include "core/sdpa_host.hpp"
#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention_f64.hpp"
#include "cpu/attention_kernel.hpp"
#include "cuda/cuda_attention.hpp"

namespace mha {
namespace {

using detail::AttentionProblem;

void set_strides(const TensorView& view4d, int64_t* strides) {
  for (int d = 0; d < 4; ++d) strides[d] = view4d.strides[d];
}

// float64 (host only): its own kernel, in float64 throughout (cpu/attention_f64.hpp).
void forward_f64(const AttentionProblem& p, const TensorView& out, const TensorView* weights, double* lse) {
  detail::Float64Outputs o;
  const TensorView out4 = detail::folded(p, out, p.heads_q, "out");
  o.out = out4.data_as<double>();
  set_strides(out4, o.out_strides);
  if (weights) {
    const TensorView w4 = detail::folded(p, *weights, p.heads_q, "weights");
    o.weights = w4.data_as<double>();
    set_strides(w4, o.weights_strides);
  }
  o.lse = lse;
  detail::attention_forward_f64(detail::with_window_as_mask(p), o);
}

// Operands in CUDA memory go to the GPU kernel, which computes no weights matrix.
void require_no_weights_on_device(const AttentionProblem& p) {
  if (!p.on_cpu()) {
    throw Error("weights: the attention weights are not computed on " + p.q.device.str() +
                " (the fused GPU kernel never forms them); call scaled_dot_product_attention, or copy the inputs "
                "to the CPU");
  }
}

// Operands in CUDA memory: the GPU backward (deterministic; bfloat16 / float16), for inputs of
// the full batch shape. The mask's gradient and gradients summed over broadcast dimensions are
// the host backward's.
AttentionGradients backward_on_device(const AttentionProblem& p, const TensorView* inputs[3],
                                      const AttentionForTraining& saved, const TensorView& grad_output,
                                      const SdpaGradientsWanted& wanted) {
  const Device device = p.q.device;
  const std::pair<const TensorView*, const char*> operands[] = {
      {&grad_output, "grad_output"}, {&saved.output.view(), "saved.output"}, {&saved.lse.view(), "saved.lse"}};
  for (const auto& [t, name] : operands) {
    if (t->device != device) {
      throw Error(std::string(name) + ": expected the query's device " + device.str() + ", got " + t->device.str());
    }
  }
  if (wanted.attn_mask) {
    throw Error("attn_mask_grad: the mask's gradient is computed by the host backward; got inputs on " + device.str());
  }
  const Shape out_shape = detail::output_shape(p, p.len_q, p.dim_v);
  detail::check_output_view(saved.output, out_shape, p.q.dtype, "saved.output");
  detail::check_output_view(saved.lse, detail::output_shape(p, p.len_q), DType::f32, "saved.lse");
  detail::check_output_view(grad_output, out_shape, p.q.dtype, "grad_output");
  if (!saved.lse.view().is_contiguous()) {
    throw Error("saved.lse: on " + device.str() + " expected a contiguous tensor, as the forward returns it");
  }
  detail::CudaBackwardViews views;
  views.out4 = detail::folded(p, saved.output, p.heads_q, "saved.output");
  views.grad_out4 = detail::folded(p, grad_output, p.heads_q, "grad_output");
  views.lse = static_cast<const float*>(saved.lse.view().data);
  const Tensor delta = Tensor::empty(detail::output_shape(p, p.len_q), DType::f32, device);
  views.delta = delta.data<float>();

  const char* names[] = {"query", "key", "value"};
  const bool wanted_of[] = {wanted.query, wanted.key, wanted.value};
  const int64_t heads_of[] = {p.heads_q, p.heads_kv, p.heads_kv};
  std::optional<TensorView>* views_of[] = {&views.dq, &views.dk, &views.dv};
  AttentionGradients g;
  Tensor* results[] = {&g.query, &g.key, &g.value};
  for (int i = 0; i < 3; ++i) {
    if (!wanted_of[i]) continue;
    const TensorView& input = *inputs[i];
    const Shape sizes = input.sizes();
    Shape full = p.batch_shape_with_heads(heads_of[i]);
    full.insert(full.end(), sizes.end() - 2, sizes.end());
    if (sizes != full) {
      throw Error(std::string(names[i]) + ": on " + device.str() + " the backward takes inputs of the full batch shape " +
                  TensorView(nullptr, input.dtype, full).shape_str() + ", got " + input.shape_str() +
                  ", which broadcasts; expand and copy it, or run the backward on the host");
    }
    *results[i] = Tensor::empty(sizes, p.q.dtype, device);
    *views_of[i] = detail::folded(p, *results[i], heads_of[i], names[i]);
  }
  detail::cuda_attention_backward(p, views);
  return g;
}

}  // namespace

namespace detail {
namespace {

void forward_kernels(const AttentionProblem& p, const TensorView& out, const TensorView* weights, void* lse) {
  if (p.q.dtype == DType::f64) {
    forward_f64(p, out, weights, static_cast<double*>(lse));
    return;
  }
  if (p.q.dtype != DType::f32 && weights == nullptr && amx_usable() && amx_bf16_supports(p)) {
    AmxOutputs o;  // bfloat16 on the tile unit
    o.lse = static_cast<float*>(lse);
    const TensorView out4 = folded(p, out, p.heads_q, "out");
    o.out = out4.data;
    o.out_f32 = out4.dtype == DType::f32;
    set_strides(out4, o.out_strides);
    amx_bf16_forward(p, o);
    return;
  }
  // float32, and bfloat16 / float16 in the float32 kernel, which widens the inputs as it reads
  // them and rounds each output row once as it stores it: the bits of the float32 kernel on
  // widened copies, without the copies (the log-sum-exp stays float32).
  Tensor weights32;
  const bool narrow_weights = weights && weights->dtype != DType::f32;  // (sinks hand float32 weights)
  if (narrow_weights) weights32 = Tensor::empty(weights->sizes());
  ForwardOutputs o;
  const TensorView out4 = folded(p, out, p.heads_q, "out");
  o.out = out4.data;
  o.out_dtype = out4.dtype;
  set_strides(out4, o.out_strides);
  if (weights) {
    const TensorView w4 = folded(p, narrow_weights ? weights32.view() : *weights, p.heads_q, "weights");
    o.weights = w4.data_as<float>();
    set_strides(w4, o.weights_strides);
  }
  o.lse = static_cast<float*>(lse);
  run_attention(p, o);
  if (narrow_weights) parallel_copy_into(weights32, *weights, resolve_threads(p.num_threads));
}

// Attention sinks, applied to what the kernels computed without them: a row whose scores have
// the log-sum-exp l (+inf where it sees no key) and whose head's sink is s keeps the share
// exp(l) / (exp(l) + exp(s)) of its softmax, so its output and weights are scaled by that share
// and its log-sum-exp becomes log(exp(l) + exp(s)) (s for a row without keys). The kernels write
// float32 (float64) rows here, rounded once to a 16-bit output afterwards.
template <class Wide>
void scale_rows_by_sink_share(const AttentionProblem& p, const TensorView& out4, const TensorView* weights4, Wide* lse) {
  parallel_for(p.batch * p.heads_q, resolve_threads(p.num_threads), [&](int64_t t, int) {
    const int64_t b = t / p.heads_q, h = t % p.heads_q;
    const double sink = p.sink(h);
    for (int64_t i = 0; i < p.len_q; ++i) {
      Wide& l = lse[t * p.len_q + i];
      if (std::isinf(l)) {  // no key: zeros already; the softmax is the sink's alone
        l = static_cast<Wide>(sink);
        continue;
      }
      const double top = std::max<double>(l, sink), mine = std::exp(l - top), theirs = std::exp(sink - top);
      const double share = mine / (mine + theirs);
      l = static_cast<Wide>(top + std::log(mine + theirs));
      auto scale = [&](const TensorView& v4, int64_t n) {
        Wide* row = v4.data_as<Wide>() + b * v4.strides[0] + h * v4.strides[1] + i * v4.strides[2];
        for (int64_t e = 0; e < n; ++e) row[e * v4.strides[3]] = static_cast<Wide>(row[e * v4.strides[3]] * share);
      };
      scale(out4, p.dim_v);
      if (weights4) scale(*weights4, p.len_k);
    }
  });
}

void forward_with_sinks(const AttentionProblem& p, const TensorView& out, const TensorView* weights, void* lse) {
  const DType wide = p.q.dtype == DType::f64 ? DType::f64 : DType::f32;
  Tensor own_lse, out_wide, weights_wide;
  if (!lse) {
    own_lse = Tensor::empty({p.batch * p.heads_q * p.len_q}, wide);
    lse = own_lse.view().data;
  }
  if (out.dtype != wide) out_wide = Tensor::empty(out.sizes(), wide);
  if (weights && weights->dtype != wide) weights_wide = Tensor::empty(weights->sizes(), wide);
  const TensorView out_target = out_wide.defined() ? out_wide.view() : out;
  const TensorView weights_target = !weights ? TensorView() : weights_wide.defined() ? weights_wide.view() : *weights;
  forward_kernels(p, out_target, weights ? &weights_target : nullptr, lse);
  const TensorView out4 = folded(p, out_target, p.heads_q, "out");
  const TensorView weights4 = weights ? folded(p, weights_target, p.heads_q, "weights") : TensorView();
  if (wide == DType::f64) {
    scale_rows_by_sink_share(p, out4, weights ? &weights4 : nullptr, static_cast<double*>(lse));
  } else {
    scale_rows_by_sink_share(p, out4, weights ? &weights4 : nullptr, static_cast<float*>(lse));
  }
  const int threads = resolve_threads(p.num_threads);
  if (out_wide.defined()) parallel_copy_into(out_wide, out, threads);
  if (weights_wide.defined()) parallel_copy_into(weights_wide, *weights, threads);
}

}  // namespace

void sdpa_forward_host(const AttentionProblem& p, const TensorView& out, const TensorView* weights, void* lse) {
  if (p.sinks) {
    forward_with_sinks(p, out, weights, lse);
  } else {
    forward_kernels(p, out, weights, lse);
  }
}

void sdpa_backward_host(const AttentionProblem& p, const BackwardViews& views) {
  if (is_float8(p.k.dtype)) {  // (every backward entry comes through here before it computes)
    throw Error("key, value: float8 keys and values are for inference (a quantized cache takes no gradient); the "
                "backward takes query, key and value of one dtype, got " + std::string(dtype_name(p.k.dtype)));
  }
  // bfloat16 / float16: the float32 kernel widens q, k, v and the output's gradient as it reads
  // their rows, reads the saved output as it is (for D = rowsum(dO O)) and rounds each gradient
  // row once, as it stores it: the bits of the float32 kernel on widened copies, without the
  // copies.
  BackwardInputs in;
  in.out = views.out.data;
  in.out_dtype = views.out.dtype;
  set_strides(views.out, in.out_strides);
  in.grad_out = views.grad_out.data;
  in.grad_out_dtype = views.grad_out.dtype;
  set_strides(views.grad_out, in.grad_out_strides);
  in.lse = static_cast<const float*>(views.lse);
  BackwardOutputs out;
  const std::optional<TensorView>* grads[] = {&views.dq, &views.dk, &views.dv};
  void** data_of[] = {&out.dq, &out.dk, &out.dv};
  int64_t* strides_of[] = {out.dq_strides, out.dk_strides, out.dv_strides};
  out.grad_dtype = p.q.dtype;
  for (int i = 0; i < 3; ++i) {
    if (!*grads[i]) continue;  // a null pointer: its products are skipped
    out.grad_dtype = (*grads[i])->dtype;
    *data_of[i] = (*grads[i])->data;
    set_strides(**grads[i], strides_of[i]);
  }
  if (views.dscores) set_strides(*views.dscores, out.dscores_strides);
  if (p.q.dtype == DType::f64) {  // float64: its own kernel (cpu/attention_f64.hpp), on the same views
    Float64Backward b;
    b.out = static_cast<const double*>(in.out);
    b.grad_out = static_cast<const double*>(in.grad_out);
    std::copy_n(in.out_strides, 4, b.out_strides);
    std::copy_n(in.grad_out_strides, 4, b.grad_out_strides);
    b.dq = static_cast<double*>(out.dq), b.dk = static_cast<double*>(out.dk), b.dv = static_cast<double*>(out.dv);
    std::copy_n(out.dq_strides, 4, b.dq_strides);
    std::copy_n(out.dk_strides, 4, b.dk_strides);
    std::copy_n(out.dv_strides, 4, b.dv_strides);
    b.dscores = views.dscores ? views.dscores->data_as<double>() : nullptr;
    std::copy_n(out.dscores_strides, 4, b.dscores_strides);
    attention_backward_f64(with_window_as_mask(p), b);
    return;
  }
  out.dscores = views.dscores ? views.dscores->data_as<float>() : nullptr;
  run_attention_backward(p, in, out);
}

Tensor sink_gradient(const TensorView& sinks, const TensorView& out4, const TensorView& grad_out4,
                     const TensorView& lse3, int threads) {
  // d sink_h = -sum over rows of P_sink D, P_sink = exp(sink_h - lse) (lse includes the sink),
  // D = rowsum(dO O); per (batch entry, head) in float64, then over the batch in order.
  const int64_t batch = out4.shape[0], heads = out4.shape[1], rows = out4.shape[2], dim_v = out4.shape[3];
  std::vector<double> partial(static_cast<size_t>(batch * heads));
  parallel_for(batch * heads, resolve_threads(threads), [&](int64_t t, int) {
    const int64_t b = t / heads, h = t % heads;
    const Tensor o = Tensor::copy_of(out4.select(0, b).select(0, h), DType::f64);
    const Tensor g = Tensor::copy_of(grad_out4.select(0, b).select(0, h), DType::f64);
    const Tensor l = Tensor::copy_of(lse3.select(0, b).select(0, h), DType::f64);
    const double sink = sink_value(sinks, h);
    double sum = 0;
    for (int64_t i = 0; i < rows; ++i) {
      double d = 0;
      for (int64_t e = 0; e < dim_v; ++e) d += o.data<double>()[i * dim_v + e] * g.data<double>()[i * dim_v + e];
      if (d != 0) sum -= std::exp(sink - l.data<double>()[i]) * d;
    }
    partial[static_cast<size_t>(t)] = sum;
  });
  Tensor sums = Tensor::zeros({heads}, DType::f64);
  for (int64_t t = 0; t < batch * heads; ++t) sums.data<double>()[t % heads] += partial[static_cast<size_t>(t)];
  return Tensor::copy_of(sums, sinks.dtype);
}

void fill_lse_without_keys(const SdpaOptions& options, const TensorView& lse_rows) {
  const Tensor fill = Tensor::empty(lse_rows.sizes(), DType::f64);
  const int64_t per_head = lse_rows.shape[1];
  for (int64_t x = 0; x < fill.numel(); ++x) {
    fill.data<double>()[x] = options.sinks ? sink_value(*options.sinks, x / per_head)
                                           : std::numeric_limits<double>::infinity();
  }
  copy_into(fill, lse_rows);
}

}  // namespace detail

Tensor scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  Tensor out = Tensor::empty(detail::output_shape(p, p.len_q, p.dim_v), q.dtype, q.device);
  if (!p.on_cpu()) {
    detail::cuda_attention_forward(p, detail::folded(p, out, p.heads_q, "out"), nullptr);
    return out;
  }
  detail::sdpa_forward_host(p, out, nullptr, nullptr);
  return out;
}

AttentionWithWeights scaled_dot_product_attention_with_weights(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  require_no_weights_on_device(p);
  AttentionWithWeights r;
  r.output = Tensor::empty(detail::output_shape(p, p.len_q, p.dim_v), q.dtype);
  r.weights = Tensor::empty(detail::output_shape(p, p.len_q, p.len_k), q.dtype);
  detail::sdpa_forward_host(p, r.output, &r.weights.view(), nullptr);
  return r;
}

void scaled_dot_product_attention_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const SdpaOptions& options,
                                       const std::optional<TensorView>& weights) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  detail::check_output_view(out, detail::output_shape(p, p.len_q, p.dim_v), q.dtype, "out");
  if (out.device != q.device) {
    throw Error("out: expected the query's device " + q.device.str() + ", got " + out.device.str());
  }
  if (weights) {
    require_no_weights_on_device(p);
    require_cpu(*weights, "weights");
    detail::check_output_view(*weights, detail::output_shape(p, p.len_q, p.len_k), q.dtype, "weights");
  }
  // Views whose batch dimensions do not fold into one stride are written through a copy.
  const bool out_folds = detail::fold_batch(out, p.batch_shape).has_value();
  const bool weights_fold = !weights || detail::fold_batch(*weights, p.batch_shape).has_value();
  if (!out_folds || !weights_fold) {
    if (!p.on_cpu()) throw Error("out: on " + out.device.str() + " its batch dimensions must fold into one stride");
    Tensor out_copy = Tensor::empty(out.sizes(), out.dtype), weights_copy;
    if (weights) weights_copy = Tensor::empty(weights->sizes(), weights->dtype);
    detail::sdpa_forward_host(p, out_copy, weights ? &weights_copy.view() : nullptr, nullptr);
    copy_into(out_copy, out);
    if (weights) copy_into(weights_copy, *weights);
    return;
  }
  if (!p.on_cpu()) {
    detail::cuda_attention_forward(p, detail::folded(p, out, p.heads_q, "out"), nullptr);
    return;
  }
  detail::sdpa_forward_host(p, out, weights ? &*weights : nullptr, nullptr);
}

AttentionForTraining scaled_dot_product_attention_for_training(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  AttentionForTraining r;
  const Shape lse_shape = detail::output_shape(p, p.len_q);
  if (!p.on_cpu()) {
    r.output = Tensor::empty(detail::output_shape(p, p.len_q, p.dim_v), q.dtype, q.device);
    r.lse = Tensor::empty(lse_shape, DType::f32, q.device);
    detail::cuda_attention_forward(p, detail::folded(p, r.output, p.heads_q, "out"), r.lse.data<float>());
    return r;
  }
  // bfloat16 / float16: computed in float32, the output rounded once, the log-sum-exp float32;
  // float64: output and log-sum-exp in float64.
  r.output = Tensor::empty(detail::output_shape(p, p.len_q, p.dim_v), q.dtype);
  r.lse = Tensor::empty(lse_shape, q.dtype == DType::f64 ? DType::f64 : DType::f32);
  detail::sdpa_forward_host(p, r.output, nullptr, r.lse.view().data);
  return r;
}

AttentionGradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const AttentionForTraining& saved,
                                                         const TensorView& grad_output, const SdpaOptions& options,
                                                         bool attn_mask_grad) {
  return scaled_dot_product_attention_backward(q, k, v, saved, grad_output, options,
                                               SdpaGradientsWanted{.attn_mask = attn_mask_grad});
}

AttentionGradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const AttentionForTraining& saved,
                                                         const TensorView& grad_output, const SdpaOptions& options,
                                                         const SdpaGradientsWanted& wanted) {
  const bool attn_mask_grad = wanted.attn_mask;
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  if (!p.on_cpu()) {
    const TensorView* operands[] = {&q, &k, &v};
    return backward_on_device(p, operands, saved, grad_output, wanted);
  }
  require_cpu(grad_output, "grad_output");
  require_cpu(saved.output, "saved.output");
  const Shape out_shape = detail::output_shape(p, p.len_q, p.dim_v);
  detail::check_output_view(saved.output, out_shape, q.dtype, "saved.output");
  const DType lse_dtype = q.dtype == DType::f64 ? DType::f64 : DType::f32;
  detail::check_output_view(saved.lse, detail::output_shape(p, p.len_q), lse_dtype, "saved.lse");
  detail::check_output_view(grad_output, out_shape, q.dtype, "grad_output");
  if (attn_mask_grad && (!options.attn_mask || options.attn_mask->dtype == DType::boolean)) {
    throw Error("attn_mask_grad: a gradient exists only for a float (additive) attn_mask");
  }
  // A mask's gradient is summed in float32 and rounded once to the mask's dtype.
  detail::BackwardViews views;
  Tensor output_copy, grad_copy, lse_copy;
  views.out = detail::fold_batch_or_copy(saved.output, p.batch_shape, output_copy, "saved.output");
  views.grad_out = detail::fold_batch_or_copy(grad_output, p.batch_shape, grad_copy, "grad_output");
  if (!saved.lse.view().is_contiguous()) lse_copy = Tensor::copy_of(saved.lse);  // the kernels read it packed
  views.lse = (lse_copy.defined() ? lse_copy.view() : saved.lse.view()).data;

  // The gradient of an input that broadcasts (along batch or head dimensions) is its gradient
  // over the full batch shape summed over those dimensions: the kernels write the full one in
  // float32 (float64 for float64 inputs) and sum_to_shape reduces it, rounding once. With such an input, bfloat16 / float16
  // gradients all come that way, in float32 first.
  const TensorView* inputs[] = {&q, &k, &v};
  const char* names_of[] = {"query", "key", "value"};
  const bool wanted_of[] = {wanted.query, wanted.key, wanted.value};
  const int64_t heads_of[] = {p.heads_q, p.heads_kv, p.heads_kv};
  const int64_t rows_of[] = {p.len_q, p.len_k, p.len_k}, cols_of[] = {p.dim_qk, p.dim_qk, p.dim_v};
  auto full_shape = [&](int i) {
    Shape full = p.batch_shape_with_heads(heads_of[i]);
    full.push_back(rows_of[i]);
    full.push_back(cols_of[i]);
    return full;
  };
  bool reduces[3], any_reduces = false;
  for (int i = 0; i < 3; ++i) {
    reduces[i] = wanted_of[i] && inputs[i]->numel() != checked_numel(full_shape(i), names_of[i]);
    any_reduces |= reduces[i];
  }
  const bool f64 = q.dtype == DType::f64;
  const bool via_float32 = any_reduces && q.dtype != DType::f32 && !f64;
  const DType full_dtype = f64 ? DType::f64 : DType::f32;  // of the full gradients that are summed
  std::array<Tensor, 3> written;  // what the kernels write: each gradient, or its full float32 form
  std::optional<TensorView>* views_of[] = {&views.dq, &views.dk, &views.dv};
  for (int i = 0; i < 3; ++i) {
    if (!wanted_of[i]) continue;  // not computed: its products are skipped
    if (reduces[i] || via_float32) {
      written[i] = Tensor::empty(full_shape(i), full_dtype);
    } else {
      written[i] = Tensor::empty(inputs[i]->sizes(), q.dtype);
    }
    *views_of[i] = detail::folded(p, written[i], heads_of[i], names_of[i]);
  }
  Tensor dscores;
  if (attn_mask_grad) {
    dscores = Tensor::empty(detail::output_shape(p, p.len_q, p.len_k), full_dtype);
    views.dscores = detail::folded(p, dscores, p.heads_q, "attn_mask");
  }
  detail::sdpa_backward_host(p, views);
  AttentionGradients g;
  const int threads = detail::resolve_threads(p.num_threads);  // for the sums over broadcast dimensions
  Tensor* results[] = {&g.query, &g.key, &g.value};
  for (int i = 0; i < 3; ++i) {
    if (!wanted_of[i]) continue;
    if (reduces[i]) {
      *results[i] = detail::sum_to_input(written[i], inputs[i]->sizes(), q.dtype, threads);
    } else if (via_float32) {  // the input's own size: rounded as it is (a zero keeps its sign)
      *results[i] = Tensor::copy_of(TensorView(written[i].view().data, DType::f32, inputs[i]->sizes()), q.dtype);
    } else {
      *results[i] = std::move(written[i]);
    }
  }
  if (attn_mask_grad) {
    // summed in float32, rounded once to the mask's dtype
    g.attn_mask = detail::sum_to_shape(dscores, options.attn_mask->sizes(), options.attn_mask->dtype, threads);
  }
  if (p.sinks) {
    const TensorView lse3(const_cast<void*>(views.lse), lse_dtype, {p.batch, p.heads_q, p.len_q});
    g.sinks = detail::sink_gradient(*p.sinks, views.out, views.grad_out, lse3, p.num_threads);
  }
  return g;
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
