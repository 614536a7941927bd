// Attention over a batch of sequences of different lengths, packed one after another without
// padding (FlashAttention's "varlen" layout; the values of a PyTorch jagged nested tensor):
//
//   q [Tq, Hq, Dk]    k [Tk, Hkv, Dk]    v [Tk, Hkv, Dv]    out [Tq, Hq, Dv]
//
// Sequence s holds query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and key/value rows
// [cu_seqlens_k[s], cu_seqlens_k[s+1]); its queries attend to its own keys only. The result is
// that of scaled_dot_product_attention on each sequence alone, bit for bit (a test holds it to
// that), without the padded rows and keys a rectangular batch would compute and mask.
//
// Options are SdpaOptions: is_causal with either alignment (applied within each sequence, so with
// BottomRight a sequence's last query sees all its keys), a sliding window (window_left,
// window_right, within each sequence likewise), ALiBi (alibi_slopes [Hq] or [sequences, Hq], the
// distances within each sequence), attention sinks (sinks [Hq], shared by the sequences; the
// backward's AttentionGradients::sinks sums over them), softcap, scale, enable_gqa, k_descale and
// v_descale for float8 keys and values ([], [Hkv] or [sequences, Hkv]), dropout_p with
// dropout_seed (sequence s draws the mask a one-sequence call with seed
// varlen_dropout_seed(dropout_seed, s) draws), num_threads. attn_mask is not taken (causality and
// the sequence boundaries are the masks here). Inputs may have any strides; float32, bfloat16,
// float16 or float64, one dtype, or float8 keys and values under a float32, bfloat16 or float16
// query (inference), on the host.
//
// Work is spread over the threads by cost: sequences that each hold a large share of the work run
// one after another on all threads, the others one per thread, longest first.
#pragma once

#include <cstdint>
#include <span>

#include "mha/sdpa.hpp"
#include "mha/tensor.hpp"

namespace mha {

// The dropout seed sequence s of a variable-length call draws its mask with (a fixed mix of the
// two, so sequences draw independent masks and a call can be replayed one sequence at a time).
uint64_t varlen_dropout_seed(uint64_t seed, int64_t sequence);

// Returns out [Tq, Hq, Dv] (contiguous, the inputs' dtype).
Tensor scaled_dot_product_attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                                           std::span<const int64_t> cu_seqlens_q,
                                           std::span<const int64_t> cu_seqlens_k, const SdpaOptions& options = {});

// Training: output [Tq, Hq, Dv] and lse [Hq, Tq] (float32; float64 for float64 inputs), the
// log-sum-exp of each query row's scores (+inf for a row with no visible key).
AttentionForTraining scaled_dot_product_attention_varlen_for_training(const TensorView& q, const TensorView& k,
                                                                      const TensorView& v,
                                                                      std::span<const int64_t> cu_seqlens_q,
                                                                      std::span<const int64_t> cu_seqlens_k,
                                                                      const SdpaOptions& options = {});

// The gradients of q, k and v (packed like them, their dtype; undefined where not wanted) from
// the forward's saved output and lse; pass the same inputs, offsets and options as the forward.
// wanted.attn_mask must be false. Deterministic: the same bits on every run and thread count.
AttentionGradients scaled_dot_product_attention_varlen_backward(
    const TensorView& q, const TensorView& k, const TensorView& v, std::span<const int64_t> cu_seqlens_q,
    std::span<const int64_t> cu_seqlens_k, const AttentionForTraining& saved, const TensorView& grad_output,
    const SdpaOptions& options = {}, const SdpaGradientsWanted& wanted = {});

}  // namespace mha
