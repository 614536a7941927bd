// The public scaled_dot_product_attention functions: validate, allocate, run the fused kernel.
#include "mha/sdpa.hpp"

#include <algorithm>
#include <array>

#include "core/attention_problem.hpp"
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"
#include "cuda/cuda_attention.hpp"

namespace mha {
namespace {

using detail::AttentionProblem;

void set_strides(const TensorView& view4d, int64_t* strides) {
  for (int d = 0; d < 4; ++d) strides[d] = view4d.strides[d];
}

// out is float32, or the inputs' bfloat16 / float16 (rounded in the kernel); weights float32.
void run(const AttentionProblem& p, const TensorView& out, const TensorView* weights) {
  detail::ForwardOutputs o;
  const TensorView out4 = detail::as_4d(out, "out");
  o.out = out4.data;
  o.out_dtype = out4.dtype;
  set_strides(out4, o.out_strides);
  if (weights) {
    const TensorView w4 = detail::as_4d(*weights, "weights");
    o.weights = w4.data_as<float>();
    set_strides(w4, o.weights_strides);
  }
  detail::run_attention(p, o);
}

// The forward for inputs of any supported dtype, into outputs of the inputs' dtype. float32 goes
// straight to the fused kernel; bfloat16 to the AMX kernel where the CPU has one and the problem
// fits it (no weights, head dims multiples of 32); otherwise bfloat16 and float16 run the float32
// kernel, which widens the inputs as it reads them and rounds each output row once as it stores
// it: the bits of the float32 kernel on widened copies, without the copies.
void forward(const AttentionProblem& p, const SdpaOptions& options, const TensorView& out, const TensorView* weights) {
  if (p.q.dtype == DType::f32) {
    run(p, out, weights);
    return;
  }
  if (weights == nullptr && detail::amx_usable() && detail::amx_bf16_supports(p)) {  // bf16 on the tile unit
    detail::AmxOutputs o;
    const TensorView out4 = detail::as_4d(out, "out");
    o.out = out4.data_as<uint16_t>();
    set_strides(out4, o.out_strides);
    detail::amx_bf16_forward(p, o);
    return;
  }
  const int threads = detail::resolve_threads(options.num_threads);
  Tensor weights32;
  if (weights) weights32 = Tensor::empty(weights->sizes());
  run(p, out, weights ? &weights32.view() : nullptr);
  if (weights) detail::parallel_copy_into(weights32, *weights, threads);
}

// Operands in CUDA memory go to the GPU kernel, which computes no weights matrix.
void require_no_weights_on_device(const AttentionProblem& p) {
  if (!p.on_cpu()) {
    throw Error("weights: the attention weights are not computed on " + p.q.device.str() +
                " (the fused GPU kernel never forms them); call scaled_dot_product_attention, or copy the inputs "
                "to the CPU");
  }
}

}  // namespace

Tensor scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::low_precision);
  detail::widen_mask_terms(p);
  Tensor out = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v), q.dtype, q.device);
  if (!p.on_cpu()) {
    detail::cuda_attention_forward(p, detail::as_4d(out, "out"), nullptr);
    return out;
  }
  forward(p, options, out, nullptr);
  return out;
}

AttentionWithWeights scaled_dot_product_attention_with_weights(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::low_precision);
  detail::widen_mask_terms(p);
  require_no_weights_on_device(p);
  AttentionWithWeights r;
  r.output = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v), q.dtype);
  r.weights = Tensor::empty(detail::output_shape(q, p.len_q, p.len_k), q.dtype);
  forward(p, options, r.output, &r.weights.view());
  return r;
}

void scaled_dot_product_attention_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const SdpaOptions& options,
                                       const std::optional<TensorView>& weights) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::low_precision);
  detail::widen_mask_terms(p);
  detail::check_output_view(out, detail::output_shape(q, p.len_q, p.dim_v), q.dtype, "out");
  if (out.device != q.device) {
    throw Error("out: expected the query's device " + q.device.str() + ", got " + out.device.str());
  }
  if (weights) {
    require_no_weights_on_device(p);
    require_cpu(*weights, "weights");
    detail::check_output_view(*weights, detail::output_shape(q, p.len_q, p.len_k), q.dtype, "weights");
  }
  if (!p.on_cpu()) {
    detail::cuda_attention_forward(p, detail::as_4d(out, "out"), nullptr);
    return;
  }
  forward(p, options, out, weights ? &*weights : nullptr);
}

AttentionForTraining scaled_dot_product_attention_for_training(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options) {
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::low_precision);
  detail::widen_mask_terms(p);
  AttentionForTraining r;
  Shape lse_shape = q.sizes();
  lse_shape.pop_back();
  if (!p.on_cpu()) {
    r.output = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v), q.dtype, q.device);
    r.lse = Tensor::empty(lse_shape, DType::f32, q.device);
    detail::cuda_attention_forward(p, detail::as_4d(r.output, "out"), r.lse.data<float>());
    return r;
  }
  // bfloat16 / float16: the float32 kernel widens the inputs as it reads them and rounds the
  // output once (the bits of the float32 path on widened copies); the log-sum-exp stays float32.
  r.output = Tensor::empty(detail::output_shape(q, p.len_q, p.dim_v), q.dtype);
  r.lse = Tensor::empty(lse_shape);
  detail::ForwardOutputs o;
  const TensorView out4 = detail::as_4d(r.output, "out");
  o.out = out4.data;
  o.out_dtype = out4.dtype;
  set_strides(out4, o.out_strides);
  o.lse = r.lse.data<float>();
  detail::run_attention(p, o);
  return r;
}

namespace {

// Sums a [B, H, Lq, Lk] gradient over the dimensions a mask of `shape` broadcasts along.
Tensor reduce_to_mask_shape(const Tensor& full, const TensorView& mask) {
  Tensor g = Tensor::zeros(mask.sizes());
  std::array<int64_t, 4> strides{};  // of g, over (b, h, i, j); 0 where the mask broadcasts
  const TensorView& gv = g.view();
  for (int d = 0; d < 4; ++d) {
    const int md = mask.ndim - 4 + d;
    if (md >= 0 && mask.shape[md] != 1) strides[d] = gv.strides[md];
  }
  const TensorView& f = full.view();
  const float* src = full.data<float>();
  float* dst = g.data<float>();
  for (int64_t b = 0; b < f.shape[0]; ++b)
    for (int64_t h = 0; h < f.shape[1]; ++h)
      for (int64_t i = 0; i < f.shape[2]; ++i)
        for (int64_t j = 0; j < f.shape[3]; ++j)
          dst[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]] +=
              src[((b * f.shape[1] + h) * f.shape[2] + i) * f.shape[3] + j];
  return g;
}

}  // namespace

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
  require_cpu(q, "query");  // the GPU backward is not part of this build
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::low_precision);
  detail::widen_mask_terms(p);
  require_cpu(grad_output, "grad_output");
  require_cpu(saved.output, "saved.output");
  const Shape out_shape = detail::output_shape(q, p.len_q, p.dim_v);
  detail::check_output_view(saved.output, out_shape, q.dtype, "saved.output");
  Shape lse_shape = q.sizes();
  lse_shape.pop_back();
  detail::check_output_view(saved.lse, lse_shape, DType::f32, "saved.lse");
  detail::check_output_view(grad_output, out_shape, q.dtype, "grad_output");
  if (attn_mask_grad && (!options.attn_mask || options.attn_mask->dtype == DType::boolean)) {
    throw Error("attn_mask_grad: a gradient exists only for a float (additive) attn_mask");
  }
  // bfloat16 / float16: the float32 kernel widens q, k, v and the output's gradient as it reads
  // their rows, reads the saved output as it is (for D = rowsum(dO O)) and rounds each gradient
  // row once, as it stores it: the bits of the float32 kernel on widened copies, without the
  // copies. A mask's gradient is summed in float32 and rounded once to the mask's dtype.
  AttentionGradients g;
  if (wanted.query) g.query = Tensor::empty(q.sizes(), q.dtype);
  if (wanted.key) g.key = Tensor::empty(k.sizes(), q.dtype);
  if (wanted.value) g.value = Tensor::empty(v.sizes(), q.dtype);
  detail::BackwardInputs in;
  const TensorView o4 = detail::as_4d(saved.output, "saved.output");
  in.out = o4.data;
  in.out_dtype = o4.dtype;
  set_strides(o4, in.out_strides);
  const TensorView g4 = detail::as_4d(grad_output, "grad_output");
  in.grad_out = g4.data;
  in.grad_out_dtype = g4.dtype;
  set_strides(g4, in.grad_out_strides);
  in.lse = saved.lse.data<float>();
  detail::BackwardOutputs out;
  out.grad_dtype = q.dtype;
  // Each gradient wanted, as a 4-d view (a null pointer for one that is not: its products are skipped).
  auto output = [](const Tensor& t, const char* name, void** data, int64_t* strides) {
    if (!t.defined()) return;
    const TensorView v4 = detail::as_4d(t, name);
    *data = v4.data;
    set_strides(v4, strides);
  };
  output(g.query, "query", &out.dq, out.dq_strides);
  output(g.key, "key", &out.dk, out.dk_strides);
  output(g.value, "value", &out.dv, out.dv_strides);
  Tensor dscores;
  if (attn_mask_grad) {
    dscores = Tensor::empty({p.batch, p.heads_q, p.len_q, p.len_k});
    out.dscores = dscores.data<float>();
    set_strides(dscores.view(), out.dscores_strides);
  }
  detail::run_attention_backward(p, in, out);
  if (attn_mask_grad) {
    g.attn_mask = reduce_to_mask_shape(dscores, *options.attn_mask);  // summed in float32
    if (options.attn_mask->dtype != DType::f32) g.attn_mask = Tensor::copy_of(*g.attn_mask, options.attn_mask->dtype);
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
