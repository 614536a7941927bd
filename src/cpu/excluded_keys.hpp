// Key blocks a query-invariant mask excludes entirely (a key padding mask: the padded tail of a
// short sequence in a batch), which the forward and the backward then skip, as they skip causal
// blocks. A mask that varies along the queries gets its map with its copy (flash_forward.hpp,
// flash_backward.hpp); one that does not is read in place and gets this map alone.
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
// where the slices cannot be counted.
template <class S>
const uint8_t* excluded_key_blocks(const AttentionProblem& p, const MaskTerm& m, int64_t block, int threads,
                                   std::vector<Tensor>& storage) {
  int64_t slices = 0;
  if (m.strides[2] != 0 || !mask_slice_count(m, p.batch, p.heads_q, &slices)) return nullptr;
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

}  // namespace
}  // namespace mha::detail
