// The arguments of MultiheadAttention::forward, validated and put in one form: batch-major
// [N, L, C] views whatever batch_first and batching were, and masks as terms over (b, h, i, j).
// Shared by the module's fused forward and the float64 reference, so both read the same call.
#pragma once

#include <algorithm>
#include <optional>

#include "core/attention_problem.hpp"
#include "mha/multihead_attention.hpp"

namespace mha::detail {

struct ModuleCall {
  bool batched = true;
  int64_t batch = 0, len_q = 0, len_k = 0;  // N, L, S (S before bias_k / zero_attn columns)
  int64_t extra_keys = 0;                   // columns appended by add_bias_kv and add_zero_attn
  TensorView query, key, value;             // [N, L, E], [N, S, kdim], [N, S, vdim]
  // attn_mask and key_padding_mask as views whose last dimension has S columns, with the
  // broadcast strides they take over (b, h, i, j); see padded_masks() for the extra columns.
  std::optional<TensorView> attn_mask, key_padding_mask;
  std::array<int64_t, 4> attn_mask_strides{}, key_padding_strides{};
  bool causal = false;

  int64_t total_keys() const { return len_k + extra_keys; }
};

// Whether two views are the same tensor (self-attention passes one tensor three times).
inline bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.sizes() == b.sizes() &&
         std::equal(a.strides.begin(), a.strides.begin() + a.ndim, b.strides.begin());
}

// Inputs must be of the module's dtype unless `any_float` (the float64 reference takes any floating dtype).
ModuleCall validate_module_call(const MultiheadAttention& m, const TensorView& query, const TensorView& key,
                                const TensorView& value, const ForwardOptions& options, bool any_float = false);

// The masks as terms over the total_keys() columns. Where extra key columns exist, the masks are
// copied with those columns set to "attend" (as PyTorch pads them) into `storage`, which must
// outlive the returned terms. Causality is the kernel's (`causal`) when there are no extra
// columns; with them it becomes a mask too, since PyTorch's causal attn_mask is padded like any
// other and leaves the bias_k and zero-attention columns visible to every query.
struct MaskTerms {
  std::array<MaskTerm, 3> terms{};
  int count = 0;
  bool causal = false;
  std::vector<Tensor> storage;
};
MaskTerms module_mask_terms(const ModuleCall& call, int64_t num_heads);

// The attention of a module call: the projections q [N, L, E], k and v [N, St, E] viewed as
// heads [N, H, *, E/H], the masks' terms, scale 1/sqrt(E/H); no dropout (the caller's to set).
AttentionProblem module_attention_problem(const ModuleCall& call, const MaskTerms& masks, int64_t num_heads,
                                          const TensorView& q, const TensorView& k, const TensorView& v, int threads);

// A bfloat16/float16 module's call on float32 copies: the inputs widened (self-attention's one
// tensor once, so the float32 module still sees self-attention) and float masks of the module's
// dtype widened; `options` views the copies.
struct WidenedCall {
  Tensor query, key, value, attn_mask, key_padding_mask;
  ForwardOptions options;
};
WidenedCall widened_call(const TensorView& query, const TensorView& key, const TensorView& value,
                         const ForwardOptions& options, DType module_dtype, int threads);

// The shape of the module's output for this call: like query, with embed_dim features.
Shape module_output_shape(const ModuleCall& call, const MultiheadAttention& m, bool batch_first);
// The shape of the returned weights: [N, L, S'] averaged or [N, H, L, S'], without N if unbatched.
Shape module_weights_shape(const ModuleCall& call, int64_t num_heads, bool average);

}  // namespace mha::detail
