// The float64 reference: the seed formula step by step, with every score matrix materialised.
// Slow by design and always built; the tests judge every fast path against it.
#pragma once

#include "mha/multihead_attention.hpp"
#include "mha/sdpa.hpp"

namespace mha::reference {

struct Result {
  Tensor output;   // float64
  Tensor weights;  // float64, [.., Hq, Lq, Lk]
};

// Same arguments and semantics as mha::scaled_dot_product_attention (inputs of any float dtype),
// including the dropout mask, which is a pure function of (seed, batch, head, query, key).
Result scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options = {});

struct Gradients {
  Tensor query, key, value;  // float64, shaped like q, k, v
  Tensor attn_mask;          // float64, shaped like the mask (when one is given)
  Tensor sinks;              // float64 [Hq] (when sinks are given)
};
// The gradients of sum(output * grad_output), from the materialised probabilities, in float64.
Gradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const TensorView& grad_output, const SdpaOptions& options = {});

// The module's forward in float64, following the steps of PyTorch's multi_head_attention_forward,
// with the module's options and its parameters, or those of `parameters` where given (by name, of
// any floating dtype: float64 parameters make the whole computation float64, for finite
// differences). Inputs may be of any floating dtype. `training` decides dropout;
// options.dropout_seed must be set when dropout applies. Weights are returned as the module
// returns them. `output_magnitude`, where given, receives the size of the terms each output sums:
// the steps after the attention weights on absolute values (|weights| |x_v W_v^T + b_v| |W_o|^T
// + |b_o|, with |x_v W_v^T| taken term by term), the scale that float32 rounding errors follow
// where an output cancels to far less than its terms.
ForwardResult multihead_attention(const MultiheadAttention& module, const TensorView& query,
                                  const TensorView& key, const TensorView& value,
                                  const ForwardOptions& options, bool training,
                                  const std::unordered_map<std::string, TensorView>& parameters = {},
                                  Tensor* output_magnitude = nullptr);

}  // namespace mha::reference
