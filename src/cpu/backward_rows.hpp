// How the backward recomputes each row's probabilities: P = 2^(s - lse2) * scale, s the base-2
// score (q.k scaled by scale * log2 e, plus each mask term times log2 e, in float32 as the kernels
// add them), lse2 and scale per row from the forward's natural log-sum-exp.
//
// Usually lse2 = lse * log2(e) and scale = 1. A float32 lse cannot hold log2(l) next to a huge
// row maximum m: at m = -2^127 (Hugging Face's finfo.min masks) one unit in the last place is
// 2^104, and a padded query row, whose every score rounds to its mask value, would get P = 1 on
// each of its l keys instead of 1/l. Where each score of a row is its mask value exactly (the
// mask swallows q.k, as a bound on |q.k| proves), the row's softmax needs no q.k at all: lse2 is
// then m, the largest mask value, and scale 1/l, with l = sum 2^(s - m) over the visible keys.
#pragma once

#include <cstdint>

#include "core/attention_problem.hpp"

namespace mha::detail {

// Rows [i0, i1) of batch entry b, every head: lse2 and scale of row r = (b * Hq + h) * Lq + i,
// from lse[r]. (Heads whose mask row is one share its reading.)
void backward_row_normalisers(const AttentionProblem& p, const float* lse, int64_t b, int64_t i0, int64_t i1,
                              float* lse2, float* scale);

}  // namespace mha::detail
