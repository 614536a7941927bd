// Attention over a paged key/value cache: each sequence is one scaled_dot_product_attention
// problem whose keys and values the decoding kernel and the bfloat16 pair-product tile kernel
// read page by page where they lie (AttentionProblem::key_pages), or, on the paths that read rows
// at one stride, from a gathered copy; the sequences are spread over the threads as
// variable-length batches spread theirs.
#include "mha/paged_attention.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/sdpa_host.hpp"
#include "core/sequence_schedule.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/amx.hpp"

namespace mha {
namespace {

using detail::AttentionProblem;

struct PagedShape {
  int64_t batch = 0, heads_q = 0, len_q = 0, dim_qk = 0, heads_kv = 0, dim_v = 0;
  int64_t pages = 0, page_size = 0, pages_per_sequence = 0;
};

void check_rank4(const TensorView& t, const char* name, const char* layout) {
  if (t.ndim != 4) {
    throw Error(std::string(name) + ": expected a " + layout + " tensor (rank 4), got shape " + t.shape_str());
  }
  require_cpu(t, name);
}

// The pages of the caches a sequence of `len` keys reads: ceil(len / page_size).
int64_t pages_used(int64_t len, int64_t page_size) { return len == 0 ? 0 : (len - 1) / page_size + 1; }

// Checks the table and the lengths: every sequence's keys fit its row of the table and every page
// it reads exists. `what` names the positions ("keys", or the rows a write reaches).
void check_table(const PagedShape& s, std::span<const int32_t> table, std::span<const int64_t> lens,
                 std::span<const int64_t> extra, const char* what) {
  // The positions a sequence's table row holds (saturating: a page size may be a placeholder's).
  int64_t capacity;
  if (__builtin_mul_overflow(s.pages_per_sequence, s.page_size, &capacity)) capacity = INT64_MAX;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t len = lens[b];
    if (len < 0) {
      throw Error("cache_seqlens: expected lengths >= 0, got cache_seqlens[" + std::to_string(b) +
                  "] = " + std::to_string(len));
    }
    int64_t end;
    if (__builtin_add_overflow(len, extra.empty() ? 0 : extra[b], &end)) end = INT64_MAX;
    if (end > capacity) {
      throw Error("cache_seqlens: sequence " + std::to_string(b) + " " + what + " up to position " +
                  std::to_string(end) + ", more than its " + std::to_string(s.pages_per_sequence) +
                  " table entries of " + std::to_string(s.page_size) + " rows hold");
    }
    for (int64_t i = 0; i < pages_used(end, s.page_size); ++i) {
      const int32_t page = table[b * s.pages_per_sequence + i];
      if (page < 0 || page >= s.pages) {
        throw Error("block_table: expected page indices in [0, " + std::to_string(s.pages) + "), got block_table[" +
                    std::to_string(b) + "][" + std::to_string(i) + "] = " + std::to_string(page) + " (sequence " +
                    std::to_string(b) + " " + what + " up to position " + std::to_string(end) + ")");
      }
    }
  }
}

// What both functions check of the caches, the table and the lengths, for `batch` sequences.
PagedShape check_cache(const TensorView& key_cache, const TensorView& value_cache, std::span<const int32_t> table,
                       std::span<const int64_t> lens, int64_t batch) {
  check_rank4(key_cache, "key_cache", "[pages, Hkv, page_size, Dk]");
  check_rank4(value_cache, "value_cache", "[pages, Hkv, page_size, Dv]");
  for (int d = 0; d < 3; ++d) {
    if (key_cache.shape[d] != value_cache.shape[d]) {
      throw Error("key_cache/value_cache: expected the same [pages, Hkv, page_size], got key_cache " +
                  key_cache.shape_str() + " and value_cache " + value_cache.shape_str());
    }
  }
  if (key_cache.dtype != value_cache.dtype) {
    throw Error(std::string("value_cache: expected the key cache's dtype ") + std::string(dtype_name(key_cache.dtype)) +
                ", got " + std::string(dtype_name(value_cache.dtype)));
  }
  for (const TensorView* t : {&key_cache, &value_cache}) {
    if (t->shape[3] > 1 && t->strides[3] != 1) {
      throw Error(std::string(t == &key_cache ? "key_cache" : "value_cache") +
                  ": expected unit stride in the last dimension (rows read in place), got strides [" +
                  std::to_string(t->strides[0]) + ", " + std::to_string(t->strides[1]) + ", " +
                  std::to_string(t->strides[2]) + ", " + std::to_string(t->strides[3]) + "]");
    }
  }
  PagedShape s;
  s.batch = batch;
  s.pages = key_cache.shape[0];
  s.heads_kv = key_cache.shape[1];
  s.page_size = key_cache.shape[2];
  s.dim_qk = key_cache.shape[3];
  s.dim_v = value_cache.shape[3];
  if (s.page_size < 1) throw Error("key_cache: expected a page size (dimension 2) of at least 1, got " + key_cache.shape_str());
  if (static_cast<int64_t>(lens.size()) != batch) {
    throw Error("cache_seqlens: expected one length per sequence (" + std::to_string(batch) + "), got " +
                std::to_string(lens.size()));
  }
  const auto table_size = static_cast<int64_t>(table.size());
  if (batch == 0 ? table_size != 0 : table_size % batch != 0) {
    throw Error("block_table: expected [B, pages_per_sequence] entries, a multiple of B = " + std::to_string(batch) +
                ", got " + std::to_string(table_size));
  }
  s.pages_per_sequence = batch == 0 ? 0 : table_size / batch;
  return s;
}

// What both attention functions check besides the query's layout: the options against the
// query rows of one sequence, `q_one` ([1, Hq, L, Dk], or [0, ..] without sequences), then the table.
void validate_options(const TensorView& q_one, const PagedShape& s, const TensorView& key_cache,
                      const TensorView& value_cache, std::span<const int32_t> table, std::span<const int64_t> lens,
                      const SdpaOptions& options) {
  if (options.attn_mask) {
    throw Error("attn_mask: not taken by paged_attention (each sequence's length is its mask; causality, windows "
                "and ALiBi are options)");
  }
  if (options.dropout_p != 0.0) {
    throw Error("dropout_p: paged_attention is for inference and takes no dropout, got " +
                std::to_string(options.dropout_p));
  }
  // Per-sequence options, [H] or [B, H]; the rest is checked on the first sequence's below.
  SdpaOptions one = options;
  for (auto [option, name, heads] : {std::tuple{&SdpaOptions::alibi_slopes, "alibi_slopes", "[Hq]"},
                                     std::tuple{&SdpaOptions::k_descale, "k_descale", "[Hkv]"},
                                     std::tuple{&SdpaOptions::v_descale, "v_descale", "[Hkv]"}}) {
    if (!(options.*option)) continue;
    detail::check_per_sequence_option(*(options.*option), name, heads, "B", s.batch, option != &SdpaOptions::alibi_slopes);
    one.*option = detail::first_sequence_option(options.*option);
  }
  // The options against one sequence of a page's keys: dtypes, head counts, head dims, scale.
  const TensorView k = key_cache.slice(0, 0, std::min<int64_t>(1, s.pages));
  const TensorView v = value_cache.slice(0, 0, std::min<int64_t>(1, s.pages));
  (void)detail::make_sdpa_problem(q_one, k, v, one, detail::InputDtypes::fused);
  check_table(s, table, lens, {}, "reads keys");
}

PagedShape validate(const TensorView& q, const TensorView& key_cache, const TensorView& value_cache,
                    std::span<const int32_t> table, std::span<const int64_t> lens, const SdpaOptions& options) {
  check_rank4(q, "query", "[B, Hq, Lq, Dk]");
  PagedShape s = check_cache(key_cache, value_cache, table, lens, q.shape[0]);
  s.heads_q = q.shape[1];
  s.len_q = q.shape[2];
  validate_options(q.slice(0, 0, std::min<int64_t>(1, s.batch)), s, key_cache, value_cache, table, lens, options);
  return s;
}

// Rows [begin, end) of a packed [T, Hq, D] query or output as the [1, Hq, L, D] view SDPA reads.
TensorView packed_rows(const TensorView& packed, int64_t begin, int64_t end) {
  return packed.slice(0, begin, end).transpose(0, 1).unsqueeze(0);
}

PagedShape validate_varlen(const TensorView& q, std::span<const int64_t> cu_q, const TensorView& key_cache,
                           const TensorView& value_cache, std::span<const int32_t> table,
                           std::span<const int64_t> lens, const SdpaOptions& options) {
  if (q.ndim != 3) throw Error("query: expected a packed [Tq, Hq, Dk] tensor (rank 3), got shape " + q.shape_str());
  require_cpu(q, "query");
  detail::check_offsets(cu_q, q.shape[0], "cu_seqlens_q", "query");
  PagedShape s = check_cache(key_cache, value_cache, table, lens, static_cast<int64_t>(cu_q.size()) - 1);
  s.heads_q = q.shape[1];
  validate_options(packed_rows(q, 0, q.shape[0]), s, key_cache, value_cache, table, lens, options);
  return s;
}

// Keys and values of a sequence in place: its first `len` rows as one [1, Hkv, len, D] view whose
// strides[0] steps from page to page (only AttentionProblem::key_row_offset reads it so).
TensorView first_rows(const TensorView& cache, int64_t len) {
  return TensorView(cache.data, cache.dtype, {1, cache.shape[1], len, cache.shape[3]},
                    {cache.strides[0], cache.strides[1], cache.strides[2], cache.strides[3]});
}

Tensor gather_pages(const TensorView& cache, const int32_t* pages, int64_t page_size, int64_t len, int threads) {
  Tensor out = Tensor::empty({1, cache.shape[1], len, cache.shape[3]}, cache.dtype);
  if (out.numel() == 0) return out;  // (no rows, or rows of no element: nothing to copy, no storage to copy into)
  const int64_t heads = cache.shape[1], width = cache.shape[3], size = dtype_size(cache.dtype);
  const int64_t row_bytes = width * size;
  auto* dst = static_cast<char*>(out.view().data);
  const auto* src = static_cast<const char*>(cache.data);
  const int64_t n_pages = pages_used(len, page_size);
  detail::parallel_for(heads * n_pages, threads, [&](int64_t t, int) {
    const int64_t h = t / n_pages, i = t % n_pages, j0 = i * page_size, j1 = std::min(len, j0 + page_size);
    const char* page = src + (pages[i] * cache.strides[0] + h * cache.strides[1]) * size;
    for (int64_t j = j0; j < j1; ++j)
      std::memcpy(dst + ((h * len + j) * width) * size, page + (j - j0) * cache.strides[2] * size, row_bytes);
  });
  return out;
}

// Sequence b's problem (its query rows qb [1, Hq, Lq, Dk]), ready to run on `threads` threads;
// gathered copies (if any) in `storage`.
AttentionProblem sequence_problem(const TensorView& qb, const TensorView& key_cache, const TensorView& value_cache,
                                  std::span<const int32_t> table, std::span<const int64_t> lens,
                                  const SdpaOptions& options, const PagedShape& s, int64_t b, int threads,
                                  std::vector<Tensor>& storage) {
  SdpaOptions o = options;
  o.num_threads = threads;
  for (auto option : {&SdpaOptions::alibi_slopes, &SdpaOptions::k_descale, &SdpaOptions::v_descale})
    o.*option = detail::sequence_option(options.*option, b);  // [1, H]: this sequence's
  const int64_t len = lens[b];
  const int32_t* pages = table.data() + b * s.pages_per_sequence;
  AttentionProblem p = detail::make_sdpa_problem(qb, first_rows(key_cache, len), first_rows(value_cache, len), o,
                                                 detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  if (detail::reads_pages_in_place(p)) {
    p.key_pages = pages;
    p.page_size = s.page_size;
    p.k.strides[0] = key_cache.strides[0];  // (batch entry 0 only: the stride from page to page)
    p.v.strides[0] = value_cache.strides[0];
    return p;
  }
  storage.push_back(gather_pages(key_cache, pages, s.page_size, len, threads));
  storage.push_back(gather_pages(value_cache, pages, s.page_size, len, threads));
  p = detail::make_sdpa_problem(qb, storage[storage.size() - 2].view(), storage.back().view(), o,
                                detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  return p;
}

// Runs every sequence b with keys: its query rows q_of(b) into out_of(b) ([1, Hq, Lq_b, D] views),
// zeros where it has none; with lse_of, each row's log-sum-exp into lse_of(b) ([Hq, Lq_b]; for a
// sequence with no key +inf, or the sink's with sinks).
template <class Rows>
void run_sequences(const PagedShape& s, Rows q_of, Rows out_of, const Rows* lse_of, const TensorView& key_cache,
                   const TensorView& value_cache, std::span<const int32_t> table, std::span<const int64_t> lens,
                   const SdpaOptions& options) {
  const DType lse_dtype = key_cache.dtype == DType::f64 ? DType::f64 : DType::f32;
  std::vector<double> cost(static_cast<size_t>(s.batch));
  for (int64_t b = 0; b < s.batch; ++b) {
    const TensorView out = out_of(b);
    const int64_t len = lens[b], rows = out.shape[2];
    if (len == 0 && rows > 0) {  // every row fully masked
      copy_into(Tensor::zeros(out.sizes(), out.dtype), out);
      if (lse_of) detail::fill_lse_without_keys(options, (*lse_of)(b));
    }
    // The cache each sequence reads (decoding is bound by it) and the multiply-adds, alike per key.
    cost[b] = rows == 0 ? 0.0
                        : static_cast<double>(len) * (static_cast<double>(s.heads_q) * static_cast<double>(rows) +
                                                      static_cast<double>(s.heads_kv));
  }
  const int threads = detail::resolve_threads(options.num_threads);
  detail::for_each_sequence(cost, threads, [&](int64_t b, int call_threads) {
    std::vector<Tensor> storage;
    const AttentionProblem p =
        sequence_problem(q_of(b), key_cache, value_cache, table, lens, options, s, b, call_threads, storage);
    if (!lse_of) {
      detail::sdpa_forward_host(p, out_of(b), nullptr, nullptr);
      return;
    }
    Tensor own_lse = Tensor::empty({s.heads_q, p.len_q}, lse_dtype);  // the kernels write it packed
    detail::sdpa_forward_host(p, out_of(b), nullptr, own_lse.view().data);
    copy_into(own_lse, (*lse_of)(b));
  });
}

using SequenceRows = std::function<TensorView(int64_t)>;

// paged_attention's work, with the log-sum-exp [B, Hq, Lq] when `lse`.
PagedAttentionOutput padded_queries(const TensorView& q, const TensorView& key_cache, const TensorView& value_cache,
                                    std::span<const int32_t> table, std::span<const int64_t> lens,
                                    const SdpaOptions& options, bool lse) {
  const PagedShape s = validate(q, key_cache, value_cache, table, lens, options);
  PagedAttentionOutput r;
  r.output = Tensor::empty({s.batch, s.heads_q, s.len_q, s.dim_v}, q.dtype);
  if (lse) r.lse = Tensor::empty({s.batch, s.heads_q, s.len_q}, q.dtype == DType::f64 ? DType::f64 : DType::f32);
  const SequenceRows q_of = [&](int64_t b) { return q.slice(0, b, b + 1); };
  const SequenceRows out_of = [&](int64_t b) { return r.output.view().slice(0, b, b + 1); };
  const SequenceRows lse_of = [&](int64_t b) { return r.lse.view().select(0, b); };
  run_sequences(s, q_of, out_of, lse ? &lse_of : nullptr, key_cache, value_cache, table, lens, options);
  return r;
}

// paged_attention_varlen's work, with the log-sum-exp [Hq, Tq] when `lse`.
PagedAttentionOutput packed_queries(const TensorView& q, std::span<const int64_t> cu_q, const TensorView& key_cache,
                                    const TensorView& value_cache, std::span<const int32_t> table,
                                    std::span<const int64_t> lens, const SdpaOptions& options, bool lse) {
  const PagedShape s = validate_varlen(q, cu_q, key_cache, value_cache, table, lens, options);
  PagedAttentionOutput r;
  r.output = Tensor::empty({q.shape[0], s.heads_q, s.dim_v}, q.dtype);
  if (lse) r.lse = Tensor::empty({s.heads_q, q.shape[0]}, q.dtype == DType::f64 ? DType::f64 : DType::f32);
  const SequenceRows q_of = [&](int64_t b) { return packed_rows(q, cu_q[b], cu_q[b + 1]); };
  const SequenceRows out_of = [&](int64_t b) { return packed_rows(r.output, cu_q[b], cu_q[b + 1]); };
  const SequenceRows lse_of = [&](int64_t b) { return r.lse.view().slice(1, cu_q[b], cu_q[b + 1]); };
  run_sequences(s, q_of, out_of, lse ? &lse_of : nullptr, key_cache, value_cache, table, lens, options);
  return r;
}

// The new rows' dtype must be the caches', or, into a float8 cache, float32, bfloat16 or float16
// (rounded to nearest even as they are written, PyTorch's conversion: saturated beyond 448).
void check_new_rows_dtype(const TensorView& key, const TensorView& value, const TensorView& key_cache) {
  for (const TensorView* t : {&key, &value}) {
    if (t->dtype == key_cache.dtype) continue;
    const bool rounded = is_float8(key_cache.dtype) &&
                         (t->dtype == DType::f32 || t->dtype == DType::bf16 || t->dtype == DType::f16);
    if (!rounded) {
      throw Error(std::string(t == &key ? "key" : "value") + ": expected the caches' dtype " +
                  std::string(dtype_name(key_cache.dtype)) +
                  (is_float8(key_cache.dtype) ? " (or float32, bfloat16, float16, rounded into it)" : "") +
                  ", got " + std::string(dtype_name(t->dtype)));
    }
  }
}

// The quantisation scales of a write (CacheWriteScales), read as [B * Hkv] floats each (empty
// where not given); mha::Error unless the caches are float8 and the scales fit.
struct RowScales {
  std::vector<float> key, value;

  // (Read only where rows are written: then B * Hkv is bounded by the caches' storage.)
  RowScales(const CacheWriteScales& given, const PagedShape& s, DType cache_dtype, std::span<const int64_t> added) {
    for (auto [scales, out, name] : {std::tuple{&given.k_descale, &key, "k_descale"},
                                     std::tuple{&given.v_descale, &value, "v_descale"}}) {
      if (!*scales) continue;
      if (!is_float8(cache_dtype)) {
        throw Error(std::string(name) + ": scales are taken for float8 caches (float8_e4m3fn or float8_e5m2), got " +
                    std::string(dtype_name(cache_dtype)) + " caches");
      }
      detail::check_per_sequence_option(**scales, name, "[Hkv]", "B", s.batch, true);
      detail::check_scales(**scales, {s.batch, s.heads_kv}, name);
      detail::check_scale_values(**scales, name);
      if (std::any_of(added.begin(), added.end(), [](int64_t n) { return n > 0; }))
        *out = detail::read_scales(**scales, {s.batch, s.heads_kv}, name);
    }
  }
};

// Copies row ([Hkv, D]) into dst, with each head's elements divided by scales[h] in float32 first
// where scales are given (through `staging`, a float32 [Hkv, D] buffer).
void write_row(const TensorView& row, const TensorView& dst, const float* scales, const Tensor& staging) {
  if (scales == nullptr) {
    copy_into(row, dst);
    return;
  }
  copy_into(row, staging.view());
  float* x = staging.data<float>();
  const int64_t heads = row.shape[0], width = row.shape[1];
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < width; ++d) x[h * width + d] /= scales[h];
  copy_into(staging.view(), dst);
}

// Writes rows t < added[b] of each sequence b, key_row(b, t) and value_row(b, t) ([Hkv, D] views),
// to position cache_seqlens[b] + t of its pages, divided by their scales where given; sequences in
// order (a later one's row is kept where two share a slot).
template <class KeyRow, class ValueRow>
void write_rows(const PagedShape& s, const TensorView& key_cache, const TensorView& value_cache,
                std::span<const int32_t> table, std::span<const int64_t> lens, std::span<const int64_t> added,
                const RowScales& scales, KeyRow key_row, ValueRow value_row) {
  const Tensor key_staging = Tensor::empty({s.heads_kv, scales.key.empty() ? 0 : s.dim_qk});
  const Tensor value_staging = Tensor::empty({s.heads_kv, scales.value.empty() ? 0 : s.dim_v});
  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t* pages = table.data() + b * s.pages_per_sequence;
    const float* key_scales = scales.key.empty() ? nullptr : scales.key.data() + b * s.heads_kv;
    const float* value_scales = scales.value.empty() ? nullptr : scales.value.data() + b * s.heads_kv;
    for (int64_t t = 0; t < added[b]; ++t) {
      const int64_t j = lens[b] + t;
      const int64_t page = pages[j / s.page_size], row = j % s.page_size;
      write_row(key_row(b, t), key_cache.select(0, page).select(1, row), key_scales, key_staging);
      write_row(value_row(b, t), value_cache.select(0, page).select(1, row), value_scales, value_staging);
    }
  }
}

}  // namespace

Tensor paged_attention(const TensorView& q, const TensorView& key_cache, const TensorView& value_cache,
                       std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                       const SdpaOptions& options) {
  return padded_queries(q, key_cache, value_cache, block_table, cache_seqlens, options, false).output;
}

PagedAttentionOutput paged_attention_with_lse(const TensorView& q, const TensorView& key_cache,
                                              const TensorView& value_cache, std::span<const int32_t> block_table,
                                              std::span<const int64_t> cache_seqlens, const SdpaOptions& options) {
  return padded_queries(q, key_cache, value_cache, block_table, cache_seqlens, options, true);
}

Tensor paged_attention_varlen(const TensorView& q, std::span<const int64_t> cu_seqlens_q,
                              const TensorView& key_cache, const TensorView& value_cache,
                              std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                              const SdpaOptions& options) {
  return packed_queries(q, cu_seqlens_q, key_cache, value_cache, block_table, cache_seqlens, options, false).output;
}

PagedAttentionOutput paged_attention_varlen_with_lse(const TensorView& q, std::span<const int64_t> cu_seqlens_q,
                                                     const TensorView& key_cache, const TensorView& value_cache,
                                                     std::span<const int32_t> block_table,
                                                     std::span<const int64_t> cache_seqlens,
                                                     const SdpaOptions& options) {
  return packed_queries(q, cu_seqlens_q, key_cache, value_cache, block_table, cache_seqlens, options, true);
}

void write_paged_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, std::span<const int32_t> block_table,
                       std::span<const int64_t> cache_seqlens, const CacheWriteScales& scales) {
  check_rank4(key, "key", "[B, Hkv, Lnew, Dk]");
  check_rank4(value, "value", "[B, Hkv, Lnew, Dv]");
  const PagedShape s = check_cache(key_cache, value_cache, block_table, cache_seqlens, key.shape[0]);
  const Shape key_expected{s.batch, s.heads_kv, key.shape[2], s.dim_qk};
  const Shape value_expected{s.batch, s.heads_kv, key.shape[2], s.dim_v};
  if (key.sizes() != key_expected || value.sizes() != value_expected) {
    throw Error("key/value: expected [B, Hkv, Lnew, Dk] and [B, Hkv, Lnew, Dv] with the caches' Hkv = " +
                std::to_string(s.heads_kv) + ", Dk = " + std::to_string(s.dim_qk) + ", Dv = " +
                std::to_string(s.dim_v) + ", got key " + key.shape_str() + " and value " + value.shape_str());
  }
  check_new_rows_dtype(key, value, key_cache);
  const std::vector<int64_t> added(static_cast<size_t>(s.batch), key.shape[2]);
  check_table(s, block_table, cache_seqlens, added, "writes rows");
  const RowScales row_scales(scales, s, key_cache.dtype, added);
  write_rows(
      s, key_cache, value_cache, block_table, cache_seqlens, added, row_scales,
      [&](int64_t b, int64_t t) { return key.select(0, b).select(1, t); },
      [&](int64_t b, int64_t t) { return value.select(0, b).select(1, t); });
}

void write_paged_cache_varlen(const TensorView& key, const TensorView& value, std::span<const int64_t> cu_seqlens_new,
                              const TensorView& key_cache, const TensorView& value_cache,
                              std::span<const int32_t> block_table, std::span<const int64_t> cache_seqlens,
                              const CacheWriteScales& scales) {
  for (const auto& [t, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    if (t->ndim != 3) {
      throw Error(std::string(name) + ": expected a packed [Tnew, Hkv, D] tensor (rank 3), got shape " +
                  t->shape_str());
    }
    require_cpu(*t, name);
  }
  detail::check_offsets(cu_seqlens_new, key.shape[0], "cu_seqlens_new", "key");
  const PagedShape s = check_cache(key_cache, value_cache, block_table, cache_seqlens,
                                   static_cast<int64_t>(cu_seqlens_new.size()) - 1);
  const Shape key_expected{key.shape[0], s.heads_kv, s.dim_qk};
  const Shape value_expected{key.shape[0], s.heads_kv, s.dim_v};
  if (key.sizes() != key_expected || value.sizes() != value_expected) {
    throw Error("key/value: expected [Tnew, Hkv, Dk] and [Tnew, Hkv, Dv] with the caches' Hkv = " +
                std::to_string(s.heads_kv) + ", Dk = " + std::to_string(s.dim_qk) + ", Dv = " +
                std::to_string(s.dim_v) + ", got key " + key.shape_str() + " and value " + value.shape_str());
  }
  check_new_rows_dtype(key, value, key_cache);
  std::vector<int64_t> added(static_cast<size_t>(s.batch));
  for (int64_t b = 0; b < s.batch; ++b) added[b] = cu_seqlens_new[b + 1] - cu_seqlens_new[b];
  check_table(s, block_table, cache_seqlens, added, "writes rows");
  const RowScales row_scales(scales, s, key_cache.dtype, added);
  write_rows(
      s, key_cache, value_cache, block_table, cache_seqlens, added, row_scales,
      [&](int64_t b, int64_t t) { return key.select(0, cu_seqlens_new[b] + t); },
      [&](int64_t b, int64_t t) { return value.select(0, cu_seqlens_new[b] + t); });
}

}  // namespace mha
