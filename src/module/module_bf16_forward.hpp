// A bfloat16 module's inference forward on the tile unit (module_bf16_forward.cpp).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mha/multihead_attention.hpp"

namespace mha::detail {

// Whether bf16_tile_forward takes a call of this module with these options and lengths (before
// any work): a bfloat16 module, no context or weights, no dropout or extra key rows, head dims
// of at least 16, more than a few queries, AMX and oneDNN's bf16 matmul available.
bool bf16_tile_forward_takes(const MultiheadAttention& m, const ForwardOptions& options, int64_t len_q, int64_t len_k,
                             bool with_context);

// The forward with PyTorch's bfloat16 roundings (projections, attention output) on the tile
// unit; nothing (std::nullopt) where bf16_tile_forward_takes says no.
std::optional<ForwardResult> bf16_tile_forward(const MultiheadAttention& m,
                                               const std::vector<std::pair<std::string, TensorView>>& parameters,
                                               const TensorView& query, const TensorView& key, const TensorView& value,
                                               const ForwardOptions& options, ForwardContext* context);

}  // namespace mha::detail
