// A training forward's context as tensors and back: ForwardContext::activations() and
// MultiheadAttention::restore_context(). A caller that can keep only tensors between a forward
// and its backward (a compiled PyTorch graph) saves the activations and the inputs, and the
// backward rebuilds the context from them: the masks and the call are derived again from the
// inputs and options (cheap), nothing is computed again.
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"
#include "mha/multihead_attention.hpp"
#include "module/forward_context.hpp"
#include "module/module_bf16_forward.hpp"
#include "module/module_call.hpp"

namespace mha {
namespace {

// `t` as a contiguous tensor: one the context owns and views whole, shared; else a copy. A
// bfloat16 activation (a forward in bfloat16 products) is widened, exactly, to float32.
Tensor contiguous_tensor(const TensorView& t, const std::vector<Tensor>& storage) {
  if (t.dtype == DType::bf16) return Tensor::copy_of(t, DType::f32);
  for (const Tensor& s : storage) {
    if (s.defined() && detail::same_view(s.view(), t)) return s;
  }
  return Tensor::copy_of(t);
}

// The activation `name` checked against the dtype and shape the call implies (on the host), and
// made unit-stride along its features (the kernels read rows); a copy only where it is not.
TensorView checked_activation(const TensorView& t, const char* name, DType dtype, const Shape& expected,
                              std::vector<Tensor>& owned) {
  require_cpu(t, std::string("activations.") + name);
  if (t.dtype != dtype || t.sizes() != expected) {
    throw Error(std::string("activations.") + name + ": expected " + std::string(dtype_name(dtype)) + " of shape " +
                TensorView(nullptr, dtype, expected).shape_str() + " (from the inputs and options), got " +
                std::string(dtype_name(t.dtype)) + " " + t.shape_str());
  }
  if (t.numel() > 0 && t.data == nullptr) throw Error(std::string("activations.") + name + ": data pointer is null");
  if (t.is_contiguous()) return t;
  owned.push_back(Tensor::copy_of(t));
  return owned.back().view();
}

}  // namespace

SavedActivations ForwardContext::activations() const {
  if (empty()) throw Error("activations: the context is empty; pass it to forward(..., &context) first");
  const State& st = *state_;
  return {contiguous_tensor(st.q, st.storage), contiguous_tensor(st.k, st.storage),
          contiguous_tensor(st.v, st.storage), contiguous_tensor(st.attn, st.storage),
          contiguous_tensor(st.lse, st.storage)};
}

ForwardContext MultiheadAttention::restore_context(const TensorView& query, const TensorView& key,
                                                   const TensorView& value, const ForwardOptions& options,
                                                   const ActivationViews& activations) const {
  if (options_.dtype == DType::f32 || options_.dtype == DType::f64) {
    return restore_full(query, key, value, options, activations);
  }
  detail::validate_module_call(*this, query, key, value, options);  // dtypes against the module's
  const int threads = detail::resolve_threads(options.num_threads);
  if (detail::bf16_products_training(*this)) {
    // The forward ran in bfloat16 products (module_low_precision.cpp): its q, k, v and attention
    // output were bfloat16, handed out widened, and are narrowed back (exactly).
    std::vector<Tensor> narrowed;
    auto narrow = [&](const TensorView& t, const char* name) {
      require_cpu(t, std::string("activations.") + name);
      if (t.dtype != DType::f32) {
        throw Error(std::string("activations.") + name + ": expected float32, got " + std::string(dtype_name(t.dtype)));
      }
      if (t.numel() > 0 && t.data == nullptr) throw Error(std::string("activations.") + name + ": data pointer is null");
      narrowed.push_back(detail::parallel_copy_of(t, DType::bf16, threads));
      return narrowed.back().view();
    };
    ActivationViews bf16 = activations;
    bf16.q = narrow(activations.q, "q"), bf16.k = narrow(activations.k, "k"), bf16.v = narrow(activations.v, "v");
    bf16.attn = narrow(activations.attn, "attn");
    ForwardContext context = restore_full(query, key, value, options, bf16);
    for (Tensor& t : narrowed) context.state_->storage.push_back(std::move(t));
    return context;
  }
  detail::WidenedCall wide_call = detail::widened_call(query, key, value, options, options_.dtype, threads);
  const MultiheadAttention wide(*this, DType::f32, /*parameters=*/false);
  ForwardContext context = wide.restore_full(wide_call.query, wide_call.key, wide_call.value, wide_call.options,
                                                activations);
  ForwardContext::State& st = *context.state_;
  for (const Tensor& t : {wide_call.query, wide_call.key, wide_call.value, wide_call.attn_mask,
                          wide_call.key_padding_mask}) {
    if (t.defined()) st.inputs.push_back(t);  // what the restored call views
  }
  st.module_dtype = options_.dtype;
  return context;
}

ForwardContext MultiheadAttention::restore_full(const TensorView& query, const TensorView& key,
                                                const TensorView& value, const ForwardOptions& options,
                                                const ActivationViews& activations) const {
  const detail::ModuleCall c = detail::validate_module_call(*this, query, key, value, options);
  const double dropout_p = training_ ? options_.dropout : 0.0;
  if (dropout_p > 0 && !options.dropout_seed) {
    throw Error("options.dropout_seed: expected the forward's seed (dropout runs in training mode), got none");
  }
  const int64_t E = embed_dim_, H = num_heads_, N = c.batch, L = c.len_q, St = c.total_keys();
  auto st = std::make_unique<ForwardContext::State>();
  st->call = c;
  st->query_shape = query.sizes(), st->key_shape = key.sizes(), st->value_shape = value.sizes();
  st->output_shape = detail::module_output_shape(c, *this, options_.batch_first);
  if (options.need_weights) {
    st->weights_shape = detail::module_weights_shape(c, num_heads_, options.average_attn_weights);
    st->weights_averaged = options.average_attn_weights;
  }
  const DType dtype = options_.dtype;  // float32, float64, or bfloat16 (with a float32 lse)
  st->q = checked_activation(activations.q, "q", dtype, {N, L, E}, st->storage);
  st->k = checked_activation(activations.k, "k", dtype, {N, St, E}, st->storage);
  st->v = checked_activation(activations.v, "v", dtype, {N, St, E}, st->storage);
  st->attn = checked_activation(activations.attn, "attn", dtype, st->output_shape, st->storage);
  st->lse = checked_activation(activations.lse, "lse", dtype == DType::f64 ? DType::f64 : DType::f32, {N, H, L},
                               st->storage);
  st->module_dtype = dtype;
  st->masks = detail::module_mask_terms(c, H);
  st->problem = detail::module_attention_problem(c, st->masks, H, st->q, st->k, st->v,
                                                 detail::resolve_threads(options.num_threads));
  st->problem.dropout_p = dropout_p;
  if (dropout_p > 0) st->problem.dropout_seed = *options.dropout_seed;
  ForwardContext context;
  context.state_ = std::move(st);
  return context;
}

}  // namespace mha
