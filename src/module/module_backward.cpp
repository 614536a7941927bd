// MultiheadAttention::backward: the forward's steps in reverse.
//   out = A W_o^T + b_o        ->  dA = dY W_o,  dW_o = dY^T A,  db_o = sum dY
//   A = attention(Q, K, V)     ->  dQ, dK, dV by the fused backward (bias_k/bias_v rows included)
//   Q = X_q W_q^T + b_q, ...   ->  dX_q = dQ W_q,  dW_q = dQ^T X_q,  db_q = sum dQ, ...
// Every matrix is taken batch-major and contiguous ([N * L, C]) so each step is one gemm: float32,
// float64, or for a bfloat16 module in bfloat16 products (module_low_precision.cpp says when), each
// product rounded once to bfloat16 as PyTorch's bf16 module rounds its gradients' products.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/batch_dims.hpp"
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_f64.hpp"
#include "cpu/attention_kernel.hpp"
#include "mha/multihead_attention.hpp"
#include "module/forward_context.hpp"
#include "module/linear.hpp"
#include "module/parameter_set.hpp"

namespace mha {
namespace {

// An [N, L, C] view as batch-major contiguous rows: the view's own memory when it already is
// (batch_first inputs, the unpadded key rows), else a copy.
template <typename T>
struct Rows {
  Tensor copy;
  const T* data = nullptr;
};
template <typename T>
Rows<T> batch_major_rows(const TensorView& t, int threads) {
  if (t.is_contiguous()) return {Tensor(), t.data_as<const T>()};
  Rows<T> r{detail::parallel_copy_of(t, dtype_of<T>(), threads), nullptr};
  r.data = r.copy.template data<T>();
  return r;
}

// What sums of T are carried in: float64 for float64, float32 otherwise (bfloat16 rounded once).
template <typename T>
using Sum = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Column sums of a [rows, cols] matrix into `out`, over the threads in parts of 64 columns, each
// column summed in row order (the same bits on any thread count).
template <typename T>
void column_sums(const T* m, int64_t rows, int64_t cols, T* out, int threads) {
  constexpr int64_t kPart = 64;
  detail::parallel_for((cols + kPart - 1) / kPart, threads, [&](int64_t part, int) {
    const int64_t c0 = part * kPart, n = std::min(kPart, cols - c0);
    Sum<T> sums[kPart] = {};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c) sums[c] += static_cast<Sum<T>>(m[r * cols + c0 + c]);
    for (int64_t c = 0; c < n; ++c) out[c0 + c] = T(sums[c]);
  });
}

// Gradients through y = x W^T + b, for x [rows, in] and dy [rows, out] contiguous:
// dx = dy W, dW = dy^T x, db = sum dy, each where its destination is not null (an input that
// needs no gradient, a frozen weight or bias).
template <typename T>
void linear_backward(const T* x, const T* dy, const T* w, int64_t rows, int64_t in, int64_t out, T* dx, T* dw, T* db,
                     int threads) {
  if (dx) detail::gemm(false, false, rows, in, out, dy, out, w, in, 0.0f, dx, in, threads);
  if (dw) detail::gemm(true, false, out, in, rows, dy, out, x, in, 0.0f, dw, in, threads);
  if (db) column_sums(dy, rows, out, db, threads);
}

// The attention's backward by the float64 kernel (cpu/attention_f64.hpp), which forms each head's
// probabilities explicitly: a float64 module's, and a float32 one's whose weights' gradient is
// given (the fused kernels take none), there on float64 copies of its operands, each gradient
// rounded to float32 once. heads_out, heads_grad and the gradients are [N, H, L, *] views of T;
// grad_weights is shaped as the forward returned the weights (averaged over the heads or not).
template <typename T>
void explicit_attention_backward(const detail::AttentionProblem& p, const TensorView& heads_out,
                                 const TensorView& heads_grad, const std::optional<TensorView>& grad_weights,
                                 bool weights_averaged, bool batched, const TensorView* dq, const TensorView* dk,
                                 const TensorView* dv, const TensorView* dscores) {
  constexpr bool widen = !std::is_same_v<T, double>;
  const int threads = p.num_threads;
  std::vector<Tensor> copies;
  auto as_f64 = [&](const TensorView& t) {
    if (!widen) return t;
    copies.push_back(detail::parallel_copy_of(t, DType::f64, threads));
    return copies.back().view();
  };
  auto destination = [&](const TensorView* t) {
    if (t == nullptr) return TensorView();
    if (!widen) return *t;
    copies.push_back(Tensor::empty(t->sizes(), DType::f64));
    return copies.back().view();
  };
  detail::AttentionProblem wide = p;
  wide.q = as_f64(p.q), wide.k = as_f64(p.k), wide.v = as_f64(p.v);
  const TensorView out = as_f64(heads_out), grad = as_f64(heads_grad);
  const TensorView gq = destination(dq), gk = destination(dk), gv = destination(dv), gs = destination(dscores);
  detail::Float64Backward b;
  auto set = [](const TensorView& t, auto** data, int64_t* strides) {
    if (t.data == nullptr) return;
    *data = static_cast<std::remove_reference_t<decltype(*data)>>(t.data);
    for (int d = 0; d < 4; ++d) strides[d] = t.strides[d];
  };
  set(out, &b.out, b.out_strides);
  set(grad, &b.grad_out, b.grad_out_strides);
  set(gq, &b.dq, b.dq_strides);
  set(gk, &b.dk, b.dk_strides);
  set(gv, &b.dv, b.dv_strides);
  set(gs, &b.dscores, b.dscores_strides);
  if (grad_weights) {  // [N,] L, S' (averaged: each head's share is 1 / H) or [N,] H, L, S'
    const TensorView w = as_f64(*grad_weights);
    const int n = w.ndim;
    b.grad_weights = w.data_as<const double>();
    b.grad_weights_strides[0] = batched ? w.strides[0] : 0;
    b.grad_weights_strides[1] = weights_averaged ? 0 : w.strides[n - 3];
    b.grad_weights_strides[2] = w.strides[n - 2];
    b.grad_weights_strides[3] = w.strides[n - 1];
    b.grad_weights_scale = weights_averaged ? 1.0 / static_cast<double>(p.heads_q) : 1.0;
  }
  detail::attention_backward_f64(wide, b);
  if (!widen) return;
  for (const auto& [from, to] : {std::pair{gq, dq}, std::pair{gk, dk}, std::pair{gv, dv}, std::pair{gs, dscores}}) {
    if (to != nullptr) detail::parallel_copy_into(from, *to, threads);
  }
}

}  // namespace

const Tensor& ModuleGradients::parameter(const std::string& name) const {
  for (const auto& [n, t] : parameters) {
    if (n == name) return t;
  }
  throw Error("ModuleGradients::parameter: no gradient named '" + name + "'");
}

namespace {

// wanted.frozen_parameters must name parameters of this call.
void check_frozen_names(const WantedGradients& wanted, const std::vector<std::pair<std::string, TensorView>>& parameters) {
  for (const std::string& frozen : wanted.frozen_parameters) {
    const bool known = std::any_of(parameters.begin(), parameters.end(), [&](const auto& p) { return p.first == frozen; });
    if (known) continue;
    std::string names;
    for (const auto& [name, view] : parameters) names += (names.empty() ? "" : ", ") + name;
    throw Error("wanted.frozen_parameters: expected names of this module's parameters (" + names + "), got '" +
                frozen + "'");
  }
}

// The pointer into `t`, or null for an offset into an undefined (frozen) gradient.
template <typename T>
T* offset_or_null(T* t, int64_t offset) {
  return t ? t + offset : nullptr;
}

}  // namespace

ModuleGradients MultiheadAttention::backward(const ForwardContext& context, const TensorView& grad_output,
                                             const WantedGradients& wanted,
                                             const std::optional<TensorView>& grad_weights) const {
  return backward_any(parameters_for_call(nullptr, "backward"), context, grad_output, wanted, grad_weights);
}

ModuleGradients MultiheadAttention::backward_with(const ParameterViews& parameters, const ForwardContext& context,
                                                  const TensorView& grad_output, const WantedGradients& wanted,
                                                  const std::optional<TensorView>& grad_weights) const {
  return backward_any(parameters_for_call(&parameters, "backward_with"), context, grad_output, wanted, grad_weights);
}

ModuleGradients MultiheadAttention::backward_any(const std::vector<std::pair<std::string, TensorView>>& parameters,
                                                 const ForwardContext& context, const TensorView& grad_output,
                                                 const WantedGradients& wanted,
                                                 const std::optional<TensorView>& grad_weights) const {
  if (context.empty()) throw Error("backward: the context is empty; pass it to forward(..., &context) first");
  check_frozen_names(wanted, parameters);
  if (context.state_->module_dtype != options_.dtype) {
    throw Error("backward: the context comes from a " + std::string(dtype_name(context.state_->module_dtype)) +
                " forward, but the module's parameters are now " + std::string(dtype_name(options_.dtype)));
  }
  const int threads = context.state_->problem.num_threads;
  if (options_.dtype == DType::f64) {
    return backward_full<double>(detail::float64_parameters(parameters, threads), context, grad_output, wanted,
                                 grad_weights);
  }
  if (options_.dtype != DType::f32) return backward_low_precision(parameters, context, grad_output, wanted, grad_weights);
  return backward_full<float>(detail::float32_parameters(parameters, threads), context, grad_output, wanted,
                              grad_weights);
}

template <typename T>
ModuleGradients MultiheadAttention::backward_full(const detail::ParameterSet& parameters,
                                                  const ForwardContext& context, const TensorView& grad_output,
                                                  const WantedGradients& wanted,
                                                  const std::optional<TensorView>& grad_weights) const {
  constexpr DType dtype = dtype_of<T>();
  const ForwardContext::State& st = *context.state_;
  require_cpu(grad_output, "grad_output");
  if (grad_output.sizes() != st.output_shape || grad_output.dtype != dtype) {
    throw Error("grad_output: expected " + std::string(dtype_name(dtype)) + " of shape " +
                TensorView(nullptr, dtype, st.output_shape).shape_str() +
                ", got " + std::string(dtype_name(grad_output.dtype)) + " " + grad_output.shape_str());
  }
  if (grad_output.numel() > 0 && grad_output.data == nullptr) throw Error("grad_output: data pointer is null");
  if (grad_weights) {
    require_cpu(*grad_weights, "grad_weights");
    if (!st.weights_shape) throw Error("grad_weights: the forward returned no weights (need_weights was false)");
    if (grad_weights->sizes() != *st.weights_shape || grad_weights->dtype != dtype) {
      throw Error("grad_weights: expected " + std::string(dtype_name(dtype)) + " of shape " +
                  TensorView(nullptr, dtype, *st.weights_shape).shape_str() + " (the weights returned), got " +
                  std::string(dtype_name(grad_weights->dtype)) + " " + grad_weights->shape_str());
    }
    if (grad_weights->numel() > 0 && grad_weights->data == nullptr) throw Error("grad_weights: data pointer is null");
  }
  const detail::ModuleCall& c = st.call;
  const detail::AttentionProblem& p = st.problem;
  const int threads = p.num_threads;
  const int64_t E = embed_dim_, H = num_heads_, N = c.batch, L = c.len_q, S = c.len_k, St = c.total_keys();
  auto as_nle = [&](const TensorView& t) {
    if (!c.batched) return t.unsqueeze(0);
    return options_.batch_first ? t : t.transpose(0, 1);
  };

  ModuleGradients g;
  std::vector<std::pair<std::string, Tensor>> grads;
  auto frozen = [&](const std::string& name) {
    return std::find(wanted.frozen_parameters.begin(), wanted.frozen_parameters.end(), name) !=
           wanted.frozen_parameters.end();
  };
  for (const auto& [name, t] : parameters.views) {
    grads.emplace_back(name, frozen(name) ? Tensor() : Tensor::zeros(t.sizes(), dtype));
  }
  auto grad_of = [&](const std::string& name) -> T* {
    for (auto& [n, t] : grads)
      if (n == name) return t.defined() ? t.template data<T>() : nullptr;
    return nullptr;
  };

  // The input projections' gradients wanted: dX = dY W for the inputs asked for, dW = dY^T X and
  // db = sum dY for the parameters not frozen. The attention's dQ, dK, dV are computed only where
  // one of them (or bias_k / bias_v, from the appended row) needs it.
  struct Projection {
    const TensorView& x;
    int64_t rows, in;
    const T* w;
    T* dw;
    T* db;
    Tensor dx;
    bool needs_dy() const { return dx.defined() || dw != nullptr || db != nullptr; }
  };
  const bool packed = qkv_same_embed_dim();
  const T* w_in = packed ? parameters.data<T>("in_proj_weight") : nullptr;
  T* dw_in = packed ? grad_of("in_proj_weight") : nullptr;
  T* db_in = grad_of("in_proj_bias");
  auto input_grad = [&](bool on, int64_t rows, int64_t width) {
    return on ? Tensor::empty({N, rows, width}, dtype) : Tensor();
  };
  Projection projections[3] = {
      {c.query, L, E, packed ? w_in : parameters.data<T>("q_proj_weight"), packed ? dw_in : grad_of("q_proj_weight"),
       db_in, input_grad(wanted.query, L, E)},
      {c.key, S, kdim_, packed ? w_in + E * E : parameters.data<T>("k_proj_weight"),
       packed ? offset_or_null(dw_in, E * E) : grad_of("k_proj_weight"), offset_or_null(db_in, E),
       input_grad(wanted.key, S, kdim_)},
      {c.value, S, vdim_, packed ? w_in + 2 * E * E : parameters.data<T>("v_proj_weight"),
       packed ? offset_or_null(dw_in, 2 * E * E) : grad_of("v_proj_weight"), offset_or_null(db_in, 2 * E),
       input_grad(wanted.value, S, vdim_)},
  };
  T* d_bias_k = options_.add_bias_kv ? grad_of("bias_k") : nullptr;
  T* d_bias_v = options_.add_bias_kv ? grad_of("bias_v") : nullptr;
  // A float mask's gradient is dS (over the S keys given, not the appended ones), summed over
  // what the mask broadcasts along.
  auto float_mask = [](const std::optional<TensorView>& m) { return m && m->dtype != DType::boolean; };
  const bool attn_mask_grad = wanted.attn_mask && float_mask(c.attn_mask);
  const bool padding_grad = wanted.key_padding_mask && float_mask(c.key_padding_mask);
  const bool attention_runs = projections[0].needs_dy() || projections[1].needs_dy() || projections[2].needs_dy() ||
                              d_bias_k || d_bias_v || attn_mask_grad || padding_grad;
  // (float32 for a bfloat16 module too: the fused kernels' dS, and the mask gradients' dtype)
  constexpr DType score_dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  const Tensor dscores = attn_mask_grad || padding_grad ? Tensor::empty({N, H, L, St}, score_dtype) : Tensor();

  // 1. Output projection (dA only when the attention's backward runs).
  const Rows<T> dy = batch_major_rows<T>(as_nle(grad_output), threads);  // [N, L, E]
  T* dw_out = grad_of("out_proj.weight");
  const Rows<T> a = dw_out ? batch_major_rows<T>(as_nle(st.attn), threads) : Rows<T>{};
  Tensor da = attention_runs ? Tensor::empty({N, L, E}, dtype) : Tensor();
  linear_backward<T>(a.data, dy.data, parameters.data<T>("out_proj.weight"), N * L, E, E,
                     da.defined() ? da.data<T>() : nullptr, dw_out, grad_of("out_proj.bias"), threads);

  // 2. Attention: the fused backward, or the float64 kernel (a float64 module, or a gradient of
  //    the returned weights).
  auto attention_grad = [&](bool on, int64_t rows) { return on ? Tensor::empty({N, rows, E}, dtype) : Tensor(); };
  const Tensor dq = attention_grad(projections[0].needs_dy(), L),
               dk = attention_grad(projections[1].needs_dy() || d_bias_k, St),
               dv = attention_grad(projections[2].needs_dy() || d_bias_v, St);
  if (attention_runs) {
    const TensorView heads_out = as_nle(st.attn).split_dim(2, H).transpose(1, 2);
    const TensorView heads_grad = da.view().split_dim(2, H).transpose(1, 2);
    // [N, L or St, E] gradients as heads [N, H, *, E/H]; a null view for one not wanted.
    auto heads = [&](const Tensor& t) { return t.defined() ? t.view().split_dim(2, H).transpose(1, 2) : TensorView(); };
    const TensorView dq_heads = heads(dq), dk_heads = heads(dk), dv_heads = heads(dv);
    if (std::is_same_v<T, double> || grad_weights) {
      explicit_attention_backward<T>(p, heads_out, heads_grad, grad_weights, st.weights_averaged, c.batched,
                                     dq.defined() ? &dq_heads : nullptr, dk.defined() ? &dk_heads : nullptr,
                                     dv.defined() ? &dv_heads : nullptr, dscores.defined() ? &dscores.view() : nullptr);
    } else {  // float32: the fused kernels
      detail::BackwardInputs in;
      in.out = heads_out.data;
      in.out_dtype = in.grad_out_dtype = dtype;
      in.grad_out = heads_grad.data;
      in.lse = st.lse.data_as<const float>();
      for (int d = 0; d < 4; ++d) {
        in.out_strides[d] = heads_out.strides[d];
        in.grad_out_strides[d] = heads_grad.strides[d];
      }
      detail::BackwardOutputs out;
      out.grad_dtype = dtype;
      out.dq = dq_heads.data, out.dk = dk_heads.data, out.dv = dv_heads.data;
      for (int d = 0; d < 4; ++d) {
        out.dq_strides[d] = dq_heads.strides[d];
        out.dk_strides[d] = dk_heads.strides[d];
        out.dv_strides[d] = dv_heads.strides[d];
      }
      if (dscores.defined()) {
        out.dscores = dscores.data<float>();
        for (int d = 0; d < 4; ++d) out.dscores_strides[d] = dscores.view().strides[d];
      }
      detail::run_attention_backward(p, in, out);
    }
  }
  if (dscores.defined()) {
    const TensorView ds = dscores.view().slice(3, 0, S);  // [N, H, L, S]
    constexpr DType sd = score_dtype;
    if (attn_mask_grad && c.attn_mask->ndim == 3) {  // [N * H, L, S]: one slice per (batch entry, head)
      g.attn_mask = Tensor::copy_of(TensorView(ds.data, sd, {N * H, L, S}, {ds.strides[1], ds.strides[2], 1}));
    } else if (attn_mask_grad) {  // [L, S]: summed over the batch and the heads
      g.attn_mask = detail::sum_to_shape(ds, c.attn_mask->sizes(), sd, threads);
    }
    if (padding_grad) {  // [N, S] (or [S] unbatched): summed over the heads and the queries
      const Tensor summed = detail::sum_to_shape(TensorView(ds.data, sd, {N, H * L, S}, {ds.strides[0], ds.strides[2], 1}),
                                                 {N, 1, S}, sd, threads);
      g.key_padding_mask = Tensor::copy_of(TensorView(summed.view().data, sd, c.key_padding_mask->sizes()));
    }
  }

  // 3. bias_k and bias_v receive the gradient of their appended row, summed over the batch.
  for (const auto& [grad, d] : {std::pair{d_bias_k, &dk}, std::pair{d_bias_v, &dv}}) {
    if (grad == nullptr) continue;  // frozen, or no such parameter
    for (int64_t e = 0; e < E; ++e) {
      Sum<T> sum = 0;
      for (int64_t n = 0; n < N; ++n) sum += static_cast<Sum<T>>(d->template data<T>()[(n * St + S) * E + e]);
      grad[e] = T(sum);
    }
  }

  // 4. Input projections. The inputs X, the forward's own copies viewed [N, L, C], are made
  //    batch-major only for a weight gradient, and self-attention's one input once, not three times.
  std::vector<std::pair<const TensorView*, Rows<T>>> inputs;  // one batch-major copy per distinct input
  inputs.reserve(3);
  auto rows_of = [&](const TensorView& x) {
    for (const auto& [seen, rows] : inputs)
      if (detail::same_view(*seen, x)) return rows.data;
    return inputs.emplace_back(&x, batch_major_rows<T>(x, threads)).second.data;
  };
  const Tensor* attention_grads[3] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; ++i) {
    Projection& pr = projections[i];
    if (!pr.needs_dy()) continue;
    const Rows<T> dy = batch_major_rows<T>(attention_grads[i]->view().slice(1, 0, pr.rows), threads);  // [N, rows, E]
    linear_backward<T>(pr.dw ? rows_of(pr.x) : nullptr, dy.data, pr.w, N * pr.rows, pr.in, E,
                       pr.dx.defined() ? pr.dx.template data<T>() : nullptr, pr.dw, pr.db, threads);
  }
  const Tensor &dxq = projections[0].dx, &dxk = projections[1].dx, &dxv = projections[2].dx;

  // 5. Input gradients in the caller's layout.
  auto input_gradient = [&](const Tensor& dx, const Shape& shape) {
    if (!dx.defined()) return Tensor();
    Tensor t = Tensor::empty(shape, dtype);
    detail::parallel_copy_into(dx, as_nle(t.view()), threads);
    return t;
  };
  g.query = input_gradient(dxq, st.query_shape);
  g.key = input_gradient(dxk, st.key_shape);
  g.value = input_gradient(dxv, st.value_shape);
  g.parameters = std::move(grads);
  return g;
}

template ModuleGradients MultiheadAttention::backward_full<float>(const detail::ParameterSet&, const ForwardContext&,
                                                                  const TensorView&, const WantedGradients&,
                                                                  const std::optional<TensorView>&) const;
template ModuleGradients MultiheadAttention::backward_full<double>(const detail::ParameterSet&, const ForwardContext&,
                                                                   const TensorView&, const WantedGradients&,
                                                                   const std::optional<TensorView>&) const;
template ModuleGradients MultiheadAttention::backward_full<bfloat16>(const detail::ParameterSet&, const ForwardContext&,
                                                                     const TensorView&, const WantedGradients&,
                                                                     const std::optional<TensorView>&) const;

}  // namespace mha
