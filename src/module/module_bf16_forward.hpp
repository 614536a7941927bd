// A bfloat16 module in bfloat16 products: its inference forward (module_bf16_forward.cpp), and
// when its training runs in them (module_low_precision.cpp).
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

// A bfloat16 bias [n] (any stride), from `first` on, as float32 (exact): what a bfloat16 Linear
// adds to its float32 sums.
std::vector<float> widened_bias(const TensorView& bias, int64_t first, int64_t n);

// Whether a training forward (one that keeps a context) of this module runs in bfloat16 products,
// rounded as PyTorch's bf16 module rounds, and so its backward: a bfloat16 module on a CPU with
// oneDNN's bf16 matmul. Otherwise the float32 module runs on widened copies. restore_context asks
// the same, to know what the activations were, so the rule reads nothing a backward may not know
// of its forward (whether the weights were returned, for one).
bool bf16_products_training(const MultiheadAttention& m);

}  // namespace mha::detail
