// A projection of a few rows, y[r, j] += sum_k x[r, k] w[j, k], against a bfloat16 or float16
// weight read as it is. A bfloat16 module would otherwise widen every weight to float32 for
// sgemm (8 MiB read and 16 MiB written at E = 1024), which at a few rows costs more than the
// products; this reads the 16-bit weight once, widening it in registers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/dispatch.hpp"
#include "mha/dtype.hpp"

namespace mha::detail {

struct FewRowsGemm {
  int64_t rows = 0;
  const float* const* x = nullptr;  // rows pointers, each k floats of unit stride
  float* const* y = nullptr;        // rows pointers, each the outputs, unit stride
  const uint16_t* w = nullptr;      // [n, k] bits, unit stride along k
  int64_t w_row_stride = 0;         // in elements
  DType w_dtype = DType::bf16;      // bf16 or f16
  int64_t k = 0;
};

// Columns [j0, j1) of every row, each a sum over k in an order fixed by k and the row count (the
// same result whatever the split of columns among threads).
void few_rows_gemm(Isa isa, const FewRowsGemm& g, int64_t j0, int64_t j1);

void few_rows_gemm_portable(const FewRowsGemm& g, int64_t j0, int64_t j1);
void few_rows_gemm_avx2(const FewRowsGemm& g, int64_t j0, int64_t j1);
void few_rows_gemm_avx512(const FewRowsGemm& g, int64_t j0, int64_t j1);

// The body each ISA's file instantiates with its SIMD layer, for bfloat16 or float16 weights.
template <class S, bool kBf16>
struct FewRowsKernel {
  static constexpr int kLanes = S::kLanes;
  using F = typename S::F;

  static F load_w(const uint16_t* p) { return kBf16 ? S::load_bf16(p) : S::load_f16(p); }
  static void widen_tail(const uint16_t* p, float* dst, int64_t n) {
    if (kBf16) S::widen_bf16(p, dst, n);
    else S::widen_f16(p, dst, n);
  }

  // Rows r0 .. r0 + R against weight rows [j0, j1). Each row's products go into kChains
  // accumulators taken in turn, 16 values of k at a time: two chains where one or two rows could
  // not keep the FMA units busy, one for three and four. The lanes and the tail are then summed
  // in a fixed order.
  template <int R>
  static void group(const FewRowsGemm& g, int64_t r0, int64_t j0, int64_t j1) {
    constexpr int kChains = R <= 2 ? 2 : 1;
    alignas(64) float tail_w[kLanes];
    alignas(64) float lanes[kLanes];
    const int64_t tail = g.k % kLanes, body = g.k - tail;
    const float* x[R];
    for (int r = 0; r < R; ++r) x[r] = g.x[r0 + r];
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* w = g.w + j * g.w_row_stride;
      if (tail > 0) widen_tail(w + body, tail_w, tail);
      F acc[R][kChains];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kChains; ++c) acc[r][c] = S::zero();
      int64_t i = 0;
      for (; i + kChains * kLanes <= body; i += kChains * kLanes) {
        for (int c = 0; c < kChains; ++c) {
          const F wv = load_w(w + i + c * kLanes);
          for (int r = 0; r < R; ++r) acc[r][c] = S::fmadd(S::load(x[r] + i + c * kLanes), wv, acc[r][c]);
        }
      }
      if (i < body) {  // (two chains only: one vector of k left)
        const F wv = load_w(w + i);
        for (int r = 0; r < R; ++r) acc[r][0] = S::fmadd(S::load(x[r] + i), wv, acc[r][0]);
      }
      for (int r = 0; r < R; ++r) {
        F a = acc[r][0];
        if constexpr (kChains == 2) a = S::add(a, acc[r][1]);
        S::store(lanes, a);
        float sum = 0.0f;
        for (int l = 0; l < kLanes; ++l) sum += lanes[l];
        for (int64_t t = 0; t < tail; ++t) sum += x[r][body + t] * tail_w[t];
        g.y[r0 + r][j] += sum;
      }
    }
  }

  // Weight rows a block at a time (64 rows of k = 1024: 128 KiB of bfloat16, kept in L2), and
  // within a block the x rows four at a time (16 KiB at k = 1024, kept in L1).
  static void run(const FewRowsGemm& g, int64_t j0, int64_t j1) {
    constexpr int64_t kWeightRowsPerBlock = 64;
    for (int64_t jb = j0; jb < j1; jb += kWeightRowsPerBlock) {
      const int64_t je = std::min(j1, jb + kWeightRowsPerBlock);
      for (int64_t r0 = 0; r0 < g.rows; r0 += 4) {
        switch (std::min<int64_t>(4, g.rows - r0)) {
          case 1: group<1>(g, r0, jb, je); break;
          case 2: group<2>(g, r0, jb, je); break;
          case 3: group<3>(g, r0, jb, je); break;
          default: group<4>(g, r0, jb, je); break;
        }
      }
    }
  }
};

template <class S>
void few_rows_gemm_of(const FewRowsGemm& g, int64_t j0, int64_t j1) {
  if (g.w_dtype == DType::bf16) FewRowsKernel<S, true>::run(g, j0, j1);
  else FewRowsKernel<S, false>::run(g, j0, j1);
}

}  // namespace mha::detail
