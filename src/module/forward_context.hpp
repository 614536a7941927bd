// The state a training forward of MultiheadAttention keeps for its backward.
#pragma once

#include <optional>
#include <vector>

#include "core/attention_problem.hpp"
#include "mha/multihead_attention.hpp"
#include "module/module_call.hpp"

namespace mha {

struct ForwardContext::State {
  // Owned copies of the caller's inputs and masks, which `call` views (a context restored from
  // views reads the caller's own, and holds copies only of widened ones).
  std::vector<Tensor> inputs;
  detail::ModuleCall call;
  detail::MaskTerms masks;
  // Projections [N, L, E], [N, St, E], [N, St, E], the attention output before out_proj (laid out
  // like the module's output), and the row log-sum-exp [N, H, L]; `storage` holds what they view
  // where the context owns it (the forward's row buffers and outputs).
  TensorView q, k, v, attn, lse;
  std::vector<Tensor> storage;
  detail::AttentionProblem problem;  // views into the above
  Shape query_shape, key_shape, value_shape, output_shape;
  DType module_dtype = DType::f32;  // the dtype of the module that ran the forward
  // The weights the forward returned (need_weights): their shape, and whether averaged over the
  // heads; what a gradient of them must match.
  std::optional<Shape> weights_shape;
  bool weights_averaged = false;
};

}  // namespace mha
