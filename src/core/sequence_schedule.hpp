// Calls made of independent sequences (variable-length batches, paged caches): their offsets,
// and how they spread their sequences over the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.hpp"
#include "mha/error.hpp"

namespace mha::detail {

// Offsets of sequences packed one after another (cu_seqlens): one per sequence plus one, from 0,
// non-decreasing, ending at `total` rows; mha::Error naming `name` otherwise.
inline void check_offsets(std::span<const int64_t> cu, int64_t total, const std::string& name, const std::string& rows) {
  if (cu.empty()) {
    throw Error(name + ": expected one offset per sequence plus one (starting at 0), got none");
  }
  if (cu.front() != 0) throw Error(name + ": expected the first offset to be 0, got " + std::to_string(cu.front()));
  for (size_t s = 1; s < cu.size(); ++s) {
    if (cu[s] < cu[s - 1]) {
      throw Error(name + ": expected non-decreasing offsets, got " + name + "[" + std::to_string(s) + "] = " +
                  std::to_string(cu[s]) + " after " + std::to_string(cu[s - 1]));
    }
  }
  if (cu.back() != total) {
    throw Error(name + ": expected the last offset to be the number of " + rows + " rows, " + std::to_string(total) +
                ", got " + std::to_string(cu.back()));
  }
}

// Runs run(s, threads) for every sequence s with work in it (`cost[s]` > 0). A sequence that holds
// at least a (4 x threads)-th of the work runs on all threads (its own tasks balance), longest
// first; the rest run whole on one thread each, longest first, handed out one at a time.
template <class Run>
void for_each_sequence(const std::vector<double>& cost, int threads, Run run) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  while (!order.empty() && cost[order.back()] <= 0) order.pop_back();
  const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
  size_t wide = 0;
  while (threads > 1 && wide < order.size() && cost[order[wide]] * 4.0 * threads >= total) run(order[wide++], threads);
  parallel_for(static_cast<int64_t>(order.size() - wide), threads,
               [&](int64_t t, int) { run(order[wide + static_cast<size_t>(t)], 1); });
}

}  // namespace mha::detail
