// A projection of a few rows against a bfloat16/float16 weight, read as it is: y[r, j] +=
// sum_k x[r, k] w[j, k]. A bfloat16 module's decoding step would otherwise widen every weight to
// float32 first (8 MiB read and 16 MiB written at E = 1024) before one pass over the copy; this
// reads the 16-bit weight once, which is the whole cost of a few rows.
#pragma once

#include <cstdint>

#include "cpu/dispatch.hpp"
#include "mha/dtype.hpp"

namespace mha::detail {

constexpr int kLowPrecisionGemvMaxRows = 4;

struct LowPrecisionGemv {
  int rows = 0;                                    // <= kLowPrecisionGemvMaxRows
  const float* x[kLowPrecisionGemvMaxRows] = {};   // each row: k floats, unit stride
  float* y[kLowPrecisionGemvMaxRows] = {};         // each row: the outputs, unit stride
  const uint16_t* w = nullptr;                     // [n, k] bits, unit stride along k
  int64_t w_row_stride = 0;
  DType w_dtype = DType::bf16;                     // bf16 or f16
  int64_t k = 0;
};

// Columns [j0, j1) of every row, each a sum over k in a fixed order (the same result whatever
// the split of columns among threads).
void low_precision_gemv(Isa isa, const LowPrecisionGemv& g, int64_t j0, int64_t j1);

void low_precision_gemv_portable(const LowPrecisionGemv& g, int64_t j0, int64_t j1);
void low_precision_gemv_avx2(const LowPrecisionGemv& g, int64_t j0, int64_t j1);
void low_precision_gemv_avx512(const LowPrecisionGemv& g, int64_t j0, int64_t j1);

// The body each ISA's file instantiates with its SIMD layer: one weight row at a time, widened
// S::kLanes values at a time, against every x row; the lanes are summed in a fixed order.
template <class S>
void low_precision_gemv_of(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  constexpr int kLanes = S::kLanes;
  alignas(64) float wide[kLanes];
  alignas(64) float lanes[kLanes];
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* w = g.w + j * g.w_row_stride;
    typename S::F acc[kLowPrecisionGemvMaxRows];
    for (int r = 0; r < g.rows; ++r) acc[r] = S::zero();
    int64_t i = 0;
    for (; i + kLanes <= g.k; i += kLanes) {
      if (g.w_dtype == DType::bf16) S::widen_bf16(w + i, wide, kLanes);
      else S::widen_f16(w + i, wide, kLanes);
      const typename S::F wv = S::load(wide);
      for (int r = 0; r < g.rows; ++r) acc[r] = S::fmadd(S::load(g.x[r] + i), wv, acc[r]);
    }
    const int64_t tail = g.k - i;
    if (tail > 0) {
      if (g.w_dtype == DType::bf16) S::widen_bf16(w + i, wide, tail);
      else S::widen_f16(w + i, wide, tail);
    }
    for (int r = 0; r < g.rows; ++r) {
      S::store(lanes, acc[r]);
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      for (int64_t t = 0; t < tail; ++t) sum += g.x[r][i + t] * wide[t];
      g.y[r][j] += sum;
    }
  }
}

}  // namespace mha::detail
