#include "cpu/backward_rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "cpu/attention_kernel.hpp"
#include "cpu/mask_scores.hpp"

namespace mha::detail {
namespace {

constexpr float kLog2e = kMaskLog2e;
constexpr float kFloatMax = kMaskFloatMax;
// Below this |lse * log2 e| the lse keeps log2(l) to 2^-12 or better (P within 0.03%): such rows,
// nearly all, are left as they are.
constexpr float kLargeLse2 = 0x1p12f;

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
    for (int64_t j = p.window_begin(i), end = p.causal_end(i); j < end; ++j) {
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
  const bool contiguous = one_contiguous_term(p);
  LargestKeyNorms key_norms{p, b};
  std::optional<ContiguousRow> shared;  // a mask row the heads share
  for (int64_t i = i0; i < i1; ++i) {
    shared.reset();
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t r = (b * p.heads_q + h) * p.len_q + i;
      const float x = lse[r] * kLog2e;  // the bits the kernels always used
      lse2[r] = x, scale[r] = 1.0f;
      if (!(std::fabs(x) >= kLargeLse2) || std::isinf(lse[r]) || p.num_masks == 0) continue;
      if (std::isinf(x)) lse2[r] = std::copysign(kFloatMax, x);  // a finite lse past FLT_MAX / log2(e)
      const double bound = qk_bound(p, b, h, i, key_norms(h / (p.heads_q / p.heads_kv)));
      if (!std::isfinite(bound)) continue;
      if (contiguous) {
        std::optional<ContiguousRow> own;
        std::optional<ContiguousRow>& values = term.strides[1] == 0 ? shared : own;
        if (!values) values.emplace(mask_row(term, b, h, i), p.causal_end(i));
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
