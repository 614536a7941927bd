#include "cpu/backward_rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "cpu/attention_kernel.hpp"

namespace mha::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // the kernels' constant (tile_kernels.hpp)
constexpr float kFloatMax = std::numeric_limits<float>::max();
// Below this |lse * log2 e| the lse keeps log2(l) to 2^-12 or better (P within 0.03%): such rows,
// nearly all, are left as they are.
constexpr float kLargeLse2 = 0x1p12f;

// A mask value as the kernels scale it (S::mul_saturated): finite values stay finite. Without
// branches or calls, for the loops above to vectorise.
inline float scaled_mask(float x) {
  const float y = x * kLog2e;
  const float clamped = y < -kFloatMax ? -kFloatMax : y > kFloatMax ? kFloatMax : y;
  return std::fabs(x) <= kFloatMax ? clamped : y;
}

// Euclidean norm of row (b, h, i) of a [B, H, L, D] view of any input dtype (within 2^-20 or so:
// it feeds a bound with a factor 2 to spare).
double row_norm(const TensorView& t, int64_t b, int64_t h, int64_t i, int64_t dim) {
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

  // Lanes of independent extrema that the compiler turns into vector instructions (key by key, a
  // row of 2048 keys took 4 us; half the rows of a left-padded batch are such rows).
  ContiguousRow(const float* x, int64_t end) {
    constexpr int kLanes = 8;
    const float none = -std::numeric_limits<float>::infinity();
    float tops[kLanes], bottoms[kLanes], smallests[kLanes];
    int32_t counts[kLanes];
    for (int l = 0; l < kLanes; ++l) tops[l] = none, bottoms[l] = smallests[l] = -none, counts[l] = 0;
    auto take = [&](int l, float v) {
      const float s = scaled_mask(v);
      const bool kept = s != none;
      tops[l] = s > tops[l] ? s : tops[l];
      bottoms[l] = kept && s < bottoms[l] ? s : bottoms[l];
      const float magnitude = std::fabs(s);
      smallests[l] = magnitude < smallests[l] ? magnitude : smallests[l];
      counts[l] += kept;
    };
    int64_t j = 0;
    for (; j + kLanes <= end; j += kLanes)
      for (int l = 0; l < kLanes; ++l) take(l, x[j + l]);
    for (int l = 0; j < end; ++j, ++l) take(l, x[j]);
    for (int l = 1; l < kLanes; ++l) {
      tops[0] = std::max(tops[0], tops[l]), bottoms[0] = std::min(bottoms[0], bottoms[l]);
      smallests[0] = std::min(smallests[0], smallests[l]), counts[0] += counts[l];
    }
    top = tops[0], bottom = bottoms[0], smallest = smallests[0], sum = counts[0];
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
    return top != -std::numeric_limits<float>::infinity() && qk_bound * 0x1p25 <= smallest;
  }
};

// One row of a head whose scores may all be mask values, any mask terms, key by key.
struct RowScores {
  const AttentionProblem& p;
  int64_t b, h, i;
  double qk_bound;  // |q.k| * scale * log2(e) of the kernels is at most this, for every key

  // The kernels' score of key j when the mask terms swallow q.k (the kernels' sum then depends on
  // the terms alone, and this one adds them in the kernels' order); false where that is not sure.
  // -inf for a key a term excludes.
  bool score(int64_t j, float& s) const {
    float a = 0;                        // the sum so far without q.k
    double unknown = qk_bound;          // bound on how far the kernels' sum may be from it
    bool exact = qk_bound == 0;         // q = 0: the kernels' q.k is 0 too
    for (int t = 0; t < p.num_masks; ++t) {
      const float x = scaled_mask(p.masks[t].bias(b, h, i, j));
      if (x == 0) continue;
      if (x == -std::numeric_limits<float>::infinity()) return s = x, true;  // excluded whatever q.k is
      if (!std::isfinite(x)) return false;
      if (exact) {
        a += x;
      } else if ((std::fabs(a) + unknown) * 0x1p25 <= std::fabs(x)) {
        a = x, exact = true;  // both sums lie within half a unit in the last place of x
      } else {
        a += x;
        unknown += (std::fabs(a) + unknown) * 0x1p-23;  // each sum's rounding
      }
    }
    s = a;
    return exact;
  }

  // The row's largest score and its softmax denominator l = sum 2^(s - max), if every visible
  // key's score is exact; false otherwise (or with no visible key). One pass, the sum rescaled
  // when the maximum grows.
  bool max_and_sum(float& max, double& sum) const {
    const float none = -std::numeric_limits<float>::infinity();
    max = none, sum = 0;
    for (int64_t j = 0, end = p.causal_end(i); j < end; ++j) {
      float s;
      if (!score(j, s)) return false;
      if (s == max) sum += 1;  // (the usual case: a padded row's keys share one value)
      else if (s > max) sum = sum * std::exp2(static_cast<double>(max) - s) + 1, max = s;
      else if (s != none) sum += std::exp2(static_cast<double>(s) - max);
    }
    return max != none;
  }
};

}  // namespace

void backward_row_normalisers(const AttentionProblem& p, const float* lse, int64_t b, int64_t i0, int64_t i1,
                              float* lse2, float* scale) {
  const MaskTerm& term = p.masks[0];
  const bool contiguous = p.num_masks == 1 && term.kind == MaskKind::additive && term.strides[3] == 1;
  std::vector<double> key_norms(p.heads_kv, -1.0);  // the largest key norm of each head, once a row needs it
  std::optional<ContiguousRow> shared;              // a mask row the heads share
  for (int64_t i = i0; i < i1; ++i) {
    shared.reset();
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t r = (b * p.heads_q + h) * p.len_q + i;
      const float x = lse[r] * kLog2e;  // the bits the kernels always used
      lse2[r] = x, scale[r] = 1.0f;
      if (!(std::fabs(x) >= kLargeLse2) || std::isinf(lse[r]) || p.num_masks == 0) continue;
      if (std::isinf(x)) lse2[r] = std::copysign(kFloatMax, x);  // a finite lse past FLT_MAX / log2(e)
      const int64_t hk = h / (p.heads_q / p.heads_kv);
      double& key_norm = key_norms[hk];
      if (key_norm < 0) {
        key_norm = 0;
        for (int64_t j = 0; j < p.len_k; ++j) key_norm = std::max(key_norm, row_norm(p.k, b, hk, j, p.dim_qk));
      }
      // |q.k| <= |q| |k|; twice that covers the kernels' float32 rounding of the dot product.
      const double bound = 2 * row_norm(p.q, b, h, i, p.dim_qk) * key_norm * std::fabs(p.scale) * kLog2e;
      if (!std::isfinite(bound)) continue;
      if (contiguous) {
        const float* row = static_cast<const float*>(term.data) + b * term.strides[0] + h * term.strides[1] +
                           i * term.strides[2];
        std::optional<ContiguousRow> own;
        std::optional<ContiguousRow>& values = term.strides[1] == 0 ? shared : own;
        if (!values) values.emplace(row, p.causal_end(i));
        if (values->exact_for(bound)) lse2[r] = values->top, scale[r] = static_cast<float>(1.0 / values->sum);
      } else {
        float max;
        double sum;
        if (RowScores{p, b, h, i, bound}.max_and_sum(max, sum)) lse2[r] = max, scale[r] = static_cast<float>(1.0 / sum);
      }
    }
  }
}

}  // namespace mha::detail
