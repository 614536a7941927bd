// A bfloat16 module's inference forward in bfloat16 products (module_bf16_forward.cpp).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mha/multihead_attention.hpp"

namespace mha::detail {

// Whether bf16_inference_forward takes a call of this module with these options and lengths
// (before any work): a bfloat16 module, no context or weights, no dropout or extra key rows,
// more than a few queries, oneDNN's bf16 matmul available, and AMX (head dims of at least 16) or
// the avx512_bf16 ISA (even head dims).
bool bf16_inference_forward_takes(const MultiheadAttention& m, const ForwardOptions& options, int64_t len_q,
                                  int64_t len_k, bool with_context);

// The forward with PyTorch's bfloat16 roundings (projections, attention output) in bfloat16
// products; nothing (std::nullopt) where bf16_inference_forward_takes says no.
std::optional<ForwardResult> bf16_inference_forward(const MultiheadAttention& m,
                                               const std::vector<std::pair<std::string, TensorView>>& parameters,
                                               const TensorView& query, const TensorView& key, const TensorView& value,
                                               const ForwardOptions& options, ForwardContext* context);

}  // namespace mha::detail
