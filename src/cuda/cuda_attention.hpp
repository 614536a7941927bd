// The CUDA attention forward and backward, called by the SDPA front end for problems whose
// operands are in CUDA memory. A host header: no CUDA types, so the front end compiles without the toolkit.
#pragma once

#include <optional>

#include "core/attention_problem.hpp"

namespace mha::detail {

// Checks what the GPU kernel supports (mha::Error naming the argument otherwise) and runs it:
// out4 [B, Hq, Lq, Dv] in q's dtype on the same device; lse [B, Hq, Lq] float32 contiguous
// on the device, or null.
void cuda_attention_forward(const AttentionProblem& p, const TensorView& out4, float* lse);

// The backward's operands on the device, [B, H, L, D] views (batch dimensions folded): the
// forward's output and its gradient, its log-sum-exp ([B, Hq, Lq] float32 contiguous), a
// [B, Hq, Lq] float32 scratch buffer for the row sums dO . O, and the gradients to write in the
// inputs' dtype (nullopt: not computed).
struct CudaBackwardViews {
  TensorView out4, grad_out4;
  const float* lse = nullptr;
  float* delta = nullptr;
  std::optional<TensorView> dq, dk, dv;
};
// Deterministic (no atomics): the same inputs give bit-identical gradients on every run.
void cuda_attention_backward(const AttentionProblem& p, const CudaBackwardViews& views);

}  // namespace mha::detail
