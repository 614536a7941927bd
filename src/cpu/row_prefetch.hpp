// Software prefetch of the rows a thread's next task will read (and write), issued a few cache
// lines at a time while the current task computes.
//
// Why: at short sequences every task starts on rows no core has touched since the last call. A
// BERT-sized forward (B=32 H=12 L=128 d=64, 50 MB of q, k, v and out) streams them from DRAM, and
// the first reads of each task's query rows, output rows and new head's keys and values missed to
// memory: fp32 ran at 65% of the speed of the same shape with its inputs in cache. The hardware
// prefetchers do not help: each task reads short runs of rows (48 query rows, 8 key rows at a
// time), often a page apart. Issued as one burst at the task's start the prefetches helped less,
// as they queue behind each other; spread over the task's products they overlap its arithmetic.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace mha::detail {
namespace {  // (per ISA, as the kernels that use it)

// Calls whose rows (inputs and outputs together) take fewer bytes than this are left to the
// hardware: such rows are in the last-level cache when a call follows the projections that wrote
// them (or a call like it), and the issuing is then pure overhead. Zen 5, BERT-sized rows (L=128
// d=64, H=12, fp32): with prefetches 8% slower at B=4 (6 MB), level at B=8 (12.5 MB), 18% faster
// at B=16 (25 MB) and 48% at B=32 (50 MB). (A VM's reported L3 size is unreliable, so a constant.)
constexpr int64_t kMinBytesToPrefetch = int64_t{8} << 20;

class RowPrefetch {
 public:
  static constexpr int kMaxRanges = 8;
  static constexpr int64_t kLine = 64;

  // `rows` rows of `row_bytes` bytes, `stride` bytes apart from `base`; `write`: the lines will be
  // written (prefetched for ownership). Ranges past kMaxRanges, and empty ones, are ignored. A line
  // that two rows share is issued for each, but where the rows are adjacent (stride == row_bytes).
  void add(const void* base, int64_t rows, int64_t row_bytes, int64_t stride, bool write) {
    if (base == nullptr || rows <= 0 || row_bytes <= 0 || count_ == kMaxRanges) return;
    // Rows that follow each other with no gap (a [B, H, L, D] tensor's) are one span: issued
    // row by row, the loop's work per row was about a fifth of a BERT-sized bf16 key pass.
    if (stride == row_bytes) row_bytes *= rows, rows = 1;
    const auto address = reinterpret_cast<uintptr_t>(base);
    ranges_[count_++] = Range{address, rows, row_bytes, stride, write};
    // Lines per row depend on the row's alignment; rows a multiple of a line apart (every layout
    // the kernels meet) have the first row's count, others are counted per row.
    int64_t lines = 0;
    if (stride % kLine == 0) lines = rows * lines_of_row(address, row_bytes);
    else
      for (int64_t r = 0; r < rows; ++r) lines += lines_of_row(address + r * stride, row_bytes);
    left_ += lines;
  }

  int64_t lines_left() const { return left_; }

  // Issue up to `lines` of the queued prefetches, in order, into L2.
  void issue(int64_t lines) {
    issue(lines, [](uintptr_t line, bool write) {
      if (write) __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 2);
      else __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
    });
  }
  // The same, handing each line's address and the write flag to visit (the tests watch the order).
  // A row's lines in one tight loop: in a call whose rows are already in cache (a small batch),
  // the issuing is pure overhead, 8% of a call at a line per step of a general loop.
  template <class Visit>
  void issue(int64_t lines, const Visit& visit) {
    lines = std::min(lines, left_);
    left_ -= lines;
    while (lines > 0) {
      const Range& r = ranges_[at_];
      const uintptr_t row = r.base + static_cast<uintptr_t>(row_ * r.stride);
      const uintptr_t first = (row & ~static_cast<uintptr_t>(kLine - 1)) + static_cast<uintptr_t>(offset_ * kLine);
      const int64_t in_row = static_cast<int64_t>((row + static_cast<uintptr_t>(r.row_bytes) - 1) / kLine - first / kLine) + 1;
      const int64_t n = std::min(lines, in_row);
      if (r.write) {
        for (int64_t i = 0; i < n; ++i) visit(first + static_cast<uintptr_t>(i * kLine), true);
      } else {
        for (int64_t i = 0; i < n; ++i) visit(first + static_cast<uintptr_t>(i * kLine), false);
      }
      lines -= n;
      if (n < in_row) {
        offset_ += n;
      } else {  // the row's last line
        offset_ = 0;
        if (++row_ == r.rows) row_ = 0, ++at_;
      }
    }
  }

  // A share of what is left for one of `steps` equal steps (at least one line while any is left).
  int64_t share(int64_t steps) const { return steps <= 1 ? left_ : (left_ + steps - 1) / steps; }

 private:
  struct Range {
    uintptr_t base;
    int64_t rows, row_bytes, stride;
    bool write;
  };
  static int64_t lines_of_row(uintptr_t address, int64_t bytes) {
    return static_cast<int64_t>((address + bytes - 1) / kLine - address / kLine + 1);
  }

  std::array<Range, kMaxRanges> ranges_{};
  int count_ = 0, at_ = 0;
  int64_t row_ = 0, offset_ = 0, left_ = 0;
};

}  // namespace
}  // namespace mha::detail
