// PyTorch's batch dimensions for scaled_dot_product_attention: every dimension of q, k, v (and of
// the mask) before the last two is a batch dimension, broadcast as torch.matmul broadcasts them
// (right-aligned; a size 1 or a missing dimension stretches), the last of them (-3) being the
// heads. The kernels take [B, H, L, D] views: the leading batch dimensions fold into B where the
// strides allow (stride 0 where a tensor broadcasts), and are copied where they do not.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

// The broadcast of `shapes`, or mha::Error "<what>: shapes [..] and [..] do not broadcast".
Shape broadcast_shapes(const std::vector<Shape>& shapes, const std::string& what);

// The dimensions of t before its last two (its batch dimensions).
Shape batch_dims_of(const TensorView& t);

// t, of shape [..., rows, cols] with batch dimensions that broadcast to `batch`, as the view over
// (b, h, row, col) the kernels read: b runs over the product of batch[:-1] in row-major order and
// h over batch.back() (one of each where batch is empty), with stride 0 where t broadcasts. None
// where t's strides do not fold its leading batch dimensions into one.
std::optional<TensorView> fold_batch(const TensorView& t, const Shape& batch);

// fold_batch, or that of a contiguous copy of t expanded to `batch`, kept in `storage` (host
// tensors only: mha::Error naming `name` for a device tensor that does not fold).
TensorView fold_batch_or_copy(const TensorView& t, const Shape& batch, Tensor& storage, const std::string& name);

// `full` summed over the dimensions a tensor of shape `target` broadcasts along (right-aligned:
// leading dimensions target lacks, and those where it has size 1), in `dtype`. Sums run in
// float64 where `full` or the result is float64 and in float32 otherwise, in one fixed order,
// rounded once; the same bits on any thread count.
Tensor sum_to_shape(const TensorView& full, const Shape& target, DType dtype, int threads = 1);

// The gradient of an input of shape `input` from its gradient `full` over the call's batch shape
// ([..., H, rows, cols]): sum_to_shape, after summing over each head's repeats where the input's
// head count divides H and is neither 1 nor H (keys or values of grouped attention whose head
// counts differ, read with their heads repeated: make_sdpa_problem).
Tensor sum_to_input(const TensorView& full, const Shape& input, DType dtype, int threads = 1);

}  // namespace mha::detail
