// The host forward and backward of a built attention problem, written into views: what the
// public SDPA functions (core/sdpa.cpp) and the variable-length ones (core/varlen.cpp) share.
#pragma once

#include <optional>

#include "core/attention_problem.hpp"

namespace mha::detail {

// The forward of a materialised host problem into `out` (output_shape(p, Lq, Dv), the inputs'
// dtype), the weights when not null (output_shape(p, Lq, Lk), the inputs' dtype), and the
// log-sum-exp when not null (contiguous [B, Hq, Lq]; float32, float64 for float64 inputs).
// Picks the kernel: float64's own, AMX for bfloat16 where it applies (no weights, no lse), else
// the float32 kernel, which widens bfloat16 / float16 as it reads them and rounds once.
void sdpa_forward_host(const AttentionProblem& p, const TensorView& out, const TensorView* weights, void* lse);

// What a host backward reads and writes: 4-D [B, H, rows, cols] views, as folded() gives them.
struct BackwardViews {
  TensorView out, grad_out;  // the forward's output and its gradient, the inputs' dtype
  const void* lse = nullptr;  // the forward's contiguous [B, Hq, Lq] float32 (not read for float64)
  // The gradients to write (one dtype: the inputs', or float32 for bfloat16 / float16 summed
  // later); nullopt skips that gradient's products.
  std::optional<TensorView> dq, dk, dv;
  std::optional<TensorView> dscores;  // the scores' gradient, float32 (float64), when wanted
};
void sdpa_backward_host(const AttentionProblem& p, const BackwardViews& views);

// The gradient of attention sinks ([Hq], their dtype) from the forward's output and
// log-sum-exp (which includes the sink) and the output's gradient: [B, Hq, L, Dv] views and the
// [B, Hq, L] lse (float32 or float64, any strides). Deterministic.
Tensor sink_gradient(const TensorView& sinks, const TensorView& out4, const TensorView& grad_out4,
                     const TensorView& lse3, int threads);

// The log-sum-exp of rows that see no key ([Hq, L], any strides): the head's sink where there
// are sinks (the softmax is the sink's alone), else +inf.
void fill_lse_without_keys(const SdpaOptions& options, const TensorView& lse_rows);

}  // namespace mha::detail
