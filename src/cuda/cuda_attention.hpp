// The CUDA attention forward, called by the SDPA front end for problems whose operands are in
// CUDA memory. A host header: no CUDA types, so the front end compiles without the toolkit.
#pragma once

#include "core/attention_problem.hpp"

namespace mha::detail {

// Checks what the GPU kernel supports (mha::Error naming the argument otherwise) and runs it:
// out4 [B, Hq, Lq, Dv] in q's dtype on the same device; lse [B, Hq, Lq] float32 contiguous
// on the device, or null.
void cuda_attention_forward(const AttentionProblem& p, const TensorView& out4, float* lse);

}  // namespace mha::detail
