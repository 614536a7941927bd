// y = x W^T + b over [N, L, C] views, through BLAS (OpenBLAS's sgemm, dgemm for float64), or
// oneDNN's matmul (onednn_matmul.hpp).
#pragma once

#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

// x: [N, L, in], any strides; w: [out, in] with unit last stride, float32 or (read as float32)
// bfloat16/float16; bias: [out] or null; y: [N, L, out] with unit last stride. One sgemm when x
// and y order their (N, L) rows alike with uniform strides, one per batch entry otherwise; up to
// 64 rows against a 16-bit weight, few_rows_gemm on the weight as it is; more rows against a
// bfloat16 weight, with x all bfloat16 values, oneDNN's bf16 matmul where available; otherwise
// from 512 rows, oneDNN's float32 matmul on a weight packed once where available
// (f32_matmul_available()); below that, gemm() (oneDNN on the weight as it is, or sgemm).
void linear(const TensorView& x, const TensorView& w, const float* bias, const TensorView& y, int threads);
// A bfloat16 Linear as PyTorch's: x [N, L, in] (any strides), w [out, in] and y [N, L, out] (unit
// last strides) all bfloat16; y = x W^T + bias, summed in float32 and rounded once, through
// oneDNN's bf16 matmul (only where bf16_matmul_available()), in blocks fixed by the shape.
void linear_bf16(const TensorView& x, const TensorView& w, const float* bias, const TensorView& y, int threads);
// Several bfloat16 Linears in one pass of the threads (a module's q, k and v projections), their
// blocks interleaved so that threads work on different weights at once; the bits are each one's
// alone.
struct Projection {
  TensorView x, w;
  const float* bias;
  TensorView y;
};
void linear_bf16(const std::vector<Projection>& projections, int threads);
// Several float32 Linears (a module's q, k and v projections) as linear() would compute each;
// where all take oneDNN's matmul, in one pass of the threads, their blocks interleaved.
void linear(const std::vector<Projection>& projections, int threads);
// The float64 module's: x, w and y all float64 (x any strides), through dgemm.
void linear(const TensorView& x, const TensorView& w, const double* bias, const TensorView& y, int threads);

// C = op(A) op(B) + beta C on row-major matrices (op: transpose or not), in blocks fixed by the
// shape: float32 through oneDNN's matmul where f32_matmul_available() (else sgemm), float64 through dgemm.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc, int threads);
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc, int threads);
// bfloat16 A, B and C: C = op(A) op(B) (beta must be 0), the float32 sums rounded once, through
// oneDNN's bf16 matmul (only where bf16_matmul_available()).
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda,
          const bfloat16* b, int64_t ldb, float beta, bfloat16* c, int64_t ldc, int threads);

// A [N, rows, cols] buffer (float32 unless told) whose (N, rows) memory order matches `like`
// ([N, L, C]): a sequence-first input gets a sequence-first buffer, so projecting it is a single sgemm.
struct RowBuffer {
  Tensor storage;
  TensorView view;  // [N, rows, cols]
};
RowBuffer rows_like(const TensorView& like, int64_t rows, int64_t cols, DType dtype = DType::f32);

}  // namespace mha::detail
