// Validation of the paged key/value cache functions (paged_attention, its packed-query form
// paged_attention_varlen with fuzzed offsets, their _with_lse forms, write_paged_cache and its
// packed form write_paged_cache_varlen): fuzzed
// views (ranks 0 to 5, sizes from 0 to 2^62 and near the int64 limit, strides, dtypes) for the
// query, the caches and the new rows; block tables of any length with page indices in and out of
// range (-1 and 32-bit extremes); lengths per sequence of any count, negative, small or absurd;
// the SDPA options (causality, windows, ALiBi, GQA, scale, dropout, threads) and sometimes a mask.
//
// Every call returns or throws mha::Error, never crashes or trips a sanitizer. Beyond that: an
// attention that succeeds on finite inputs returns finite values (the views' buffers hold 0.5
// between NaN guards, so a read past a view, which the sanitizers cannot see inside its vector,
// shows as NaN), and its lse, when asked for, holds no NaN and merges with itself as the formula says; a write that succeeds leaves the
// caches' guards as they were; a call given a null
// data pointer for a non-empty tensor throws. Calls run for real only on tiny views.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "fuzz_args.hpp"
#include "fuzz_input.hpp"
#include "mha/mha.hpp"

namespace {

using namespace fuzz_args;

std::vector<int32_t> fuzz_table(FuzzInput& in) {
  std::vector<int32_t> table(static_cast<size_t>(in.small(12)));
  for (int32_t& page : table) {
    const int64_t kind = in.small(7);
    page = kind == 0 ? static_cast<int32_t>(in.u64()) : kind == 1 ? -1 : static_cast<int32_t>(in.small(6));
  }
  return table;
}

std::vector<int64_t> fuzz_lengths(FuzzInput& in, const mha::TensorView& batch_source) {
  const int64_t count = in.flag() && batch_source.ndim >= 1 ? batch_source.shape[0] : in.small(4);
  std::vector<int64_t> lens;
  for (int64_t b = 0; b < count && b < 16; ++b) {
    const int64_t kind = in.small(9);
    lens.push_back(kind == 0 ? in.dim() : kind == 1 ? -static_cast<int64_t>(in.small(3)) : in.small(20));
  }
  return lens;
}

// A contiguous view of `shape` between NaN guards holding 0.5, or with `flash_layout` the
// transpose(1, 2) view of [d0, d2, d1, d3] storage (FlashAttention's cache layout).
Arg guarded(const mha::Shape& shape, mha::DType dtype, bool flash_layout) {
  Arg a;
  mha::Shape stored = shape;
  if (flash_layout) std::swap(stored[1], stored[2]);
  int64_t numel = 1;
  for (int64_t d : stored) numel *= d;
  const size_t floats = static_cast<size_t>(numel * mha::dtype_size(dtype) / 4 + 1);
  a.storage.assign(kGuard + floats + kGuard, guard_nan());
  std::fill_n(a.storage.begin() + kGuard, floats, 0.5f);
  a.view = mha::TensorView(a.storage.data() + kGuard, dtype, stored);
  if (flash_layout) a.view = a.view.transpose(1, 2);
  a.placeholder = a.view;
  return a;
}

// Shapes that fit together (the caches [pages, Hkv, page_size, D], the query [B, Hq, Lq, D] or
// new rows [B, Hkv, Lnew, D]), so that calls get past the shape checks to the tables, the
// lengths and the kernels.
struct Fitting {
  int64_t batch, heads_kv, group, rows, dim, pages, page_size;
  mha::DType dtype;
  bool flash_layout;
  mha::DType cache_dtype;  // the query's, or float8 caches (under a float32/bf16/fp16 query)
};
Fitting fitting(FuzzInput& in) {
  static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f16, mha::DType::f64};
  Fitting f{in.small(3), 1 + in.small(2), 1 + in.small(2), in.small(4) == 0 ? 33 + in.small(3) : in.small(4),
            in.small(3) == 0 ? in.small(9) : 8 * (1 + in.small(2)), 1 + in.small(5), 1 + in.small(6),
            dtypes[in.small(3)], in.flag(), mha::DType::f32};
  if (in.small(3) == 0 && f.dtype != mha::DType::f64) f.cache_dtype = in.flag() ? mha::DType::f8e5m2 : mha::DType::f8e4m3;
  else f.cache_dtype = f.dtype;
  return f;
}

// Whether the guards around a view's buffer still hold NaN (a write stayed inside it).
bool guards_intact(const Arg& a) {
  if (a.storage.empty()) return true;
  for (size_t i = 0; i < kGuard; ++i) {
    if (!std::isnan(a.storage[i]) || !std::isnan(a.storage[a.storage.size() - 1 - i])) return false;
  }
  return true;
}

// Offsets of packed query rows: B + 1 of them, from 0 to the rows, some empty sequences; or
// fuzzed ones (any count, order and end).
std::vector<int64_t> fuzz_offsets(FuzzInput& in, int64_t batch, int64_t rows) {
  std::vector<int64_t> cu{0};
  if (in.small(3) == 0) {
    for (int64_t i = in.small(5); i > 0; --i) {
      const int64_t step = in.small(9);  // (no step past the int64 limit: the harness's own overflow)
      cu.push_back(in.small(3) == 0 ? in.dim() : cu.back() > INT64_MAX - step ? cu.back() : cu.back() + step);
    }
    return cu;
  }
  for (int64_t b = 0; b < batch; ++b) cu.push_back(b + 1 == batch ? rows : std::min(rows, cu.back() + in.small(rows)));
  return cu;
}

void fuzz_attention(FuzzInput& in, bool packed, bool lse) {
  Arg q, key_cache, value_cache;
  if (in.flag()) {
    const Fitting f = fitting(in);
    q = packed ? guarded({f.batch * f.rows, f.heads_kv * f.group, f.dim}, f.dtype, false)
               : guarded({f.batch, f.heads_kv * f.group, f.rows, f.dim}, f.dtype, in.flag());
    key_cache = guarded({f.pages, f.heads_kv, f.page_size, f.dim}, f.cache_dtype, f.flash_layout);
    value_cache = guarded({f.pages, f.heads_kv, f.page_size, f.dim}, f.cache_dtype, f.flash_layout);
  } else {
    q = make(in, packed ? 4 : 5), key_cache = make(in, 5), value_cache = make(in, 5);
  }
  const std::vector<int32_t> table = fuzz_table(in);
  const std::vector<int64_t> lens = fuzz_lengths(in, q.view);
  const std::vector<int64_t> cu =
      packed ? fuzz_offsets(in, static_cast<int64_t>(lens.size()), q.view.ndim >= 1 ? q.view.shape[0] : 0)
             : std::vector<int64_t>{};
  mha::SdpaOptions o;
  fuzz_options(in, o);
  Arg mask;
  if (in.small(7) == 0) {
    mask = make(in, 4);
    o.attn_mask = mask.view;
  }
  auto call = [&] {
    if (!lse) {
      return mha::PagedAttentionOutput{
          packed ? mha::paged_attention_varlen(q.view, cu, key_cache.view, value_cache.view, table, lens, o)
                 : mha::paged_attention(q.view, key_cache.view, value_cache.view, table, lens, o),
          {}};
    }
    return packed ? mha::paged_attention_varlen_with_lse(q.view, cu, key_cache.view, value_cache.view, table, lens, o)
                  : mha::paged_attention_with_lse(q.view, key_cache.view, value_cache.view, table, lens, o);
  };
  const bool runs = tiny(q) && tiny(key_cache) && tiny(value_cache) && (!o.attn_mask || tiny(mask));
  if (!runs) {
    if (has_null(q.view) || has_null(key_cache.view) || has_null(value_cache.view)) {
      must_refuse(call);
    }
    return;
  }
  const mha::PagedAttentionOutput r = call();
  check_finite_any(r.output);
  if (lse) {
    const mha::Tensor l = mha::Tensor::copy_of(r.lse, mha::DType::f64);
    for (int64_t i = 0; i < l.numel(); ++i)
      if (std::isnan(l.data<double>()[i])) __builtin_trap();
    // Merged with itself (merge_attention_states): the same output, each copy half the weight, and
    // the lse plus log 2 (+inf, a row that saw no key, stays +inf).
    const mha::PagedAttentionOutput m = packed ? mha::merge_attention_states_varlen(r.output, r.lse, r.output, r.lse)
                                               : mha::merge_attention_states(r.output, r.lse, r.output, r.lse);
    const mha::Tensor got = mha::Tensor::copy_of(m.output, mha::DType::f64), want = mha::Tensor::copy_of(r.output, mha::DType::f64);
    for (int64_t i = 0; i < want.numel(); ++i)
      if (got.data<double>()[i] != want.data<double>()[i]) __builtin_trap();
    const mha::Tensor lm = mha::Tensor::copy_of(m.lse, mha::DType::f64);
    for (int64_t i = 0; i < l.numel(); ++i) {
      const double x = l.data<double>()[i], y = lm.data<double>()[i];
      if (std::isinf(x) ? y != x : !(std::fabs(y - (x + std::log(2.0))) <= 1e-6 * std::max(1.0, std::fabs(x)))) __builtin_trap();
    }
  }
}

void fuzz_write(FuzzInput& in, bool packed) {
  Arg key, value, key_cache, value_cache;
  if (in.flag()) {
    const Fitting f = fitting(in);
    const mha::Shape rows = packed ? mha::Shape{f.batch * f.rows, f.heads_kv, f.dim}
                                   : mha::Shape{f.batch, f.heads_kv, f.rows, f.dim};
    key = guarded(rows, f.dtype, !packed && in.flag());
    value = guarded(rows, f.dtype, !packed && in.flag());
    key_cache = guarded({f.pages, f.heads_kv, f.page_size, f.dim}, f.cache_dtype, f.flash_layout);
    value_cache = guarded({f.pages, f.heads_kv, f.page_size, f.dim}, f.cache_dtype, f.flash_layout);
  } else {
    key = make(in, 5), value = make(in, 5), key_cache = make(in, 5), value_cache = make(in, 5);
  }
  const std::vector<int32_t> table = fuzz_table(in);
  const std::vector<int64_t> lens = fuzz_lengths(in, key.view);
  const std::vector<int64_t> cu =
      packed ? fuzz_offsets(in, static_cast<int64_t>(lens.size()), key.view.ndim >= 1 ? key.view.shape[0] : 0)
             : std::vector<int64_t>{};
  mha::SdpaOptions o;  // its k_descale and v_descale (fitting or not) quantise the rows written
  fuzz_options(in, o);
  const mha::CacheWriteScales scales{o.k_descale, o.v_descale};
  auto write = [&] {
    if (packed) {
      mha::write_paged_cache_varlen(key.view, value.view, cu, key_cache.view, value_cache.view, table, lens, scales);
    } else {
      mha::write_paged_cache(key.view, value.view, key_cache.view, value_cache.view, table, lens, scales);
    }
  };
  const bool runs = tiny(key) && tiny(value) && tiny(key_cache) && tiny(value_cache);
  if (!runs) {
    if (has_null(key.view) || has_null(value.view) || has_null(key_cache.view) || has_null(value_cache.view)) {
      must_refuse(write);
    }
    return;
  }
  write();
  if (!guards_intact(key_cache) || !guards_intact(value_cache)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  try {
    const uint8_t tail = in.tail_byte();  // (from the end: the front reads as before)
    const bool packed = tail % 4 == 1, lse = (tail & 8) != 0;
    if (in.flag()) {
      fuzz_attention(in, packed, lse);
    } else {
      fuzz_write(in, packed);
    }
  } catch (const mha::Error&) {
  }
  return 0;
}
