// mha::MultiheadAttention: torch.nn.MultiheadAttention in C++, with the same options, parameter
// names and layouts, mask conventions and results.
//
//   q = query W_q^T + b_q,  k = key W_k^T + b_k,  v = value W_v^T + b_v      (projections)
//   head_i = softmax(q_i k_i^T / sqrt(E/H) + mask) v_i      for i = 1..H    (split into heads)
//   out = concat(head_1, ..., head_H) W_o^T + b_o                            (merge, project)
//
// Inputs are [L, N, E] (or [N, L, E] with batch_first, or unbatched [L, E]); key and value may
// come from another sequence (cross-attention) with their own widths kdim and vdim.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha {

namespace detail {
struct ParameterSet;
}

// Parameters by their PyTorch names (see MultiheadAttention::named_parameters()), as views.
using ParameterViews = std::unordered_map<std::string, TensorView>;

struct MultiheadAttentionOptions {
  double dropout = 0.0;        // on the attention weights, in training mode only
  bool bias = true;            // in_proj_bias and out_proj.bias
  bool add_bias_kv = false;    // learnable bias_k, bias_v appended to the key/value sequence
  bool add_zero_attn = false;  // a zero key/value appended after the projections
  std::optional<int64_t> kdim;  // key width; default embed_dim
  std::optional<int64_t> vdim;  // value width; default embed_dim
  bool batch_first = false;     // inputs [N, L, E] instead of [L, N, E]
  uint64_t seed = 0;            // initialisation and dropout stream
  // The parameters' dtype, and so the inputs' and outputs' (as with torch's `dtype=` or
  // `module.to(dtype)`): float32, float64, bfloat16 or float16. float64 computes in float64 throughout
  // (for gradient checks, as PyTorch's float64 module does). The low-precision modules compute in
  // float32 (projections, attention, softmax statistics) on widened copies and round the output,
  // the weights and the gradients once to their dtype; except a bfloat16 module's inference on a
  // CPU with AMX (no context, no weights returned, no dropout, no bias_kv / zero_attn, head dim of
  // at least 16, more than 4 queries), which rounds where PyTorch's bf16 module rounds: each
  // projection and the attention output to bfloat16, the attention on the tile unit.
  DType dtype = DType::f32;
  // false: the module holds no parameters of its own and runs only through forward_with and
  // backward_with (as a module on PyTorch's meta device runs through functional_call). mha.nn in
  // Python builds its modules so, since their parameters are torch tensors.
  bool own_parameters = true;
};

struct ForwardOptions {
  // Module conventions (unlike SDPA's): a bool true means *masked out*; a float is added.
  std::optional<TensorView> key_padding_mask;  // [N, S] or [S] unbatched; bool, float32 or the module's dtype
  bool need_weights = true;
  std::optional<TensorView> attn_mask;  // [L, S] or [N * num_heads, L, S]; bool, float32 or the module's dtype
  bool average_attn_weights = true;     // weights [N, L, S] (mean over heads) or [N, H, L, S]
  // Applies a top-left causal mask over the L x S keys given (the bias_k and zero-attention
  // columns stay visible, as they do for a causal attn_mask in PyTorch). PyTorch treats is_causal
  // as a hint that attn_mask is causal and requires attn_mask with it; here attn_mask is optional
  // and, if given, applies as well.
  bool is_causal = false;
  std::optional<uint64_t> dropout_seed;  // default: the module's stream, advanced per call
  int num_threads = 0;                   // 0: the library's setting
};

struct ForwardResult {
  Tensor output;                  // shaped like query, but with embed_dim features
  std::optional<Tensor> weights;  // present when need_weights
};

// What a training forward keeps for the backward: the inputs, the projections, the attention
// output and the per-row log-sum-exp of the scores (never the L x S matrix), the masks and the
// dropout seed. Owns copies of everything, so the caller's inputs need not outlive it.
// A training forward's activations as tensors (float32; float64 for a float64 module), for callers that keep tensors rather
// than objects between a forward and its backward: a compiled PyTorch graph saves tensors only.
// MultiheadAttention::restore_context builds the context again from them.
struct ActivationViews {
  TensorView q, k, v;  // the projections [N, L, E], [N, S', E], [N, S', E] (S': keys + bias_k/zero rows)
  TensorView attn;     // the attention output before out_proj, shaped like the module's output
  TensorView lse;      // the log-sum-exp of each row of scores, [N, H, L]
};
struct SavedActivations {
  Tensor q, k, v, attn, lse;  // as in ActivationViews
  ActivationViews views() const { return {q.view(), k.view(), v.view(), attn.view(), lse.view()}; }
};

class ForwardContext {
 public:
  ForwardContext();
  ~ForwardContext();
  ForwardContext(ForwardContext&&) noexcept;
  ForwardContext& operator=(ForwardContext&&) noexcept;
  bool empty() const { return state_ == nullptr; }
  // The activations, contiguous; shared with the context where it holds them so, else copied.
  SavedActivations activations() const;
  struct State;

 private:
  friend class MultiheadAttention;
  std::unique_ptr<State> state_;
};

// Gradients of a scalar loss with respect to the inputs and the parameters, given the gradient of
// the output (and, where the loss uses them, of the returned attention weights: backward()).
// Which gradients a backward computes, all by default. An input that needs none (a frozen
// encoder's output fed as key and value, as autograd's needs_input_grad says) saves its
// projection's dX = dY W product; a frozen parameter (fine-tuning that keeps the attention's
// weights fixed, requires_grad false) saves its dW = dY^T X product, half the projections'
// backward FLOPs when every weight is frozen. Those left out are undefined tensors in
// ModuleGradients.
// A float attn_mask or key_padding_mask (a learned bias) gets its gradient only when asked.
struct WantedGradients {
  bool query = true, key = true, value = true;
  std::vector<std::string> frozen_parameters;  // names from named_parameters()
  bool attn_mask = false, key_padding_mask = false;  // (a bool mask has none)
};

struct ModuleGradients {
  Tensor query, key, value;                                 // shaped like the inputs (or undefined: WantedGradients)
  Tensor attn_mask, key_padding_mask;                       // float32 (float64 module: float64), shaped like the masks, where asked for
  std::vector<std::pair<std::string, Tensor>> parameters;  // named_parameters() order (frozen: undefined)
  const Tensor& parameter(const std::string& name) const;
};

class MultiheadAttention {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, const MultiheadAttentionOptions& options = {});
  // Copies are deep (their own parameters); moves take the parameters over.
  MultiheadAttention(const MultiheadAttention& other);
  MultiheadAttention& operator=(const MultiheadAttention& other);
  MultiheadAttention(MultiheadAttention&& other) noexcept;
  MultiheadAttention& operator=(MultiheadAttention&& other) noexcept;
  ~MultiheadAttention() = default;

  ForwardResult forward(const TensorView& query, const TensorView& key, const TensorView& value,
                        const ForwardOptions& options = {}) const;
  // The same forward, also filling `context` for backward().
  ForwardResult forward(const TensorView& query, const TensorView& key, const TensorView& value,
                        const ForwardOptions& options, ForwardContext* context) const;
  // Gradients for the forward that filled `context`. The context keeps that forward's activations,
  // not the parameters: backward reads this module's parameters as they are now, so they must be
  // the values the forward ran with.
  // Deterministic: the same inputs give bit-identical gradients on every run and thread count.
  // grad_weights, where given, is the gradient of the weights that forward returned (need_weights;
  // their shape and dtype), for a loss that uses them (attention supervision, distillation), as
  // PyTorch's module differentiates them. Such a backward forms each head's probabilities
  // explicitly, in float64 (the weights were materialised anyway), and rounds once.
  ModuleGradients backward(const ForwardContext& context, const TensorView& grad_output,
                           const WantedGradients& wanted = {},
                           const std::optional<TensorView>& grad_weights = std::nullopt) const;
  // The context forward(query, key, value, options, &context) filled, built again from its
  // activations() without computing anything, for a backward. It reads the inputs, the masks and
  // the activations where they are (a bfloat16/float16 module widens the inputs), so they must
  // outlive it unchanged. options must be the forward's: its masks, is_causal and num_threads,
  // and its dropout seed where dropout ran (training mode, dropout > 0), which is then required.
  ForwardContext restore_context(const TensorView& query, const TensorView& key, const TensorView& value,
                                 const ForwardOptions& options, const ActivationViews& activations) const;

  // The same forward and backward reading `parameters` instead of the module's own, which are
  // left alone (as torch.func.functional_call runs a module with other tensors): a PyTorch
  // module's parameters are used where they are, with no copy into this one. `parameters` must
  // name exactly this module's parameters, each with its shape and the module's dtype (any
  // strides; contiguous float32 and float64 ones are read in place). They are read during the call only;
  // backward_with must be given the values its forward ran with. Concurrent calls with different
  // parameters are safe, as they change nothing in the module but its dropout stream.
  ForwardResult forward_with(const ParameterViews& parameters, const TensorView& query, const TensorView& key,
                             const TensorView& value, const ForwardOptions& options = {},
                             ForwardContext* context = nullptr) const;
  ModuleGradients backward_with(const ParameterViews& parameters, const ForwardContext& context,
                                const TensorView& grad_output, const WantedGradients& wanted = {},
                                const std::optional<TensorView>& grad_weights = std::nullopt) const;

  ForwardResult operator()(const TensorView& query, const TensorView& key, const TensorView& value,
                           const ForwardOptions& options = {}) const {
    return forward(query, key, value, options);
  }

  // Converts every parameter to `dtype` (float32, float64, bfloat16 or float16) in place, as torch's
  // module.to(dtype) does; inputs must then be of that dtype.
  void to(DType dtype);
  DType dtype() const { return options_.dtype; }

  // Training mode (the default, as in PyTorch) applies dropout; eval mode does not.
  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool is_training() const { return training_; }

  // Parameters by their PyTorch names, in PyTorch's state_dict order: in_proj_weight or
  // q_proj_weight/k_proj_weight/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight,
  // out_proj.bias (each only where the options create it). None without own_parameters.
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  // The same names with their shapes, with or without own_parameters.
  const std::vector<std::pair<std::string, Shape>>& parameter_shapes() const { return shapes_; }
  Tensor parameter(const std::string& name) const;  // shares storage; mha::Error if unknown
  // Copies values in, checking names and shapes. strict: every parameter must be present and no
  // other name may appear (PyTorch's default). An error without own_parameters.
  void load_state_dict(const std::unordered_map<std::string, TensorView>& state, bool strict = true);
  // PyTorch's initialisation from `seed`: xavier-uniform projections, zero biases, kaiming-uniform
  // out_proj.weight, xavier-normal bias_k/bias_v. Nothing to do without own_parameters.
  void reset_parameters(uint64_t seed);

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  int64_t kdim() const { return kdim_; }
  int64_t vdim() const { return vdim_; }
  bool qkv_same_embed_dim() const { return kdim_ == embed_dim_ && vdim_ == embed_dim_; }
  const MultiheadAttentionOptions& options() const { return options_; }

 private:
  // A copy with every parameter converted to `dtype`; without `parameters`, a module with the
  // same options and none (it only runs forward_full/backward_full on given sets).
  MultiheadAttention(const MultiheadAttention& other, DType dtype, bool parameters = true);
  // The views a call reads: the module's own, or `given` checked against them.
  std::vector<std::pair<std::string, TensorView>> parameters_for_call(const ParameterViews* given,
                                                                      const char* caller) const;
  ForwardResult forward_any(const std::vector<std::pair<std::string, TensorView>>& parameters, const TensorView& query,
                            const TensorView& key, const TensorView& value, const ForwardOptions& options,
                            ForwardContext* context) const;
  ModuleGradients backward_any(const std::vector<std::pair<std::string, TensorView>>& parameters,
                               const ForwardContext& context, const TensorView& grad_output,
                               const WantedGradients& wanted, const std::optional<TensorView>& grad_weights) const;
  // The forward and backward of a float32 (T = float) or float64 (T = double) module, or of a
  // bfloat16 one in bfloat16 products (T = bfloat16), on parameters of T.
  template <typename T>
  ForwardResult forward_full(const detail::ParameterSet& parameters, const TensorView& query, const TensorView& key,
                             const TensorView& value, const ForwardOptions& options, ForwardContext* context) const;
  template <typename T>
  ModuleGradients backward_full(const detail::ParameterSet& parameters, const ForwardContext& context,
                                const TensorView& grad_output, const WantedGradients& wanted,
                                const std::optional<TensorView>& grad_weights) const;
  // bfloat16/float16 modules: the float32 forward and backward on widened copies, or for
  // bfloat16 the paths in bfloat16 products where the CPU has them (module_low_precision.cpp).
  ForwardResult forward_low_precision(const std::vector<std::pair<std::string, TensorView>>& parameters,
                                      const TensorView& query, const TensorView& key, const TensorView& value,
                                      const ForwardOptions& options, ForwardContext* context) const;
  ModuleGradients backward_low_precision(const std::vector<std::pair<std::string, TensorView>>& parameters,
                                         const ForwardContext& context, const TensorView& grad_output,
                                         const WantedGradients& wanted,
                                         const std::optional<TensorView>& grad_weights) const;
  // restore_context of a float32 or float64 module (activations of that dtype).
  ForwardContext restore_full(const TensorView& query, const TensorView& key, const TensorView& value,
                              const ForwardOptions& options, const ActivationViews& activations) const;
  // The dropout seed of the next call that brings none (the module's stream, advanced per call).
  uint64_t next_dropout_seed() const;

  int64_t embed_dim_, num_heads_, kdim_, vdim_;
  MultiheadAttentionOptions options_;
  bool training_ = true;
  std::vector<std::pair<std::string, Shape>> shapes_;  // every parameter's name and shape
  std::vector<std::pair<std::string, Tensor>> params_;  // empty without own_parameters
  mutable std::atomic<uint64_t> dropout_calls_{0};
};

}  // namespace mha
