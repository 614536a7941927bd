// When a row's scores are its mask values alone. The kernels add the mask, scaled by log2(e), to
// q.k scaled likewise, in float32; a mask value of magnitude 2^25 |q.k| or more swallows q.k
// (q.k lies under half a unit in its last place), and a row whose every visible key has such a
// value (Hugging Face's padded query rows at finfo.min, -3.4e38) has scores, weights and output
// that do not depend on q: the backward (backward_rows.hpp) and the forward (mask_only_rows.hpp)
// take them from the mask. |q.k| is bounded by |q| max|k|.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/attention_problem.hpp"
#include "cpu/attention_kernel.hpp"

namespace mha::detail {

constexpr float kMaskLog2e = 1.4426950408889634f;  // the kernels' constant (tile_kernels.hpp)
constexpr float kMaskFloatMax = std::numeric_limits<float>::max();

// A mask value as the kernels scale it (S::mul_saturated): finite values stay finite. Without
// branches or calls, for the loops below to vectorise.
inline float scaled_mask(float x) {
  const float y = x * kMaskLog2e;
  const float clamped = y < -kMaskFloatMax ? -kMaskFloatMax : y > kMaskFloatMax ? kMaskFloatMax : y;
  return std::fabs(x) <= kMaskFloatMax ? clamped : y;
}

// Euclidean norm of row (b, h, i) of a [B, H, L, D] view of any input dtype (within 2^-20 or so:
// it feeds a bound with a factor 2 to spare).
inline double row_norm(const TensorView& t, int64_t b, int64_t h, int64_t i, int64_t dim) {
  constexpr int kLanes = 8;  // independent sums, for vector instructions
  float sums[kLanes] = {};
  with_input_elements(t.data, t.dtype, b * t.strides[0] + h * t.strides[1] + i * t.strides[2],
                      [&](const auto* x, auto widen) {
                        const int64_t step = t.strides[3];
                        int64_t d = 0;
                        for (; d + kLanes <= dim; d += kLanes)
                          for (int l = 0; l < kLanes; ++l) {
                            const float v = widen(x[(d + l) * step]);
                            sums[l] += v * v;
                          }
                        for (int l = 0; d < dim; ++d, ++l) {
                          const float v = widen(x[d * step]);
                          sums[l] += v * v;
                        }
                      });
  double sum = 0;
  for (const float part : sums) sum += part;
  return std::sqrt(sum);
}

// The scaled values of one additive term along a contiguous row of keys [0, end), the usual mask:
// over the keys it does not exclude, the largest and smallest value, the smallest magnitude, and
// l = sum 2^(value - largest). They do not depend on q, so heads that share the mask row share them.
struct ContiguousRow {
  float top, bottom, smallest;
  double sum;
  bool nan;  // a NaN value (which the extrema do not see)

  // Lanes of independent extrema that the compiler turns into vector instructions (key by key, a
  // row of 2048 keys took 4 us; half the rows of a left-padded batch are such rows).
  ContiguousRow(const float* x, int64_t end) {
    constexpr int kLanes = 8;
    const float none = -std::numeric_limits<float>::infinity();
    float tops[kLanes], bottoms[kLanes], smallests[kLanes];
    int32_t counts[kLanes], nans[kLanes];
    for (int l = 0; l < kLanes; ++l) tops[l] = none, bottoms[l] = smallests[l] = -none, counts[l] = nans[l] = 0;
    auto take = [&](int l, float v) {
      const float s = scaled_mask(v);
      const bool kept = s != none;
      tops[l] = s > tops[l] ? s : tops[l];
      bottoms[l] = kept && s < bottoms[l] ? s : bottoms[l];
      const float magnitude = std::fabs(s);
      smallests[l] = magnitude < smallests[l] ? magnitude : smallests[l];
      counts[l] += kept;
      nans[l] |= s != s;
    };
    int64_t j = 0;
    for (; j + kLanes <= end; j += kLanes)
      for (int l = 0; l < kLanes; ++l) take(l, x[j + l]);
    for (int l = 0; j < end; ++j, ++l) take(l, x[j]);
    for (int l = 1; l < kLanes; ++l) {
      tops[0] = std::max(tops[0], tops[l]), bottoms[0] = std::min(bottoms[0], bottoms[l]);
      smallests[0] = std::min(smallests[0], smallests[l]), counts[0] += counts[l], nans[0] |= nans[l];
    }
    top = tops[0], bottom = bottoms[0], smallest = smallests[0], sum = counts[0], nan = nans[0] != 0;
    if (top == none || bottom == top) return;  // (a padded row: every key at one value)
    sum = 0;
    for (j = 0; j < end; ++j) {
      const float s = scaled_mask(x[j]);
      if (s != none) sum += std::exp2(static_cast<double>(s) - top);
    }
  }

  // Whether these are the kernels' scores for a q.k of at most `qk_bound` in magnitude: the
  // smallest value swallows it (|x| >= 2^25 |q.k| puts q.k under half a unit in its last place).
  bool exact_for(double qk_bound) const {
    return !nan && top != -std::numeric_limits<float>::infinity() && qk_bound * 0x1p25 <= smallest;
  }
};

// Whether the problem's mask is one additive term along contiguous keys, which ContiguousRow reads.
inline bool one_contiguous_term(const AttentionProblem& p) {
  const MaskTerm& t = p.masks[0];
  return p.num_masks == 1 && t.kind == MaskKind::additive && t.strides[3] == 1;
}

// Row (b, h, i) of an additive term.
inline const float* mask_row(const MaskTerm& t, int64_t b, int64_t h, int64_t i) {
  return static_cast<const float*>(t.data) + b * t.strides[0] + h * t.strides[1] + i * t.strides[2];
}

// The largest norm of the keys of each key/value head of batch entry b, computed when first asked.
struct LargestKeyNorms {
  const AttentionProblem& p;
  int64_t b;
  std::vector<double> norms = std::vector<double>(static_cast<size_t>(p.heads_kv), -1.0);

  double operator()(int64_t hk) {
    double& norm = norms[static_cast<size_t>(hk)];
    if (norm < 0) {
      norm = 0;
      for (int64_t j = 0; j < p.len_k; ++j) norm = std::max(norm, row_norm(p.k, b, hk, j, p.dim_qk));
    }
    return norm;
  }
};

// A bound on |q.k| * scale * log2(e) as the kernels compute it for query (b, h, i), given the
// largest key norm of its head: |q| max|k|, twice over for the kernels' float32 rounding.
inline double qk_bound(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, double key_norm) {
  return 2 * row_norm(p.q, b, h, i, p.dim_qk) * key_norm * std::fabs(p.scale) * p.key_descale(b, h / p.group()) *
         kMaskLog2e;
}

}  // namespace mha::detail
