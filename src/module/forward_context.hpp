// The state a training forward of MultiheadAttention keeps for its backward.
#pragma once

#include <vector>

#include "core/attention_problem.hpp"
#include "mha/multihead_attention.hpp"
#include "module/linear.hpp"
#include "module/module_call.hpp"

namespace mha {

struct ForwardContext::State {
  // Owned copies of the caller's inputs and masks; `call` views them.
  std::vector<Tensor> inputs;
  detail::ModuleCall call;
  detail::MaskTerms masks;
  // Projections [N, L, E], [N, St, E], [N, St, E] (views of the row buffers), the attention
  // output before out_proj (laid out like the module's output), and the row log-sum-exp.
  detail::RowBuffer q_buf, k_buf, v_buf;
  TensorView q, k, v;
  Tensor attn;
  Tensor lse;
  detail::AttentionProblem problem;  // views into the above
  bool packed_self_attention = false;
  Shape query_shape, key_shape, value_shape, output_shape;
  DType module_dtype = DType::f32;  // the dtype of the module that ran the forward
};

}  // namespace mha
