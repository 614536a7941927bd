// The AMX (tile unit) kernels: bfloat16 attention forward and backward. Entered only when
// amx_usable().
#pragma once

#include <atomic>
#include <cstdint>

#include "core/attention_problem.hpp"
#include "cpu/attention_kernel.hpp"

namespace mha::detail {

// Where the bf16 forward writes: out [B, Hq, Lq, Dv], any strides, as bfloat16 bits or (out_f32)
// float32; lse, when not null, each row's natural log-sum-exp [B, Hq, Lq] (contiguous; +inf where
// no key is seen).
struct AmxOutputs {
  void* out = nullptr;
  bool out_f32 = false;
  int64_t out_strides[4] = {};
  float* lse = nullptr;
};

// The CPU has AMX-BF16 and the kernel granted this process the tile state (requested once, with
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), on first use).
bool amx_usable();

// Which problems the AMX kernel takes: bfloat16 q, k, v with unit-stride rows and head dimensions
// of at least 16 (padded to the tile's depth of 32), more than a few queries, no soft-capping.
// Others take the float32 path.
bool amx_bf16_supports(const AttentionProblem& p);
// Its rule on lengths and head dims alone (for a caller deciding before it builds the problem).
bool amx_bf16_takes_shape(int64_t len_q, int64_t len_k, int64_t dim_qk, int64_t dim_v);

void amx_bf16_forward(const AttentionProblem& p, const AmxOutputs& o);

// Which backwards the AMX kernel takes (flash_backward_amx.cpp): amx_bf16_supports' problems with
// a bfloat16 output gradient, bfloat16 or float32 gradients, no gradient of the scores (an
// additive mask's) and keys and values that are not paged.
bool amx_bf16_backward_supports(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);

// in.lse2, in.p_scale and in.delta filled (run_attention_backward); q, k, v and the output's
// gradient with unit-stride rows.
void amx_bf16_backward(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);

// A head's packed queries and dQ^T past this many bytes (1.5 MiB) make the backward take its key
// blocks in spans of 256 (flash_backward_amx.cpp); the bits are the same either way. Settable
// for tests.
std::atomic<int64_t>& amx_backward_span_bytes();


}  // namespace mha::detail
