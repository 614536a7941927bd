// What the GPU kernels' entry points share on the host: the checks of what the kernels support
// and the problem translated into the kernels' Params. Included by the .cu files of src/cuda.
#pragma once

#include <string>

#include "core/attention_problem.hpp"
#include "cuda/flash_common.cuh"

namespace mha::detail::gpu {

void require(bool ok, const std::string& message);

// The view's (b, h, l) strides, after checking that the GPU kernels can address it: unit stride
// along the head dim, 16-byte aligned rows (pointer and strides multiples of 8 elements).
void copy_strides(const TensorView& t, const char* name, long long* strides);

// bf16/fp16, equal head dims of 64, 128 or 256, no dropout, sizes the grid can index: an
// mha::Error naming the argument otherwise.
void check_supported(const AttentionProblem& p);

// q, k, v and their strides, the sizes, the scale, causality and the masks; the output, the
// log-sum-exp and the output's strides are the caller's to fill.
Params kernel_params(const AttentionProblem& p);

}  // namespace mha::detail::gpu
