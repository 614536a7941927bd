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

// The body each ISA's file instantiates with its SIMD layer: one weight row at a time (it stays
// in L1 for the other x rows), widened S::kLanes values at a time in registers, into two
// accumulators so that two FMA chains overlap; the lanes are summed in a fixed order.
template <class S, bool kBf16>
void low_precision_gemv_rows(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  constexpr int kLanes = S::kLanes;
  auto load_w = [](const uint16_t* p) { return kBf16 ? S::load_bf16(p) : S::load_f16(p); };
  alignas(64) float tail_w[kLanes];
  alignas(64) float lanes[kLanes];
  const int64_t tail = g.k % kLanes, body = g.k - tail;
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* w = g.w + j * g.w_row_stride;
    if (tail > 0) {
      if (kBf16) S::widen_bf16(w + body, tail_w, tail);
      else S::widen_f16(w + body, tail_w, tail);
    }
    for (int r = 0; r < g.rows; ++r) {
      const float* x = g.x[r];
      typename S::F a0 = S::zero(), a1 = S::zero();
      int64_t i = 0;
      for (; i + 2 * kLanes <= body; i += 2 * kLanes) {
        a0 = S::fmadd(S::load(x + i), load_w(w + i), a0);
        a1 = S::fmadd(S::load(x + i + kLanes), load_w(w + i + kLanes), a1);
      }
      if (i < body) a0 = S::fmadd(S::load(x + i), load_w(w + i), a0);
      S::store(lanes, S::add(a0, a1));
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      for (int64_t t = 0; t < tail; ++t) sum += x[body + t] * tail_w[t];
      g.y[r][j] += sum;
    }
  }
}

template <class S>
void low_precision_gemv_of(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  if (g.w_dtype == DType::bf16) low_precision_gemv_rows<S, true>(g, j0, j1);
  else low_precision_gemv_rows<S, false>(g, j0, j1);
}

}  // namespace mha::detail
