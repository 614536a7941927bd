// copy_into (dtype conversion included) split over the thread pool, for the large conversions
// around a kernel (bf16/fp16 widened to float32 and rounded back), which are memory-bound and would
// otherwise leave every core but one idle.
#pragma once

#include "mha/tensor.hpp"

namespace mha::detail {

// The same result as copy_into(src, dst): each task copies whole sub-blocks along the leading
// dimensions, so the element values do not depend on the thread count.
void parallel_copy_into(const TensorView& src, const TensorView& dst, int threads);

// Tensor::copy_of(src, dtype), with the copy split over the pool.
Tensor parallel_copy_of(const TensorView& src, DType dtype, int threads);

}  // namespace mha::detail
