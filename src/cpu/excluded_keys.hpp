// Blocks of (query, key) pairs a mask term excludes entirely (-inf or false throughout: the padded
// tail of a short sequence in a batch, a causal mask given as a tensor), which the forward and the
// backward then skip, as they skip causal blocks. A mask that varies along the queries gets its
// map with its copy where it is copied (flash_forward.hpp, flash_backward.hpp), else from
// excluded_tiles; a key padding mask, read in place, from excluded_key_blocks.
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

// For a term with strides[2] == 0: per (slice, block of `block` keys), 1 where every key of the
// block is excluded (-inf or false), in `storage` (which owns it); null for any other term, or
// where the slices cannot be counted, or skipping is off (skips_excluded_blocks).
template <class S>
const uint8_t* excluded_key_blocks(const AttentionProblem& p, const MaskTerm& m, int64_t block, int threads,
                                   std::vector<Tensor>& storage) {
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
      bool all = true;
      const int64_t end = std::min(p.len_k, (kb + 1) * block);
      for (int64_t j0 = kb * block; j0 < end && all; j0 += kLanes) {
        const int nc = static_cast<int>(std::min<int64_t>(kLanes, end - j0));
        S::store(values, Tiles<S>::mask_row(m, b, h, 0, j0, nc));
        for (int c = 0; c < nc; ++c) all = all && values[c] == -std::numeric_limits<float>::infinity();
      }
      excluded[slice * blocks + kb] = all;
    }
  });
  return excluded;
}

// For a term that varies along the queries, read where it is (its copy would not fit, or the
// schedule reads masks in place): per (slice, block of `rows` queries, block of `keys` keys), 1
// where the term excludes every pair of the tile, [slices][query blocks][key blocks], in
// `storage`; null where the slices cannot be counted or skipping is off. A tile's scan stops at
// its first visible pair, so a mask that excludes little costs little.
template <class S>
const uint8_t* excluded_tiles(const AttentionProblem& p, const MaskTerm& m, int64_t rows, int64_t keys, int threads,
                              std::vector<Tensor>& storage) {
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
      bool all = true;
      const int64_t end = std::min(p.len_k, (kb + 1) * keys);
      for (int64_t i = i0; i < i1 && all; ++i)
        for (int64_t j0 = kb * keys; j0 < end && all; j0 += kLanes) {
          const int nc = static_cast<int>(std::min<int64_t>(kLanes, end - j0));
          S::store(values, Tiles<S>::mask_row(m, b, h, i, j0, nc));
          for (int c = 0; c < nc; ++c) all = all && values[c] == -std::numeric_limits<float>::infinity();
        }
      excluded[task * k_blocks + kb] = all;
    }
  });
  return excluded;
}

}  // namespace
}  // namespace mha::detail
