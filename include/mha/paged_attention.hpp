// Attention over a paged key/value cache, the layout of vLLM's PagedAttention and of
// FlashAttention's flash_attn_with_kvcache with a block_table: an inference server keeps the keys
// and values of all its sequences in one pool of fixed-size pages, and each sequence lists the
// pages that hold its keys, in order, so that sequences grow, end and share prefixes without
// moving the cache.
//
//   q           [B, Hq, Lq, Dk]                       out [B, Hq, Lq, Dv]
//   key_cache   [pages, Hkv, page_size, Dk]          value_cache [pages, Hkv, page_size, Dv]
//   block_table [B, pages_per_sequence] (int32, row-major)   cache_seqlens [B]
//
// Sequence b's keys are positions [0, cache_seqlens[b]): key j lies in page
// block_table[b][j / page_size], row j % page_size. Entries past a sequence's last page are not
// read (-1 padding is fine). Any strides with unit stride in the last dimension, so the vLLM /
// FlashAttention cache [pages, page_size, Hkv, D] is passed as its transpose(1, 2) view, in place.
// The result for sequence b is scaled_dot_product_attention of q[b] over its cache_seqlens[b]
// keys gathered in order, bit for bit (a test holds it to that); a sequence with no key gives
// zeros.
//
// Options are SdpaOptions: is_causal with causal_alignment (BottomRight for decoding: q's Lq rows
// are the last Lq positions, so the last query sees every key; FlashAttention's kvcache
// alignment), a sliding window, ALiBi (alibi_slopes [Hq] or [B, Hq]), attention sinks (sinks
// [Hq]; a sequence with no key then has the sinks as its lse), softcap, scale, enable_gqa (Hq a
// multiple of Hkv: the cache is read once per key/value head), k_descale and v_descale for float8
// caches ([], [Hkv] or [B, Hkv]: each sequence's own), num_threads. attn_mask and dropout
// are not taken (inference: the sequences' lengths are their masks).
//
// Up to 32 queries per head (decoding, speculative decoding) the kernel reads the pages where
// they are; so does the bfloat16 tile kernel on a CPU with bfloat16 products and no AMX, for
// longer query blocks (chunked prefill). Other longer blocks (float32, float16, float64, the AMX
// path) gather each sequence's pages into one buffer first (keys and values once per sequence,
// against Lq times as many multiply-adds).
#pragma once

#include <cstdint>
#include <span>

#include "mha/sdpa.hpp"
#include "mha/tensor.hpp"

namespace mha {

// Returns out [B, Hq, Lq, Dv] (contiguous, the query's dtype: float32, bfloat16, float16 or
// float64, one dtype for q and both caches, or float8 caches (e4m3 or e5m2, with k_descale and
// v_descale where they are scaled) under a float32, bfloat16 or float16 query, half a bfloat16
// cache's memory; on the host).
Tensor paged_attention(const TensorView& q, const TensorView& key_cache, const TensorView& value_cache,
                       std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                       const SdpaOptions& options = {});

// The same with a different number of query rows per sequence, packed one after another
// (FlashAttention's varlen layout): q [Tq, Hq, Dk], sequence b's rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) (B + 1 offsets from 0 to Tq). A continuous-batching step mixes chunks of
// prompts with single decoding tokens this way; each sequence's queries are its last rows (with
// BottomRight causality the last query sees all cache_seqlens[b] keys). Returns out [Tq, Hq, Dv].
Tensor paged_attention_varlen(const TensorView& q, std::span<const int64_t> cu_seqlens_q,
                              const TensorView& key_cache, const TensorView& value_cache,
                              std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                              const SdpaOptions& options = {});

// The output and each query row's log-sum-exp of its scaled scores (natural log; float32, float64
// for float64 inputs; +inf for a row that sees no key, FlashAttention's convention, or the
// head's sink with sinks): lse is
// [B, Hq, Lq], or [Hq, Tq] for packed queries. Two results over disjoint sets of keys (a prefix
// shared by many sequences and each one's own suffix, or one cache split across workers) merge
// into the result over their union: reading +inf as -inf (no weight), m = max(lse_a, lse_b),
// w_x = exp(lse_x - m), out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + log(w_a + w_b).
// With sinks, pass them to one of the parts only (each part's lse counts its sink once).
struct PagedAttentionOutput {
  Tensor output;
  Tensor lse;
};
PagedAttentionOutput paged_attention_with_lse(const TensorView& q, const TensorView& key_cache,
                                              const TensorView& value_cache, std::span<const int32_t> block_table,
                                              std::span<const int64_t> cache_seqlens, const SdpaOptions& options = {});
PagedAttentionOutput paged_attention_varlen_with_lse(const TensorView& q, std::span<const int64_t> cu_seqlens_q,
                                                     const TensorView& key_cache, const TensorView& value_cache,
                                                     std::span<const int32_t> block_table,
                                                     std::span<const int64_t> cache_seqlens,
                                                     const SdpaOptions& options = {});

// The result over the union of two disjoint sets of keys from each set's output and lse, by the
// formula above (cascade attention: a shared prefix's result merged into each sequence's own).
// out_a and out_b of one shape and dtype, lse_a and lse_b of one shape and dtype (float32 or
// float64): [.., Dv] with lse [..] ([B, Hq, Lq, Dv] and [B, Hq, Lq]), or for the varlen form
// packed rows [Tq, Hq, Dv] with lse [Hq, Tq]; any strides, on the host. Computed in float64;
// returns the output in out's dtype and the lse in lse's (+inf where neither part saw a key,
// whose output is zeros).
PagedAttentionOutput merge_attention_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                                            const TensorView& lse_b);
PagedAttentionOutput merge_attention_states_varlen(const TensorView& out_a, const TensorView& lse_a,
                                                   const TensorView& out_b, const TensorView& lse_b);

// Quantisation of the rows written into float8 caches (vLLM's k_scale and v_scale): each row of
// key/value head h of sequence b is divided by k_descale (v_descale) for (b, h) before it is
// rounded, so that attention given the same tensors as SdpaOptions::k_descale / v_descale reads
// back the rows written (to float8's precision). float32 of shape [], [Hkv] or [B, Hkv] (either
// dimension 1 to broadcast; for the varlen form B is the sequences'), finite and > 0; for float8
// caches only. The division is in float32: PyTorch's (key.float() / k_descale).to(float8).
struct CacheWriteScales {
  std::optional<TensorView> k_descale;
  std::optional<TensorView> v_descale;
};

// Writes new keys and values into the cache, as a decoding step does before its attention: row t
// of sequence b (key[b, :, t, :], value[b, :, t, :]) goes to position cache_seqlens[b] + t of
// that sequence's pages. key [B, Hkv, Lnew, Dk], value [B, Hkv, Lnew, Dv] of the caches' dtype
// (into float8 caches also float32, bfloat16 or float16, rounded to nearest even as written);
// every position written must lie in a listed page. cache_seqlens is left as it is (the caller
// advances it by Lnew). Sequences are written in order, so where two share a page slot the later
// sequence's row is the one kept.
void write_paged_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, std::span<const int32_t> block_table,
                       std::span<const int64_t> cache_seqlens, const CacheWriteScales& scales = {});

// The same for rows of a different count per sequence, packed one after another: key [Tnew, Hkv, Dk],
// value [Tnew, Hkv, Dv], sequence b's rows [cu_seqlens_new[b], cu_seqlens_new[b + 1]) (B + 1
// offsets from 0 to Tnew; the cu_seqlens_q of a continuous-batching step whose queries each bring
// their key and value).
void write_paged_cache_varlen(const TensorView& key, const TensorView& value, std::span<const int64_t> cu_seqlens_new,
                              const TensorView& key_cache, const TensorView& value_cache,
                              std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                              const CacheWriteScales& scales = {});

}  // namespace mha
