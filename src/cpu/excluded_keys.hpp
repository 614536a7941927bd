// Blocks of (query, key) pairs a mask term excludes entirely (-inf or false throughout: the padded
// tail of a short sequence in a batch, a causal mask given as a tensor), which the forward and the
// backward then skip, as they skip causal blocks; and blocks a huge finite mask value swamps. A
// mask that varies along the queries gets its map with its copy where it is copied
// (flash_forward.hpp, flash_backward.hpp), else from excluded_tiles; a key padding mask, read in
// place, from excluded_key_blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {  // (per ISA: each kernel file compiles its own, as the tile kernels)

// What a map says of a block: kept; excluded (-inf or false for every pair), which every kernel
// skips; or swamped, every value -inf or finite at most kSwampedBelow once scaled by log2(e)
// (Hugging Face's masks use finfo.min, -FLT_MAX scaled). A swamped block weighs exactly nothing
// in the rows that see a key whose mask values are all above kOrdinaryAbove (ordinary_rows): the
// row's max is then 2^125 above each of the block's scores (for scores below 2^99 in magnitude),
// and 2^-(2^125) is 0. A row without such a key (a padded query row) gives uniform weight to
// keys at its max, swamped or not, so the kernels skip swamped blocks only for tasks (or tiles)
// whose rows all have one.
constexpr uint8_t kKept = 0, kExcluded = 1, kSwamped = 2;
constexpr float kSwampedBelow = -0x1p126f, kOrdinaryAbove = -0x1p100f;

// kExcluded, kSwamped (where asked for) or kKept, from whether every value so far was -inf and
// whether every one was at most kSwampedBelow.
inline uint8_t block_class(bool all_excluded, bool all_swamped, bool swamped) {
  return all_excluded ? kExcluded : swamped && all_swamped ? kSwamped : kKept;
}

// For a term with strides[2] == 0: per (slice, block of `block` keys), kExcluded where every key
// of the block is excluded (-inf or false), kSwamped (where `swamped`) where every key is swamped,
// in `storage` (which owns it); null for any other term, or
// where the slices cannot be counted, or skipping is off (skips_excluded_blocks).
template <class S>
const uint8_t* excluded_key_blocks(const AttentionProblem& p, const MaskTerm& m, int64_t block, int threads,
                                   std::vector<Tensor>& storage, bool swamped = false) {
  int64_t slices = 0;
  if (!skips_excluded_blocks().load() || m.strides[2] != 0 || !mask_slice_count(m, p.batch, p.heads_q, &slices)) {
    return nullptr;
  }
  const int64_t blocks = (p.len_k + block - 1) / block;
  storage.push_back(Tensor::empty({slices * blocks}, DType::boolean));
  uint8_t* excluded = storage.back().data<uint8_t>();
  constexpr int kLanes = S::kLanes;
  parallel_for(slices, threads, [&](int64_t slice, int) {
    int64_t b = 0, h = 0;
    mask_slice_origin(m, p.heads_q, slice, &b, &h);
    alignas(64) float values[kLanes];
    for (int64_t kb = 0; kb < blocks; ++kb) {
      bool all = true, all_swamped = swamped;
      const int64_t end = std::min(p.len_k, (kb + 1) * block);
      for (int64_t j0 = kb * block; j0 < end && (all || all_swamped); j0 += kLanes) {
        const int nc = static_cast<int>(std::min<int64_t>(kLanes, end - j0));
        S::store(values, Tiles<S>::mask_row(m, b, h, 0, j0, nc));
        for (int c = 0; c < nc; ++c) {
          all = all && values[c] == -std::numeric_limits<float>::infinity();
          all_swamped = all_swamped && values[c] <= kSwampedBelow;
        }
      }
      excluded[slice * blocks + kb] = block_class(all, all_swamped, swamped);
    }
  });
  return excluded;
}

// For a term that varies along the queries, read where it is (its copy would not fit, or the
// schedule reads masks in place): per (slice, block of `rows` queries, block of `keys` keys),
// kExcluded or kSwamped (as above) for the tile, [slices][query blocks][key blocks], in
// `storage`; null where the slices cannot be counted or skipping is off. A tile's scan stops at
// its first pair that is neither, so a mask that excludes little costs little.
template <class S>
const uint8_t* excluded_tiles(const AttentionProblem& p, const MaskTerm& m, int64_t rows, int64_t keys, int threads,
                              std::vector<Tensor>& storage, bool swamped = false) {
  int64_t slices = 0;
  if (!skips_excluded_blocks().load() || !mask_slice_count(m, p.batch, p.heads_q, &slices)) return nullptr;
  const int64_t q_blocks = (p.len_q + rows - 1) / rows, k_blocks = (p.len_k + keys - 1) / keys;
  storage.push_back(Tensor::empty({slices * q_blocks * k_blocks}, DType::boolean));
  uint8_t* excluded = storage.back().data<uint8_t>();
  constexpr int kLanes = S::kLanes;
  parallel_for(slices * q_blocks, threads, [&](int64_t task, int) {
    int64_t b = 0, h = 0;
    mask_slice_origin(m, p.heads_q, task / q_blocks, &b, &h);
    const int64_t i0 = task % q_blocks * rows, i1 = std::min(p.len_q, i0 + rows);
    alignas(64) float values[kLanes];
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      bool all = true, all_swamped = swamped;
      const int64_t end = std::min(p.len_k, (kb + 1) * keys);
      for (int64_t i = i0; i < i1 && (all || all_swamped); ++i)
        for (int64_t j0 = kb * keys; j0 < end && (all || all_swamped); j0 += kLanes) {
          const int nc = static_cast<int>(std::min<int64_t>(kLanes, end - j0));
          S::store(values, Tiles<S>::mask_row(m, b, h, i, j0, nc));
          for (int c = 0; c < nc; ++c) {
            all = all && values[c] == -std::numeric_limits<float>::infinity();
            all_swamped = all_swamped && values[c] <= kSwampedBelow;
          }
        }
      excluded[task * k_blocks + kb] = block_class(all, all_swamped, swamped);
    }
  });
  return excluded;
}

// Per query row (b, h, i): 1 where the row sees a key (within causality) whose every mask term is
// above kOrdinaryAbove once scaled, so that swamped blocks weigh nothing in it. Stored per the
// batch entries and heads the masks vary along; null where no term is additive (only those can
// swamp) or skipping is off.
struct OrdinaryRows {
  const uint8_t* flags = nullptr;
  bool per_batch = false, per_head = false;
  int64_t heads = 0, len_q = 0;
  // Whether rows [i0, i1) of head (b, h) all have such a key.
  bool all(int64_t b, int64_t h, int64_t i0, int64_t i1) const {
    if (flags == nullptr) return false;
    const uint8_t* row = flags + ((per_batch ? b : 0) * (per_head ? heads : 1) + (per_head ? h : 0)) * len_q;
    for (int64_t i = i0; i < i1; ++i)
      if (!row[i]) return false;
    return true;
  }
};

inline OrdinaryRows ordinary_rows(const AttentionProblem& p, int threads, std::vector<Tensor>& storage) {
  OrdinaryRows rows;
  bool additive = false;
  for (int t = 0; t < p.num_masks; ++t) {
    additive = additive || p.masks[t].kind == MaskKind::additive;
    rows.per_batch = rows.per_batch || p.masks[t].strides[0] != 0;
    rows.per_head = rows.per_head || p.masks[t].strides[1] != 0;
  }
  if (!additive || !skips_excluded_blocks().load()) return {};
  rows.heads = p.heads_q, rows.len_q = p.len_q;
  const int64_t slices = (rows.per_batch ? p.batch : 1) * (rows.per_head ? p.heads_q : 1);
  storage.push_back(Tensor::empty({slices * p.len_q}, DType::boolean));
  uint8_t* flags = storage.back().data<uint8_t>();
  constexpr int64_t kRowsPerTask = 64;
  const int64_t chunks = (p.len_q + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(slices * chunks, threads, [&](int64_t task, int) {
    const int64_t slice = task / chunks, heads = rows.per_head ? p.heads_q : 1;
    const int64_t b = slice / heads, h = slice % heads;
    auto ordinary = [&](int64_t i, int64_t j) {
      for (int t = 0; t < p.num_masks; ++t)
        if (!(p.masks[t].bias(b, h, i, j) * kLog2e > kOrdinaryAbove)) return false;
      return true;
    };
    for (int64_t i = task % chunks * kRowsPerTask; i < std::min(p.len_q, (task % chunks + 1) * kRowsPerTask); ++i) {
      // The diagonal first (a causal mask's nearest key), then from the first key (of a sliding
      // window) on.
      const int64_t begin = p.window_begin(i), end = p.causal_end(i);
      bool found = begin < end && ordinary(i, std::clamp(i, begin, end - 1));
      for (int64_t j = begin; j < end && !found; ++j) found = ordinary(i, j);
      flags[slice * p.len_q + i] = found;
    }
  });
  rows.flags = flags;
  return rows;
}

}  // namespace
}  // namespace mha::detail
