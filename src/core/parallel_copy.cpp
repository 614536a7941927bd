#include "core/parallel_copy.hpp"

#include <algorithm>
#include <cstdint>

#include "core/thread_pool.hpp"

namespace mha::detail {

void parallel_copy_into(const TensorView& src, const TensorView& dst, int threads) {
  constexpr int64_t kMinElementsPerTask = 1 << 16;  // below this a task costs more than it saves
  const int64_t n = src.numel();
  if (threads <= 1 || src.ndim < 2 || src.sizes() != dst.sizes() || n < 2 * kMinElementsPerTask) {
    copy_into(src, dst);  // also the one place that reports mismatched shapes
    return;
  }
  // Split the leading dimensions [0, split) into tasks: enough of them to balance, each still
  // large. The last dimension always stays whole.
  int split = 0;
  int64_t tasks = 1;
  while (split < src.ndim - 1 && tasks < 4 * threads && n / (tasks * src.shape[split]) >= kMinElementsPerTask) {
    tasks *= src.shape[split];
    ++split;
  }
  if (split == 0) {  // one index of the first dimension is too small a task: ranges of indices
    const int64_t per_index = n / src.shape[0];
    const int64_t chunk = (kMinElementsPerTask + per_index - 1) / per_index;
    parallel_for((src.shape[0] + chunk - 1) / chunk, threads, [&](int64_t t, int) {
      const int64_t begin = t * chunk, end = std::min(src.shape[0], begin + chunk);
      copy_into(src.slice(0, begin, end), dst.slice(0, begin, end));
    });
    return;
  }
  parallel_for(tasks, threads, [&](int64_t t, int) {
    TensorView s = src, d = dst;
    for (int dim = split - 1; dim >= 0; --dim) {  // peel the task index into one index per dimension
      const int64_t i = t % src.shape[dim];
      t /= src.shape[dim];
      s = s.select(dim, i);
      d = d.select(dim, i);
    }
    copy_into(s, d);
  });
}

Tensor parallel_copy_of(const TensorView& src, DType dtype, int threads) {
  Tensor t = Tensor::empty(src.sizes(), dtype);
  parallel_copy_into(src, t.view(), threads);
  return t;
}

}  // namespace mha::detail
