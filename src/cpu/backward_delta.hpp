// delta = rowsum(dO * O), the backward's softmax correction term, one float per query row, in
// double from O and dO in their dtypes. Each product of two floats is exact in double, so the
// order of the sum barely matters to the float result; it is fixed all the same (element d into
// running sum d % 8, then a fixed tree): the same bits on every ISA and every path below. Eight
// sums make it a vector loop instead of one chain of dependent adds (that chain took 11% of a
// bf16 backward at L=128, B=32 H=12 d=64), and each ISA's file widens 16-bit rows with its own
// vectors (float16 element by element in portable code took 16% of a float16 backward there).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {

// delta[(b * Hq + h) * Lq + i] for every query row, over the threads.
void backward_delta_portable(const AttentionProblem& p, const BackwardInputs& in, float* delta);
void backward_delta_avx2(const AttentionProblem& p, const BackwardInputs& in, float* delta);
void backward_delta_avx512(const AttentionProblem& p, const BackwardInputs& in, float* delta);

// The one for `isa` (flash_backward_portable.cpp: out of line, baseline code; the kernel files
// include this header in their instruction set's region).
void backward_delta(Isa isa, const AttentionProblem& p, const BackwardInputs& in, float* delta);

namespace {  // (each including file compiles its own copy, for its instruction set)

// sum over d < n of g(d) * o(d) in double, element d into sum d % 8, then the fixed tree.
template <class Product>
float delta_sum(int64_t n, Product product) {
  double sums[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) sums[k] += product(d + k);
  for (int k = 0; d < n; ++d, ++k) sums[k] += product(d);
  return static_cast<float>(((sums[0] + sums[4]) + (sums[2] + sums[6])) + ((sums[1] + sums[5]) + (sums[3] + sums[7])));
}

constexpr bool widens_in_vectors(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// Rows [i0, i1) of head (b, h). Rows of unit stride in float32, bfloat16 or float16 are widened a
// row at a time with S's vectors (into `buffer`, 2 x Dv floats); others element by element.
// (`buffer` is the thread's scratch: no allocation per call.)
template <class S>
void backward_delta_rows(const AttentionProblem& p, const BackwardInputs& in, int64_t b, int64_t h, int64_t i0,
                         int64_t i1, float* delta, float* buffer) {
  const int64_t* gs = in.grad_out_strides;
  const int64_t* os = in.out_strides;
  const int64_t n = p.dim_v;
  float* const out_row = delta + (b * p.heads_q + h) * p.len_q;
  if (gs[3] == 1 && os[3] == 1 && widens_in_vectors(in.grad_out_dtype) && widens_in_vectors(in.out_dtype)) {
    auto row_of = [&](const void* base, DType dtype, int64_t offset, float* slot) -> const float* {
      if (dtype == DType::f32) return static_cast<const float*>(base) + offset;
      Tiles<S>::widen(dtype, element_address(base, dtype, offset), slot, n);
      return slot;
    };
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = row_of(in.grad_out, in.grad_out_dtype, b * gs[0] + h * gs[1] + i * gs[2], buffer);
      const float* o = row_of(in.out, in.out_dtype, b * os[0] + h * os[1] + i * os[2], buffer + n);
      out_row[i] = delta_sum(n, [&](int64_t d) { return static_cast<double>(g[d]) * o[d]; });
    }
    return;
  }
  with_input_elements(in.grad_out, in.grad_out_dtype, b * gs[0] + h * gs[1], [&](const auto* g, auto widen_g) {
    with_input_elements(in.out, in.out_dtype, b * os[0] + h * os[1], [&](const auto* o, auto widen_o) {
      for (int64_t i = i0; i < i1; ++i) {
        const auto* gr = g + i * gs[2];
        const auto* orow = o + i * os[2];
        out_row[i] = delta_sum(n, [&](int64_t d) {
          return static_cast<double>(widen_g(gr[d * gs[3]])) * widen_o(orow[d * os[3]]);
        });
      }
    });
  });
}

// Every row, in blocks of up to 512 rows of one head per task.
template <class S>
void backward_delta_all(const AttentionProblem& p, const BackwardInputs& in, float* delta) {
  constexpr int64_t kRowsPerTask = 512;
  const int64_t row_blocks = (p.len_q + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(p.batch * p.heads_q * row_blocks, resolve_threads(p.num_threads), [&](int64_t t, int) {
    float* buffer = static_cast<float*>(thread_scratch(sizeof(float) * static_cast<size_t>(2 * p.dim_v)));
    const int64_t bh = t / row_blocks, b = bh / p.heads_q, h = bh % p.heads_q;
    const int64_t i0 = t % row_blocks * kRowsPerTask, i1 = std::min(p.len_q, i0 + kRowsPerTask);
    backward_delta_rows<S>(p, in, b, h, i0, i1, delta, buffer);
  });
}

}  // namespace
}  // namespace mha::detail
