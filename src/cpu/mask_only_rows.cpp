#include "cpu/mask_only_rows.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/thread_pool.hpp"
#include "cpu/mask_scores.hpp"

namespace mha::detail {
namespace {

constexpr float kLn2 = 0.6931471805599453f;

// Rows [0, prefix) of head (b, h): each output row the mask's weighted mean of the values,
// rounded to the output's dtype, and its log-sum-exp as the kernels write it. A row that reads
// the same mask values as the row before it copies that row's output.
void write_mask_only_rows(const AttentionProblem& p, const ForwardOutputs& o, int64_t b, int64_t h, int64_t prefix) {
  const MaskTerm& t = p.masks[0];
  const int64_t hk = h / (p.heads_q / p.heads_kv);
  std::vector<double> acc(static_cast<size_t>(p.dim_v));
  const double descale = p.value_descale(b, hk);
  const float* previous = nullptr;
  int64_t previous_end = -1;
  float lse = 0;
  for (int64_t i = 0; i < prefix; ++i) {
    const float* row = mask_row(t, b, h, i);
    const int64_t end = p.causal_end(i);
    const bool same = previous != nullptr && end == previous_end &&
                      std::memcmp(row, previous, sizeof(float) * static_cast<size_t>(end)) == 0;
    if (!same) {
      const ContiguousRow values(row, end);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < end; ++j) {
        const float s = scaled_mask(row[j]);
        if (s == -std::numeric_limits<float>::infinity()) continue;
        const double w = std::exp2(static_cast<double>(s) - values.top) / values.sum;
        if (w == 0) continue;
        const TensorView& v = p.v;
        with_input_elements(v.data, v.dtype, b * v.strides[0] + hk * v.strides[1] + j * v.strides[2],
                            [&](const auto* x, auto widen) {
                              for (int64_t d = 0; d < p.dim_v; ++d) acc[d] += w * widen(x[d * v.strides[3]]);
                            });
      }
      lse = (values.top + std::log2(static_cast<float>(values.sum))) * kLn2;
    }
    with_output_elements(o.out, o.out_dtype, b * o.out_strides[0] + h * o.out_strides[1] + i * o.out_strides[2],
                         [&](auto* dst, auto round) {
                           for (int64_t d = 0; d < p.dim_v; ++d)
                             dst[d * o.out_strides[3]] = round(static_cast<float>(acc[d] * descale));
                         });
    if (o.lse != nullptr) o.lse[(b * p.heads_q + h) * p.len_q + i] = lse;
    previous = row, previous_end = end;
  }
}

// How many leading rows of batch entry b have scores that are their mask values in every head.
int64_t mask_only_prefix(const AttentionProblem& p, int64_t b) {
  const MaskTerm& t = p.masks[0];
  LargestKeyNorms key_norms{p, b};
  for (int64_t i = 0; i < p.len_q; ++i) {
    std::optional<ContiguousRow> shared;  // a mask row the heads share
    for (int64_t h = 0; h < p.heads_q; ++h) {
      std::optional<ContiguousRow> own;
      std::optional<ContiguousRow>& values = t.strides[1] == 0 ? shared : own;
      if (!values) values.emplace(mask_row(t, b, h, i), p.causal_end(i));
      // (an ordinary row has values of 0 or near it: no bound is needed to turn it down)
      if (values->nan || values->top == -std::numeric_limits<float>::infinity() || !(values->smallest > 0x1p25f)) return i;
      if (!values->exact_for(qk_bound(p, b, h, i, key_norms(h / (p.heads_q / p.heads_kv))))) return i;
    }
  }
  return p.len_q;
}

}  // namespace

std::vector<int64_t> mask_only_prefixes(const AttentionProblem& p, const ForwardOutputs& o) {
  if (!one_contiguous_term(p) || p.dropout_p > 0 || o.weights != nullptr || o.average_weights != nullptr || !skips_excluded_blocks().load()) {
    return {};
  }
  std::vector<int64_t> prefixes(static_cast<size_t>(p.batch));
  parallel_for(p.batch, resolve_threads(p.num_threads), [&](int64_t b, int) { prefixes[b] = mask_only_prefix(p, b); });
  if (std::all_of(prefixes.begin(), prefixes.end(), [](int64_t n) { return n == 0; })) return {};
  return prefixes;
}

void run_with_mask_only_prefixes(const AttentionProblem& p, const ForwardOutputs& o,
                                 const std::vector<int64_t>& prefixes, ForwardKernel kernel) {
  parallel_for(p.batch * p.heads_q, resolve_threads(p.num_threads), [&](int64_t task, int) {
    const int64_t b = task / p.heads_q, h = task % p.heads_q;
    if (prefixes[b] > 0) write_mask_only_rows(p, o, b, h, prefixes[b]);
  });
  // The other rows, one batch entry at a time: the problem of rows [first, Lq) of entry b.
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t first = prefixes[b], rows = p.len_q - first;
    if (rows == 0) continue;
    AttentionProblem s = p;
    s.batch = 1;
    s.len_q = rows;
    s.q = p.q.slice(0, b, b + 1).slice(2, first, p.len_q);
    s.k = p.k.slice(0, b, b + 1);
    s.v = p.v.slice(0, b, b + 1);
    s.masks[0].data = mask_row(p.masks[0], b, 0, first);
    if (s.k_descales) s.k_descales += b * p.heads_kv;  // (entry b's scales are the sub-problem's entry 0)
    if (s.v_descales) s.v_descales += b * p.heads_kv;
    s.causal_offset = p.causal_offset + first;
    ForwardOutputs so = o;
    so.out = static_cast<char*>(o.out) +
             (b * o.out_strides[0] + first * o.out_strides[2]) * dtype_size(o.out_dtype);
    std::vector<float> lse(o.lse != nullptr ? static_cast<size_t>(p.heads_q * rows) : 0);
    so.lse = o.lse != nullptr ? lse.data() : nullptr;
    kernel(s, so);
    for (int64_t h = 0; o.lse != nullptr && h < p.heads_q; ++h)
      std::copy_n(lse.data() + h * rows, rows, o.lse + (b * p.heads_q + h) * p.len_q + first);
  }
}

}  // namespace mha::detail
