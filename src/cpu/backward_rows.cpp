#include "cpu/backward_rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/attention_kernel.hpp"

namespace mha::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // the kernels' constant (tile_kernels.hpp)
constexpr float kFloatMax = std::numeric_limits<float>::max();
// Below this |lse * log2 e| the lse keeps log2(l) to 2^-12 or better (P within 0.03%): such rows,
// nearly all, are left as they are.
constexpr float kLargeLse2 = 0x1p12f;

// A mask value as the kernels scale it (S::mul_saturated): finite values stay finite.
float scaled_mask(float x) {
  const float y = x * kLog2e;
  return std::isfinite(x) ? std::clamp(y, -kFloatMax, kFloatMax) : y;
}

// Euclidean norm of row (b, h, i) of a [B, H, L, D] view of any input dtype, in double.
double row_norm(const TensorView& t, int64_t b, int64_t h, int64_t i, int64_t dim) {
  double sum = 0;
  with_input_elements(t.data, t.dtype, b * t.strides[0] + h * t.strides[1] + i * t.strides[2],
                      [&](const auto* x, auto widen) {
                        for (int64_t d = 0; d < dim; ++d) {
                          const double v = widen(x[d * t.strides[3]]);
                          sum += v * v;
                        }
                      });
  return std::sqrt(sum);
}

// One row of a head whose scores may all be mask values.
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

void backward_row_normalisers(const AttentionProblem& p, const float* lse, int64_t b, int64_t h, int64_t i0,
                              int64_t i1, float* lse2, float* scale) {
  const int64_t hk = h / (p.heads_q / p.heads_kv);
  double key_norm = -1;  // the largest key norm of head (b, hk), once a row needs it
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = (b * p.heads_q + h) * p.len_q + i;
    const float x = lse[r] * kLog2e;  // the bits the kernels always used
    lse2[r] = x, scale[r] = 1.0f;
    if (!(std::fabs(x) >= kLargeLse2) || std::isinf(lse[r]) || p.num_masks == 0) continue;
    if (std::isinf(x)) lse2[r] = std::copysign(kFloatMax, x);  // a finite lse past FLT_MAX / log2(e)
    if (key_norm < 0) {
      key_norm = 0;
      for (int64_t j = 0; j < p.len_k; ++j) key_norm = std::max(key_norm, row_norm(p.k, b, hk, j, p.dim_qk));
    }
    // |q.k| <= |q| |k|; twice that covers the kernels' float32 rounding of the dot product.
    const double bound = 2 * row_norm(p.q, b, h, i, p.dim_qk) * key_norm * std::fabs(p.scale) * kLog2e;
    const RowScores row{p, b, h, i, bound};
    float max;
    double sum;
    if (std::isfinite(bound) && row.max_and_sum(max, sum)) lse2[r] = max, scale[r] = static_cast<float>(1.0 / sum);
  }
}

}  // namespace mha::detail
