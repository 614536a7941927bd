// Entry points of the fused CPU attention kernels, one per ISA, and the plain struct they share.
#pragma once

#include <atomic>
#include <cstdint>

#include "core/attention_problem.hpp"

namespace mha::detail {

// Where a forward writes. out is [B, Hq, Lq, Dv] of out_dtype (bfloat16 and float16 are rounded
// once, as each row is stored); weights, when not null, [B, Hq, Lq, Lk] float32; average_weights,
// when not null (and weights null), their mean over the query heads, [B, Lq, Lk] float32,
// contiguous; lse, when not null, the natural log-sum-exp of each row of scores [B, Hq, Lq]
// (contiguous), +inf for a row with no visible key, so that exp(score - lse) is its softmax in
// every case.
struct ForwardOutputs {
  void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t out_strides[4] = {};
  float* weights = nullptr;
  int64_t weights_strides[4] = {};
  float* average_weights = nullptr;
  float* lse = nullptr;
};

// What a backward reads besides the problem's q, k, v: the forward's output (of out_dtype; only
// run_attention_backward reads it, for delta) and row log-sum-exp, and the gradient of the
// output (of grad_out_dtype, the dtype of q, k and v). Views are [B, Hq, Lq, Dv]; lse is [B, Hq, Lq].
struct BackwardInputs {
  const void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t out_strides[4] = {};
  const void* grad_out = nullptr;
  DType grad_out_dtype = DType::f32;
  int64_t grad_out_strides[4] = {};
  const float* lse = nullptr;
  const float* delta = nullptr;  // [B, Hq, Lq]: rowsum(grad_out * out), filled by run_attention_backward
  // [B, Hq, Lq]: P = 2^(s - lse2) * p_scale for base-2 scores s (backward_rows.hpp), filled by
  // run_attention_backward; the kernels read these, not lse.
  const float* lse2 = nullptr;
  const float* p_scale = nullptr;
};

// Where a backward writes: dq [B, Hq, Lq, Dk], dk [B, Hkv, Lk, Dk], dv [B, Hkv, Lk, Dv] of
// grad_dtype (bfloat16 and float16 rounded once, as each row is stored), and when not null the
// float32 gradient of the scores, dscores [B, Hq, Lq, Lk] (what an additive mask receives). A null
// dq, dk or dv is a gradient nobody wants: its product (dQ = dS K, dK = dS^T Q, dV = Pd^T dO) is
// not computed.
struct BackwardOutputs {
  DType grad_dtype = DType::f32;
  void* dq = nullptr;
  int64_t dq_strides[4] = {};
  void* dk = nullptr;
  int64_t dk_strides[4] = {};
  void* dv = nullptr;
  int64_t dv_strides[4] = {};
  float* dscores = nullptr;
  int64_t dscores_strides[4] = {};
};

// Calls store(dst, round) with dst = base + offset elements of an output of `dtype` (float32,
// bfloat16 or float16) and round the float32 -> element conversion (to nearest even, as copy_into).
template <class Store>
void with_output_elements(void* base, DType dtype, int64_t offset, Store store) {
  switch (dtype) {
    case DType::bf16: store(static_cast<uint16_t*>(base) + offset, [](float x) { return bfloat16(x).bits; }); break;
    case DType::f16: store(static_cast<uint16_t*>(base) + offset, [](float x) { return float16(x).bits; }); break;
    default: store(static_cast<float*>(base) + offset, [](float x) { return x; });
  }
}

// The address of element `offset` of an input of `dtype`.
inline const void* element_address(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * dtype_size(dtype);
}

// Calls read(src, widen) with src = base + offset elements of an input of `dtype` (float32,
// bfloat16, float16 or, for keys and values, float8 e4m3 / e5m2) and widen its element -> float32
// conversion (exact).
template <class Read>
void with_input_elements(const void* base, DType dtype, int64_t offset, Read read) {
  switch (dtype) {
    case DType::f8e4m3:
      read(static_cast<const uint8_t*>(base) + offset, [](uint8_t x) { return static_cast<float>(float8_e4m3::from_bits(x)); });
      break;
    case DType::f8e5m2:
      read(static_cast<const uint8_t*>(base) + offset, [](uint8_t x) { return static_cast<float>(float8_e5m2::from_bits(x)); });
      break;
    case DType::bf16:
      read(static_cast<const uint16_t*>(base) + offset, [](uint16_t x) { return static_cast<float>(bfloat16::from_bits(x)); });
      break;
    case DType::f16:
      read(static_cast<const uint16_t*>(base) + offset, [](uint16_t x) { return static_cast<float>(float16::from_bits(x)); });
      break;
    default: read(static_cast<const float*>(base) + offset, [](float x) { return x; });
  }
}

// Up to this many queries per head, the forward runs the decoding kernel (few_queries.hpp), queries
// as rows and lanes over the keys, rather than tiles with lanes over the queries: on AVX-512 (AMD
// Zen 4) it took 0.3-0.85x the tile kernel's time at 5 to 32 queries (the tile kernel's cost is flat
// up to 48), and 1.1-1.2x at 48. Where the AMX kernel applies, it keeps the shapes above
// kFewQueriesPerHeadAmx.
constexpr int64_t kFewQueriesPerHead = 32;
constexpr int64_t kFewQueriesPerHeadAmx = 4;

// Preconditions (checked by run_attention): q, k, v of one dtype (float32, bfloat16 or float16),
// or k and v of one float8 format (an inference call), with unit stride in the last dimension; Lq, Lk < 2^31; 0 <= dropout_p < 1; Lk > 0.
void flash_forward_portable(const AttentionProblem& p, const ForwardOutputs& o);
void flash_forward_avx2(const AttentionProblem& p, const ForwardOutputs& o);
void flash_forward_avx512(const AttentionProblem& p, const ForwardOutputs& o);
// bfloat16 products (AVX512-BF16), for the problems bf16_pairs_supports takes: q, k and v all
// bfloat16 and an even head dim of q and k (a pair of dims per 32-bit word); others take
// flash_forward_avx512. Its outputs are within bfloat16 rounding of the float32 kernel's (P is
// rounded to bfloat16 for its products), not their bits.
bool bf16_pairs_supports(const AttentionProblem& p);
// Where the avx512_bf16 ISA runs it (attention.cpp): such problems with more queries per head than
// the decoding kernel takes, and (bf16_pairs_take_few_queries) those the decoding kernel takes,
// without weights returned: its dot mode's scores up to 32 query rows per key/value head, its
// panel schedule past them (few_queries.hpp's pair_scores, takes_pairs).
bool bf16_pairs_take_shape(int64_t len_q, int64_t dim_qk);
bool bf16_pairs_take_few_queries(const AttentionProblem& p, const ForwardOutputs& o);
// The 2^x of the bfloat16 kernels (AMX and pairs; simd_avx512_bf16.hpp's exp2_bf16) on n floats,
// for its tests. Needs the avx512_bf16 level.
void exp2_bf16_of(const float* x, float* y, int64_t n);
void flash_forward_avx512bf16(const AttentionProblem& p, const ForwardOutputs& o);

using ForwardKernel = void (*)(const AttentionProblem&, const ForwardOutputs&);
// The kernel above that run_attention runs for a prepared problem (unit last strides) on the
// active ISA; reads_pages_in_place asks it too, so the two cannot drift apart.
ForwardKernel forward_kernel(const AttentionProblem& p, const ForwardOutputs& o);

// The backward, deterministic: every gradient element is summed by one task in a fixed order, so
// the same inputs give the same bits on any thread count.
void flash_backward_portable(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);
void flash_backward_avx2(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);
void flash_backward_avx512(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);
// The decoding backward (few_queries_backward.hpp) takes up to this many query rows per key/value head.
constexpr int64_t kFewQueryRowsBackward = 16;
// The backward's one-pass schedule (a task per batch entry and key/value head) from this many
// such groups on; two passes below (flash_backward.hpp).
constexpr int64_t kMinGroupsForOnePassBackward = 16;
// bfloat16 products (AVX512-BF16) in the backward's tile schedules, for the problems
// bf16_pairs_backward_takes takes: bfloat16 q, k, v and output gradient, even head dims, more
// than 16 query rows per key/value head (fewer take the decoding backward), no gradient of the
// scores. Its gradients are within bfloat16 rounding of the
// float32 path's (Pd and dS are rounded to bfloat16 for its products).
bool bf16_pairs_backward_takes(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);
void flash_backward_avx512bf16(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);
void run_attention_backward(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out);

// Long bfloat16 / float16 forwards widen the keys and values of a chunk of heads at a time into a
// shared float32 buffer of at most this many floats (at least one head), and float32 forwards copy
// keys and values that are not packed into it the same way; settable for tests.
std::atomic<int64_t>& widened_chunk_floats();

// The forward copies each mask that varies along the queries transposed, once per call, and the
// backward's one-pass schedule in the order of its tiles, when the copy takes at most this many
// floats; a larger one is read in place. Settable for tests.
std::atomic<int64_t>& transposed_mask_floats();

// Whether the tile kernels skip blocks of (query, key) pairs a mask excludes entirely
// (excluded_keys.hpp); on by default, off for tests that compare against computing them.
std::atomic<bool>& skips_excluded_blocks();

// The (batch, query head) slices a mask term varies over, which its copies hold one by one:
// B x Hq at most, fewer where the mask broadcasts. mask_slice_count is false where the count
// overflows (a view's strides may alias its storage).
inline bool mask_slice_count(const MaskTerm& m, int64_t batch, int64_t heads_q, int64_t* count) {
  return !__builtin_mul_overflow(m.strides[0] != 0 ? batch : 1, m.strides[1] != 0 ? heads_q : 1, count);
}
inline int64_t mask_slice(const MaskTerm& m, int64_t heads_q, int64_t b, int64_t h) {
  return (m.strides[0] != 0 ? b : 0) * (m.strides[1] != 0 ? heads_q : 1) + (m.strides[1] != 0 ? h : 0);
}
// The first (b, h) that reads a slice.
inline void mask_slice_origin(const MaskTerm& m, int64_t heads_q, int64_t slice, int64_t* b, int64_t* h) {
  *h = m.strides[1] != 0 ? slice % heads_q : 0;
  *b = m.strides[0] != 0 ? slice / (m.strides[1] != 0 ? heads_q : 1) : 0;
}

// Validates kernel preconditions, copies inputs whose last stride is not 1, handles the cases
// with nothing to compute (Lk == 0, dropout_p == 1, empty tensors) and runs the ISA's kernel.
void run_attention(const AttentionProblem& p, const ForwardOutputs& o);
// Whether the forward for p reads a paged cache (AttentionProblem::key_pages) where it lies: the
// decoding kernel (up to kFewQueriesPerHead queries, unless the AMX kernel takes them) and the
// bfloat16 pair-product tile kernel do; the others are to be handed a gathered copy.
bool reads_pages_in_place(const AttentionProblem& p);

}  // namespace mha::detail
