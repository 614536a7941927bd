// Entry points of the fused CPU attention kernels, one per ISA, and the plain struct they share.
#pragma once

#include <cstdint>

#include "core/attention_problem.hpp"

namespace mha::detail {

// Where a forward writes. out is [B, Hq, Lq, Dv]; weights, when not null, [B, Hq, Lq, Lk];
// lse, when not null, the natural log-sum-exp of each row of scores [B, Hq, Lq] (contiguous), +inf
// for a row with no visible key, so that exp(score - lse) is its softmax in every case.
struct ForwardOutputs {
  float* out = nullptr;
  int64_t out_strides[4] = {};
  float* weights = nullptr;
  int64_t weights_strides[4] = {};
  float* lse = nullptr;
};

// Preconditions (checked by run_attention): float32 q, k, v with unit stride in the last
// dimension; Lq, Lk < 2^31; 0 <= dropout_p < 1; Lk > 0.
void flash_forward_portable(const AttentionProblem& p, const ForwardOutputs& o);
void flash_forward_avx512(const AttentionProblem& p, const ForwardOutputs& o);

// Validates kernel preconditions, copies inputs whose last stride is not 1, handles the cases
// with nothing to compute (Lk == 0, dropout_p == 1, empty tensors) and runs the ISA's kernel.
void run_attention(const AttentionProblem& p, const ForwardOutputs& o);

}  // namespace mha::detail
