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

// How long the slowest of `threads` threads takes to run sequences of these costs (longest
// first), each whole on one thread, handed out in order to the thread that is free first (as
// parallel_for hands out tasks).
inline double narrow_makespan(std::span<const double> costs_longest_first, int threads) {
  std::vector<double> load(static_cast<size_t>(std::max(threads, 1)), 0.0);
  for (double c : costs_longest_first) *std::min_element(load.begin(), load.end()) += c;
  return *std::max_element(load.begin(), load.end());
}

// Runs run(s, threads) for every sequence s with work in it (`cost[s]` > 0). Sequences run whole
// on one thread each, handed out longest first, where that keeps the slowest thread within an
// eighth of an even split: no thread waits on another inside a sequence. (A paged decoding step
// of 2-8 equal sequences on 2 threads, bf16 H=32/8 S=4096 d=128, took 0.84-0.92x the time of
// running each on both, whose 5 runs of keys split 3 to 2.) Otherwise the longest runs on all
// threads (its own tasks balance), and the rest are weighed again.
template <class Run>
void for_each_sequence(const std::vector<double>& cost, int threads, Run run) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  while (!order.empty() && cost[order.back()] <= 0) order.pop_back();
  std::vector<double> sorted(order.size());
  for (size_t i = 0; i < order.size(); ++i) sorted[i] = cost[order[i]];
  double rest = std::accumulate(sorted.begin(), sorted.end(), 0.0);
  size_t wide = 0;
  while (threads > 1 && wide < order.size() &&
         narrow_makespan(std::span(sorted).subspan(wide), threads) > 1.125 * rest / threads) {
    rest -= sorted[wide];
    run(order[wide++], threads);
  }
  parallel_for(static_cast<int64_t>(order.size() - wide), threads,
               [&](int64_t t, int) { run(order[wide + static_cast<size_t>(t)], 1); });
}

}  // namespace mha::detail
