// float64 attention, forward and backward. PyTorch computes float64 SDPA in float64, and gradient
// checks (torch.autograd.gradcheck) rely on it; the fused float32 kernels cannot serve them. A
// block of queries at a time: its scores against the visible keys (kept, O(block x Lk) per
// thread) and the two products by float64 GEMM (BLAS), the softmax and masks in between. The
// rules are the float32 kernels': masks, causality in both alignments, the dropout mask of
// core/dropout.hpp, zeros (and lse = +inf) for a row that sees no key.
#pragma once

#include <cstdint>

#include "core/attention_problem.hpp"

namespace mha::detail {

// out [B, Hq, Lq, Dv]; weights, when not null, [B, Hq, Lq, Lk]; lse, when not null, [B, Hq, Lq]
// contiguous: the natural log-sum-exp of each row of scores. All float64.
struct Float64Outputs {
  double* out = nullptr;
  int64_t out_strides[4] = {};
  double* weights = nullptr;
  int64_t weights_strides[4] = {};
  double* lse = nullptr;
};
void attention_forward_f64(const AttentionProblem& p, const Float64Outputs& o);

// What the backward reads (the forward's output and the output's gradient; each row's softmax is
// formed again from its scores, as the forward formed it) and writes: dq, dk, dv (null for one
// not wanted) and, when not null, the gradient of the scores dscores [B, Hq, Lq, Lk]. All float64.
// grad_weights, when not null, is a gradient of the weights the forward returned (after dropout),
// [B, Hq, Lq, Lk] by its strides, times grad_weights_scale: the module's weights averaged over the
// heads take a head stride of 0 and a scale of 1 / Hq.
struct Float64Backward {
  const double* out = nullptr;
  int64_t out_strides[4] = {};
  const double* grad_out = nullptr;
  int64_t grad_out_strides[4] = {};
  const double* grad_weights = nullptr;
  int64_t grad_weights_strides[4] = {};
  double grad_weights_scale = 1.0;
  double* dq = nullptr;
  int64_t dq_strides[4] = {};
  double* dk = nullptr;
  int64_t dk_strides[4] = {};
  double* dv = nullptr;
  int64_t dv_strides[4] = {};
  double* dscores = nullptr;
  int64_t dscores_strides[4] = {};
};
void attention_backward_f64(const AttentionProblem& p, const Float64Backward& b);

}  // namespace mha::detail
