// Wall-clock timing as the tools report it: a few warm-up calls, then the median (robust to the
// odd slow run caused by the OS or other processes) and the minimum of several timed calls.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace mha::tools {

struct TimingStats {
  double median_ms = 0;
  double min_ms = 0;
  std::vector<double> samples_ms;  // in the order they were taken
};

inline double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since).count();
}

// Times `reps` calls of `fn` after `warmup` untimed ones. `after_each(ms)` is called after every
// call, warm-up included, so that long runs can show progress.
template <class Fn>
TimingStats time_repeats(Fn&& fn, int warmup, int reps, const std::function<void(double)>& after_each = {}) {
  for (int i = 0; i < warmup; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    if (after_each) after_each(elapsed_ms(start));
  }
  TimingStats stats;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    stats.samples_ms.push_back(elapsed_ms(start));
    if (after_each) after_each(stats.samples_ms.back());
  }
  if (stats.samples_ms.empty()) return stats;
  std::vector<double> sorted = stats.samples_ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  stats.median_ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  stats.min_ms = sorted.front();
  return stats;
}

// GFLOP/s of `flops` operations done in `ms` milliseconds.
inline double gflops_per_second(double flops, double ms) { return ms > 0 ? flops / (ms * 1e6) : 0.0; }

}  // namespace mha::tools
