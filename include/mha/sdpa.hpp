// Scaled dot-product attention with the semantics of torch.nn.functional.scaled_dot_product_attention:
//
//   out = softmax(q k^T * scale + mask) v,   scale = 1/sqrt(d_k) unless given
//
// Shapes (rank 2 to 6; dimension -3 is heads, the dimensions before it batch):
//   q   [B, Hq,  Lq, Dk]     k [B, Hkv, Lk, Dk]     v [B, Hkv, Lk, Dv]     out [B, Hq, Lq, Dv]
// Any strides are accepted, so [B, L, H, D] storage is passed as a transposed view.
// Batch dimensions broadcast as in PyTorch (right-aligned; a size 1 or a missing dimension
// stretches): q [B, H, L, D] with k, v [H, S, D] shares the keys across the batch, k, v with one
// head serve every query head (read once per group, as with enable_gqa); the output has the
// broadcast batch dimensions, and a broadcast input's gradient is summed over them. Leading
// dimensions are read in place where their strides fold into one (contiguous tensors, or ones
// expanded along whole leading dimensions), else through a copy. With enable_gqa, the key and
// value head counts each divide the query's, and query head h reads key/value head h / (Hq / Hkv)
// (PyTorch's repeat_interleave). Where the two counts differ, as PyTorch allows, both are read
// with lcm(Hk, Hv) heads: a side with fewer (and more than one) through a host copy with each
// head repeated, its gradient summed back over the repeats.
#pragma once

#include <cstdint>
#include <optional>

#include "mha/tensor.hpp"

namespace mha {

// Which diagonal a causal mask follows when Lq != Lk.
enum class CausalAlignment {
  TopLeft,     // query i sees keys j <= i (PyTorch's is_causal, torch.ones(Lq, Lk).tril())
  BottomRight  // query i sees keys j <= i + (Lk - Lq): the last query sees every key (decoding)
};

struct SdpaOptions {
  // bool: true means the key takes part ("attend"), as in PyTorch's SDPA; float32, bfloat16 or
  // float16 (a float mask of the inputs' dtype, as PyTorch takes it): added to the scaled scores
  // (-inf excludes), read as float32. Broadcastable to the weights' shape [.., Hq, Lq, Lk] like a
  // PyTorch tensor (extra leading dimensions of size 1 allowed).
  std::optional<TensorView> attn_mask;
  bool is_causal = false;  // may be combined with attn_mask: a key must pass both
  CausalAlignment causal_alignment = CausalAlignment::TopLeft;
  // Sliding-window (local) attention, FlashAttention's window_size: query i sees keys from
  // window_left before to window_right after its diagonal (key i, or key i + Lk - Lq with
  // CausalAlignment::BottomRight), both ends included; -1 leaves that side unbounded. With
  // is_causal or attn_mask, a key must pass them all (Mistral's window of W keys: is_causal,
  // window_left = W - 1). window_right bounds keys as is_causal does, a diagonal moved right;
  // window_left excludes the keys before its own diagonal, on the host only.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // ALiBi (attention with linear biases), FlashAttention's alibi_slopes: -slope * |i + diagonal - j|
  // is added to the scaled score of query i and key j, the diagonal the one causal_alignment
  // names (FlashAttention's is BottomRight's). float32 (or float64 with float64 inputs) of shape
  // [Hq] or broadcastable to the batch dimensions and heads [.., Hq] (per batch entry and head,
  // FlashAttention's [B, Hq]); finite. Combines with the other options (a second additive term
  // next to attn_mask). The kernels read the biases of one head from a buffer of Lq + Lk - 1
  // floats, never an Lq x Lk matrix; on the host only.
  std::optional<TensorView> alibi_slopes;
  // Attention sinks (gpt-oss's learned per-head sink logits; `sinks` in FlashAttention 3 and
  // FlashInfer): each query row's softmax takes one more term, exp(sinks[h]), in its denominator,
  // as if a key with score sinks[h] (already scaled) and a zero value were appended to every row,
  // so a row's weights sum to less than 1 and a row that sees no key gives zeros. float32 (or
  // float64 with float64 inputs) of shape [Hq], finite; the log-sum-exp of the training forward
  // includes the sink (a row without keys: sinks[h]), and the backward returns its gradient
  // (AttentionGradients::sinks). On the host only.
  std::optional<TensorView> sinks;
  // Logit soft-capping (Gemma 2, Grok; FlashAttention's softcap): with softcap > 0 each scaled
  // score s = q.k * scale becomes softcap * tanh(s / softcap) before the masks, ALiBi and the
  // softmax, bounding it to (-softcap, softcap); 0 leaves the scores as they are. 0 or in
  // [1e-30, 1e30]. Forward and backward (the gradient through the tanh); on the host only.
  double softcap = 0.0;
  // Dequantisation scales of float8 keys and values (FlashAttention 3's k_descale and v_descale,
  // vLLM's k_scale and v_scale): the call attends over k * k_descale and v * v_descale, one
  // scale per key/value head, per batch entry too where given. float32 of shape [] (one for the
  // tensor), [Hkv] or broadcastable to the batch dimensions and key/value heads [.., Hkv]
  // (FlashAttention 3's [B, Hkv]); finite and > 0; taken with float8 keys and values only. The
  // kernels fold k_descale into the head's softmax scale and v_descale into its output's
  // normalisation: no key or value is multiplied. write_paged_cache divides by the same tensors.
  std::optional<TensorView> k_descale;
  std::optional<TensorView> v_descale;
  std::optional<double> scale;  // default 1/sqrt(Dk)
  bool enable_gqa = false;      // allow Hq to be a multiple of Hkv (grouped-query attention)
  double dropout_p = 0.0;       // dropout on the attention weights, in [0, 1]
  uint64_t dropout_seed = 0;    // the same seed gives the same dropout mask, on any thread count
  int num_threads = 0;          // 0: the library's setting (mha::set_num_threads)
};

// Fully masked query rows (every key excluded by masks or causality) produce zeros in the output
// and in the weights. PyTorch's SDPA (2.5 and later) returns the same zeros; nn.MultiheadAttention
// and softmax over a row of -inf return NaN there instead.

// q, k, v are float32, bfloat16, float16 or float64 (one dtype); the output has their dtype.
// bfloat16 and float16 are computed in float32 (fp32 accumulation and softmax statistics) and
// rounded once; on a CPU with AMX, bfloat16 forwards (head dims of at least 16, more than 4
// queries, no weights returned) multiply on the tile unit, the probabilities rounded to bfloat16
// for P V (as FlashAttention does) and their exponentials within 7.5e-5, and so do bfloat16
// backwards of the same shapes (not when the mask's gradient is asked for), P and dS rounded to
// bfloat16 for their products: gradients within bfloat16 rounding of the float32 path's. float64 (host only) is computed in float64 throughout, as PyTorch does (for
// gradient checks), by its own blocked kernel on float64 BLAS; its mask may be float64 and its
// log-sum-exp is float64. The training functions below do the same: outputs and gradients in
// the inputs' dtype.
// Returns out [.., Hq, Lq, Dv] (contiguous; `..` the broadcast batch dimensions).
Tensor scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options = {});

struct AttentionWithWeights {
  Tensor output;   // [.., Hq, Lq, Dv]
  Tensor weights;  // [.., Hq, Lq, Lk]: softmax probabilities after dropout (as PyTorch returns them)
};
// Also returns the attention weights; this materialises the Lq x Lk matrix per head.
AttentionWithWeights scaled_dot_product_attention_with_weights(const TensorView& q, const TensorView& k,
                                                               const TensorView& v,
                                                               const SdpaOptions& options = {});

// Writes into caller-provided views (any strides). `weights`, when given, is [.., Hq, Lq, Lk].
void scaled_dot_product_attention_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const SdpaOptions& options = {},
                                       const std::optional<TensorView>& weights = std::nullopt);

// Training. The forward keeps the per-row log-sum-exp of the scores (O(L), not the Lq x Lk
// matrix); the backward recomputes the probabilities from it tile by tile. Pass the same inputs
// and options to both: dropout masks are regenerated from dropout_seed, never stored.
struct AttentionForTraining {
  Tensor output;  // [.., Hq, Lq, Dv], in the inputs' dtype
  Tensor lse;     // [.., Hq, Lq], float32: log-sum-exp of each row of scores (+inf for a fully masked row)
};
AttentionForTraining scaled_dot_product_attention_for_training(const TensorView& q, const TensorView& k,
                                                               const TensorView& v, const SdpaOptions& options = {});

struct AttentionGradients {
  Tensor query, key, value;       // shaped like q, k, v, in their dtype (undefined when not wanted)
  std::optional<Tensor> attn_mask;  // shaped like the mask, in its dtype, when asked for (float masks only)
  Tensor sinks;  // [Hq], the sinks' dtype, summed over the batch, when options.sinks is given
};
// Which gradients a backward computes. Each of dQ = dS K, dK = dS^T Q and dV = P^T dO is a fifth
// of the backward's products, and the two-pass schedule (few heads) runs a whole pass for dK and
// dV and another for dQ: keys and values that need no gradient (a frozen encoder's, a cached
// prefix) skip theirs, as autograd's needs_input_grad says. The mask's gradient only on request.
struct SdpaGradientsWanted {
  bool query = true, key = true, value = true;
  bool attn_mask = false;  // a float (additive) attn_mask's
};
// Deterministic: the same inputs give bit-identical gradients on every run and thread count.
// With GQA, key and value gradients are summed over the query heads of each group; with a mask
// broadcast over some dimensions, its gradient is summed over them.
AttentionGradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const AttentionForTraining& saved,
                                                         const TensorView& grad_output,
                                                         const SdpaOptions& options = {},
                                                         const SdpaGradientsWanted& wanted = {});
// The same with every input's gradient, and the mask's when attn_mask_grad.
AttentionGradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const AttentionForTraining& saved,
                                                         const TensorView& grad_output, const SdpaOptions& options,
                                                         bool attn_mask_grad);

// Floating-point operations of one forward call: 2 * (Dk + Dv) per (query, key) pair that takes
// part, times B * Hq. Without causality that is 4 * B * Hq * Lq * Lk * D for Dk = Dv = D; a causal
// mask counts only the pairs it keeps (about half).
double attention_flops(int64_t batch, int64_t heads, int64_t len_q, int64_t len_k, int64_t dim_qk,
                       int64_t dim_v, bool causal, CausalAlignment alignment = CausalAlignment::TopLeft);

}  // namespace mha
