// What the validation fuzzers share (fuzz_validation.cpp, fuzz_paged.cpp): fuzzed views between
// NaN guards, the size limits of calls that run for real, finiteness checks and fuzzed SDPA options.
#pragma once

#include <bit>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "fuzz_input.hpp"
#include "mha/mha.hpp"

namespace fuzz_args {

constexpr int64_t kMaxElements = 1 << 14;  // per argument buffer
constexpr int64_t kMaxNumel = 100000;      // elements of any argument of a call that runs
constexpr int64_t kMaxPairs = 1 << 16;     // (query rows) x (key rows) of a call that runs
// Never dereferenced: given only to validators, for views too large to have storage.
void* const kPlaceholder = reinterpret_cast<void*>(uintptr_t{1} << 40);

struct Arg {
  std::vector<float> storage;
  mha::TensorView view;         // real storage, or null data when too large
  mha::TensorView placeholder;  // the same view with non-null data, for the validators only
  bool big = false;             // no storage
};

// A view with fuzzed rank, sizes, strides and dtype; its buffer holds 0.5f (finite in every
// dtype, read as bytes 0x00 0x00 0x00 0x3f) between two guards of NaN (kGuardNaN: NaN in every
// floating dtype): a read past either end of the view that the sanitizers cannot see (inside
// BLAS, which is not instrumented) turns the output non-finite, which check_finite catches.
constexpr size_t kGuard = 64;  // floats
// A float32 NaN whose halves are bfloat16 and float16 NaNs, whose bytes (0xff, 0x7f) float8 NaNs,
// and two of which make a float64 NaN.
inline float guard_nan() { return std::bit_cast<float>(0x7fff7fffu); }
inline Arg make(FuzzInput& in, int max_rank) {
  Arg a;
  const int rank = static_cast<int>(in.small(max_rank));
  mha::Shape shape(rank), strides(rank);
  int64_t span = 1;
  for (int d = rank - 1; d >= 0; --d) {
    shape[d] = in.dim();
    strides[d] = in.flag() ? span : in.small(3) == 0 ? 0 : in.dim();
    int64_t extent = 0;
    if (shape[d] > 0 && strides[d] > 0 &&
        (__builtin_mul_overflow(shape[d], strides[d], &extent) || extent > kMaxElements)) {
      a.big = true;
      span = 1;
    } else {
      span = std::max<int64_t>(span, extent);
    }
  }
  static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::f32, mha::DType::bf16,
                                      mha::DType::f16, mha::DType::boolean, mha::DType::f64, mha::DType::f8e4m3,
                                      mha::DType::f8e5m2};
  const mha::DType dtype = dtypes[in.small(8)];
  try {
    if (!a.big) {
      int64_t max_offset = 0;
      for (int d = 0; d < rank; ++d) max_offset += (shape[d] > 0 ? shape[d] - 1 : 0) * strides[d];
      const size_t floats = static_cast<size_t>((max_offset + 1) * mha::dtype_size(dtype) / 4 + 1);
      a.storage.assign(kGuard + floats + kGuard, guard_nan());
      std::fill_n(a.storage.begin() + kGuard, floats, 0.5f);
      a.view = mha::TensorView(a.storage.data() + kGuard, dtype, shape, strides);
      a.placeholder = a.view;
    } else {
      a.view = mha::TensorView(nullptr, dtype, shape, strides);
      a.placeholder = mha::TensorView(kPlaceholder, dtype, shape, strides);
    }
  } catch (const mha::Error&) {  // the view itself refused (offsets overflow): an empty one instead
    a = Arg{};
    a.view = a.placeholder = mha::TensorView(nullptr, mha::DType::f32, {0});
  }
  return a;
}

// Product of all sizes but the last (rows of a [.., L, D] operand), saturating.
inline int64_t rows(const mha::TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d + 1 < t.ndim; ++d) {
    if (__builtin_mul_overflow(n, t.shape[d], &n)) return INT64_MAX;
  }
  return n;
}

// The same product with sizes of 0 counted as 1: what buffers may still scale with when a view
// is empty (a module appends bias_k/bias_v rows to every batch entry, even of empty sequences).
inline int64_t rows_if_nonempty(const mha::TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d + 1 < t.ndim; ++d) {
    if (__builtin_mul_overflow(n, std::max<int64_t>(t.shape[d], 1), &n)) return INT64_MAX;
  }
  return n;
}

inline bool small_pairs(const mha::TensorView& q, const mha::TensorView& k) {
  int64_t pairs;
  return !__builtin_mul_overflow(rows(q), rows(k), &pairs) && pairs <= kMaxPairs;
}

// Small enough to run: real storage and few elements (a stride-0 dimension can be huge in a
// small buffer).
inline bool tiny(const Arg& a) { return !a.big && a.view.numel() <= kMaxNumel; }

inline bool has_null(const mha::TensorView& t) { return t.numel() > 0 && t.data == nullptr; }

inline void check_finite(const mha::TensorView& t) {
  if (t.dtype != mha::DType::f32 || t.data == nullptr) return;  // bf16/f16 outputs: checked via f32 below
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(static_cast<const float*>(t.data)[i])) __builtin_trap();
  }
}
inline void check_finite_any(const mha::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  check_finite(t.dtype() == mha::DType::f32 ? t : mha::Tensor::copy_of(t, mha::DType::f32));
}

// A float32 copy of a 16-bit float view (other dtypes copied as they are).
inline mha::Tensor widened(const mha::TensorView& t) {
  const bool low = t.dtype == mha::DType::f16 || t.dtype == mha::DType::bf16;
  return mha::Tensor::copy_of(t, low ? mha::DType::f32 : t.dtype);
}

// A gradient in a 16-bit dtype may be +-inf where the exact gradient lies past the dtype's range:
// float16's largest finite value is 65504, and a dropout of p near 1 scales by 1 / (1 - p), up
// to 4096 here. `wide()` gives the same gradient computed on float32 copies of the inputs (in
// float32's range, inputs within +-8): an infinite element must be one whose float32 value is
// past half the dtype's largest finite value (the two computations round differently), and no
// element may be NaN. Other dtypes must be finite.
template <class Wide>
inline void check_finite_or_overflow(const mha::Tensor& t, const Wide& wide) {
  if (!t.defined() || t.numel() == 0) return;
  if (t.dtype() != mha::DType::f16 && t.dtype() != mha::DType::bf16) return check_finite_any(t);
  const mha::Tensor f = mha::Tensor::copy_of(t.view(), mha::DType::f32);
  const float* x = f.data<float>();
  if (std::all_of(x, x + f.numel(), [](float e) { return std::isfinite(e); })) return;
  const mha::Tensor w = mha::Tensor::copy_of(wide().view(), mha::DType::f32);
  if (w.numel() != f.numel()) __builtin_trap();
  const double largest = t.dtype() == mha::DType::f16 ? 65504.0 : 3.3895313892515355e38;
  for (int64_t i = 0; i < f.numel(); ++i) {
    if (std::isnan(x[i]) || (std::isinf(x[i]) && !(std::abs(static_cast<double>(w.data<float>()[i])) > 0.5 * largest)))
      __builtin_trap();
  }
}

// check_finite_or_overflow on the three gradients of an attention backward; wide() computes the
// same backward on float32 copies, at most once (only where a 16-bit gradient is not finite).
template <class Wide>
inline void check_gradients(const mha::AttentionGradients& grads, const Wide& wide) {
  std::optional<mha::AttentionGradients> widened_grads;
  auto get = [&]() -> const mha::AttentionGradients& {
    if (!widened_grads) widened_grads = wide();
    return *widened_grads;
  };
  check_finite_or_overflow(grads.query, [&] { return get().query; });
  check_finite_or_overflow(grads.key, [&] { return get().key; });
  check_finite_or_overflow(grads.value, [&] { return get().value; });
}

// `call` must throw mha::Error.
template <class F> inline void must_refuse(F&& call) {
  try {
    call();
  } catch (const mha::Error&) {
    return;
  }
  __builtin_trap();
}

// The SDPA options besides the mask: causality, alignment, scale (NaN too), GQA, dropout, threads.
inline void fuzz_options(FuzzInput& in, mha::SdpaOptions& o) {
  o.is_causal = in.flag();
  o.causal_alignment = in.flag() ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (in.flag()) o.scale = in.small(7) == 0 ? std::nan("") : in.value();
  o.enable_gqa = in.flag();
  o.dropout_p = in.small(4) == 0 ? in.value() : 0.0;
  o.dropout_seed = in.byte();
  o.num_threads = static_cast<int>(in.small(4)) - 1;  // -1 (refused) to 3
  // A sliding window (read from the end: kept inputs keep their meaning): none, one side or both,
  // from -2 (refused) to a few keys.
  const uint8_t w = in.tail_byte();
  if (w % 4 == 1 || w % 4 == 3) o.window_left = (w >> 2) % 9 - 2;
  if (w % 4 == 2 || w % 4 == 3) o.window_right = (w >> 5) % 5 - 2;
  // ALiBi's slopes (the next tail byte): none, or a shape that fits the call or not (of 0 to 7
  // elements, up to 3 dimensions), float32, float64 or bfloat16, values in [-1, 1] or inf or NaN
  // (refused).
  const uint8_t a = in.tail_byte();
  if (a % 3 != 0) {
    static thread_local mha::Tensor slopes;
    static const mha::Shape shapes[] = {{1}, {2}, {3}, {4}, {0}, {2, 3}, {1, 3}, {2, 1}, {7}, {1, 1, 2}};
    static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::f64, mha::DType::bf16};
    mha::Tensor values = mha::Tensor::empty(shapes[(a >> 2) % 10]);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<float>()[i] = static_cast<float>((a >> 4) + i) / 8.0f - 1.0f;
    if (values.numel() > 0 && (a >> 6) == 3) values.data<float>()[0] = a % 2 ? INFINITY : NAN;
    slopes = mha::Tensor::copy_of(values.view(), dtypes[(a >> 6) % 4 == 3 ? 0 : (a >> 4) % 4]);
    o.alibi_slopes = slopes.view();
  }
  // Attention sinks (the next tail byte): none, or a shape that fits the call or not (0 to 8
  // elements), float32, float64 or bfloat16, values of either sign, large, or inf or NaN (refused).
  const uint8_t k = in.tail_byte();
  if (k % 4 == 1) {
    static thread_local mha::Tensor sinks;
    static const mha::Shape shapes[] = {{1}, {2}, {3}, {4}, {0}, {2, 2}, {8}, {6}};
    static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::f64, mha::DType::bf16};
    mha::Tensor values = mha::Tensor::empty(shapes[(k >> 2) % 8]);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<float>()[i] = static_cast<float>((k >> 5) * 7 - 20 + i);
    if (values.numel() > 0 && (k >> 5) == 7) values.data<float>()[0] = k % 8 == 5 ? INFINITY : NAN;
    sinks = mha::Tensor::copy_of(values.view(), dtypes[(k >> 5) % 4]);
    o.sinks = sinks.view();
  }
  // Logit soft-capping (the next tail byte): none, a cap from the smallest to the largest taken,
  // or negative, NaN or past the largest (refused).
  const uint8_t c = in.tail_byte();
  if (c % 4 == 1) {
    static const double caps[] = {1e-30, 0.5, 3.0, 50.0, 1e30, -1.0, std::nan(""), 2e30};
    o.softcap = caps[(c >> 2) % 8];
  }
  // float8 dequantisation scales (the next tail byte): none, k_descale, v_descale or both, of a
  // shape that fits the call or not, float32, float64 or bfloat16, positive, or 0, negative, inf
  // or NaN (refused); taken only with float8 keys and values.
  const uint8_t d = in.tail_byte();
  if (d % 4 != 0) {
    static thread_local mha::Tensor scales;
    static const mha::Shape shapes[] = {{}, {1}, {2}, {3}, {2, 2}, {0}, {1, 2}, {4, 1}};
    static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::f64, mha::DType::bf16};
    static const float bad[] = {0.0f, -1.0f, INFINITY, NAN};
    mha::Tensor values = mha::Tensor::empty(shapes[(d >> 2) % 8]);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<float>()[i] = 0.25f * static_cast<float>(i + 1);
    if (values.numel() > 0 && (d >> 5) % 2) values.data<float>()[values.numel() - 1] = bad[(d >> 6) % 4];
    scales = mha::Tensor::copy_of(values.view(), dtypes[(d >> 6) % 4 == 3 ? 0 : (d >> 5) % 4]);
    if (d % 4 != 2) o.k_descale = scales.view();
    if (d % 4 != 1) o.v_descale = scales.view();
  }
}

}  // namespace fuzz_args
