// How calls made of independent sequences (variable-length batches, paged caches) spread their
// sequences over the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/thread_pool.hpp"

namespace mha::detail {

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
