// The kernels' prefetch queue (cpu/row_prefetch.hpp): every cache line of every queued row,
// each once per row (once where rows are adjacent), in order, with its write flag, whatever the rows' alignment, length and stride and
// however the issues are split; and the count of lines left, which the kernel spreads over its
// tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "cpu/row_prefetch.hpp"
#include "test_support.hpp"

namespace {

using mha::detail::RowPrefetch;
using Line = std::pair<uintptr_t, bool>;

struct Rows {
  uintptr_t base;
  int64_t rows, row_bytes, stride;
  bool write;
};

// The lines a range covers, written from the definition: every line holding a byte of a row, row
// by row, in address order within a row; adjacent rows (stride == row_bytes) as one span, each
// line once.
std::vector<Line> lines_of(const Rows& r) {
  std::vector<Line> lines;
  if (r.stride == r.row_bytes) {
    for (uintptr_t line = r.base / 64 * 64; line < r.base + static_cast<uintptr_t>(r.rows * r.row_bytes); line += 64)
      lines.emplace_back(line, r.write);
    return lines;
  }
  for (int64_t i = 0; i < r.rows; ++i) {
    const uintptr_t first = r.base + static_cast<uintptr_t>(i * r.stride);
    for (uintptr_t line = first / 64 * 64; line < first + static_cast<uintptr_t>(r.row_bytes); line += 64)
      lines.emplace_back(line, r.write);
  }
  return lines;
}

TEST(RowPrefetch, IssuesEveryLineOfEveryRowOnceInOrder) {
  std::mt19937_64 rng(mha_test::test_seed());
  for (int trial = 0; trial < 500; ++trial) {
    RowPrefetch queue;
    std::vector<Line> expected;
    int queued = 0;
    const int ranges = std::uniform_int_distribution<int>(0, RowPrefetch::kMaxRanges + 2)(rng);
    for (int k = 0; k < ranges; ++k) {
      Rows r;
      r.base = 0x100000 + std::uniform_int_distribution<uintptr_t>(0, 1 << 20)(rng);
      r.rows = std::uniform_int_distribution<int64_t>(0, 70)(rng);
      r.row_bytes = std::uniform_int_distribution<int64_t>(0, 1100)(rng);
      // Line-multiple strides (the kernels' layouts), others, one row read again (stride 0), and
      // adjacent rows (stride == row_bytes, one span).
      const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
      r.stride = kind == 0   ? 64 * std::uniform_int_distribution<int64_t>(1, 40)(rng)
                 : kind == 1 ? std::uniform_int_distribution<int64_t>(1, 3000)(rng)
                 : kind == 2 ? 0
                             : r.row_bytes;
      r.write = (rng() & 1) != 0;
      queue.add(reinterpret_cast<const void*>(r.base), r.rows, r.row_bytes, r.stride, r.write);
      // Empty ranges, and ranges past kMaxRanges, are not queued.
      if (r.rows > 0 && r.row_bytes > 0 && queued++ < RowPrefetch::kMaxRanges) {
        const std::vector<Line> lines = lines_of(r);
        expected.insert(expected.end(), lines.begin(), lines.end());
      }
    }
    ASSERT_EQ(queue.lines_left(), static_cast<int64_t>(expected.size())) << "trial " << trial;

    // Issued in steps of random sizes, as the kernel's tiles issue their shares.
    std::vector<Line> issued;
    while (queue.lines_left() > 0) {
      const int64_t left = queue.lines_left();
      const int64_t step = std::uniform_int_distribution<int64_t>(0, 50)(rng);
      queue.issue(step, [&](uintptr_t line, bool write) { issued.emplace_back(line, write); });
      ASSERT_EQ(queue.lines_left(), left - std::min(step, left));
      // A share of n steps is at least the n-th part, and some line while any is left.
      const int64_t steps = std::uniform_int_distribution<int64_t>(1, 9)(rng);
      const int64_t share = queue.share(steps);
      EXPECT_GE(share * steps, queue.lines_left());
      EXPECT_LE(share, queue.lines_left());
    }
    ASSERT_EQ(issued, expected) << "trial " << trial;
    queue.issue(10, [&](uintptr_t, bool) { ADD_FAILURE() << "a line issued past the queue's end"; });
  }
}

}  // namespace
