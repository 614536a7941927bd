// y = x W^T + b over [N, L, C] views, through BLAS (OpenBLAS's sgemm).
#pragma once

#include "mha/tensor.hpp"

namespace mha::detail {

// x: [N, L, in], any strides; w: [out, in] with unit last stride; bias: [out] or null;
// y: [N, L, out] with unit last stride. One sgemm when x and y order their (N, L) rows alike
// with uniform strides, one per batch entry otherwise.
void linear(const TensorView& x, const TensorView& w, const float* bias, const TensorView& y, int threads);

// A [N, rows, cols] float32 buffer whose (N, rows) memory order matches `like` ([N, L, C]): a
// sequence-first input gets a sequence-first buffer, so projecting it is a single sgemm.
struct RowBuffer {
  Tensor storage;
  TensorView view;  // [N, rows, cols]
};
RowBuffer rows_like(const TensorView& like, int64_t rows, int64_t cols);

}  // namespace mha::detail
