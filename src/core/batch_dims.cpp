#include "core/batch_dims.hpp"

#include <algorithm>
#include <array>

#include "core/thread_pool.hpp"

namespace mha::detail {
namespace {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The accumulation of sum_to_shape in Acc, reading `full` of element type Src.
template <class Src, class Acc>
void accumulate(const TensorView& full, const std::array<int64_t, kMaxDims>& acc_strides, Acc* acc) {
  const int n = full.ndim;
  const Src* src = full.data_as<const Src>();
  std::array<int64_t, kMaxDims> idx{};
  int64_t from = 0, to = 0;
  const int64_t count = full.numel();
  for (int64_t e = 0; e < count; ++e) {
    acc[to] += static_cast<Acc>(src[from]);
    for (int d = n - 1; d >= 0; --d) {  // odometer increment
      from += full.strides[d];
      to += acc_strides[d];
      if (++idx[d] < full.shape[d]) break;
      from -= full.strides[d] * full.shape[d];
      to -= acc_strides[d] * full.shape[d];
      idx[d] = 0;
    }
  }
}

// The same sums, row by row, where the last dimension is kept with unit stride on both sides (every
// gradient the backward reduces: an input's batch or head dimensions, a mask's batch, head or query
// dimensions). A task per run of target rows; each target row adds its full rows in the order of
// their indices over the summed dimensions, the order in which the element-wise loop above meets
// them, so the bits are that loop's on any thread count. Element-wise, the single-threaded loop
// took 100 ms of a 260 ms backward at B=8 H=16 L=512 with a [1, H, L, L] mask's gradient.
template <class Src, class Acc>
void accumulate_rows(const TensorView& full, const std::array<int64_t, kMaxDims>& acc_strides, Acc* acc,
                     int threads) {
  const int outer = full.ndim - 1;
  const int64_t cols = full.shape[outer];
  std::array<int, kMaxDims> kept{}, summed{};
  int n_kept = 0, n_summed = 0;
  int64_t target_rows = 1, per_row = 1;
  for (int d = 0; d < outer; ++d) {
    if (acc_strides[d] != 0) kept[n_kept++] = d, target_rows *= full.shape[d];
    else if (full.shape[d] > 1) summed[n_summed++] = d, per_row *= full.shape[d];
  }
  const Src* src = full.data_as<const Src>();
  // Target rows per task: about 64 Ki elements of the full tensor each.
  const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols * per_row));
  parallel_for((target_rows + rows_per_task - 1) / rows_per_task, threads, [&](int64_t task, int) {
    const int64_t r_end = std::min(target_rows, (task + 1) * rows_per_task);
    for (int64_t r = task * rows_per_task; r < r_end; ++r) {
      int64_t from0 = 0, to = 0, rest = r;
      for (int i = n_kept - 1; i >= 0; --i) {  // r in the kept dimensions' mixed radix, the last fastest
        const int d = kept[i];
        from0 += (rest % full.shape[d]) * full.strides[d];
        to += (rest % full.shape[d]) * acc_strides[d];
        rest /= full.shape[d];
      }
      Acc* dst = acc + to;
      for (int64_t c = 0; c < per_row; ++c) {
        int64_t from = from0, left = c;
        for (int i = n_summed - 1; i >= 0; --i) {  // c in the summed dimensions' mixed radix, the last fastest
          const int d = summed[i];
          from += (left % full.shape[d]) * full.strides[d];
          left /= full.shape[d];
        }
        const Src* row = src + from;
        for (int64_t j = 0; j < cols; ++j) dst[j] += static_cast<Acc>(row[j]);
      }
    }
  });
}

}  // namespace

Shape broadcast_shapes(const std::vector<Shape>& shapes, const std::string& what) {
  size_t n = 0;
  for (const Shape& s : shapes) n = std::max(n, s.size());
  Shape r(n, 1);
  for (const Shape& s : shapes) {
    for (size_t i = 0; i < s.size(); ++i) {
      int64_t& dim = r[n - s.size() + i];
      if (s[i] == dim || s[i] == 1) continue;
      if (dim != 1) {
        std::string all;
        for (size_t j = 0; j < shapes.size(); ++j) all += (j ? (j + 1 == shapes.size() ? " and " : ", ") : "") + shape_str(shapes[j]);
        throw Error(what + ": batch dimensions " + all + " do not broadcast");
      }
      dim = s[i];
    }
  }
  return r;
}

Shape batch_dims_of(const TensorView& t) {
  Shape s = t.sizes();
  s.resize(s.size() >= 2 ? s.size() - 2 : 0);
  return s;
}

std::optional<TensorView> fold_batch(const TensorView& t, const Shape& batch) {
  const int n = static_cast<int>(batch.size());
  const int tb = t.ndim - 2;  // t's batch dimensions, right-aligned against batch
  for (int ti = 0; ti < tb; ++ti) {
    const int i = ti + n - tb;
    if (t.shape[ti] != 1 && (i < 0 || t.shape[ti] != batch[i])) {
      throw Error("fold_batch: shape " + t.shape_str() + " does not broadcast to batch dimensions " + shape_str(batch));
    }
  }
  // The stride of batch dimension i in t: 0 where t lacks it or has size 1 there.
  auto stride_of = [&](int i) -> int64_t {
    const int ti = i - (n - tb);
    return ti < 0 || t.shape[ti] == 1 ? 0 : t.strides[ti];
  };
  // 0 when a leading dimension is 0, whatever the others (an empty batch of absurd size).
  const int64_t b_size = checked_numel(Shape(batch.begin(), batch.begin() + std::max(n - 1, 0)), "batch dimensions");
  int64_t b_stride = 0;
  int64_t inner_size = 1, inner_stride = 0;  // the innermost folded dimension with size > 1 so far
  bool any = false;
  for (int i = n - 2; i >= 0; --i) {  // the leading dimensions, innermost first
    if (batch[i] == 1) continue;
    const int64_t s = stride_of(i);
    int64_t next;  // the stride that continues the fold; one past int64 never does
    if (!any) {
      b_stride = s;
      any = true;
    } else if (__builtin_mul_overflow(inner_stride, inner_size, &next) || s != next) {
      return std::nullopt;
    }
    inner_size = batch[i], inner_stride = s;
  }
  const int64_t heads = n >= 1 ? batch[n - 1] : 1;
  const int64_t h_stride = n >= 1 && heads > 1 ? stride_of(n - 1) : 0;
  TensorView r = t;
  r.ndim = 4;
  r.shape = {};
  r.strides = {};
  r.shape[0] = b_size, r.shape[1] = heads, r.shape[2] = t.shape[t.ndim - 2], r.shape[3] = t.shape[t.ndim - 1];
  r.strides[0] = b_stride, r.strides[1] = h_stride;
  r.strides[2] = t.strides[t.ndim - 2], r.strides[3] = t.strides[t.ndim - 1];
  return r;
}

TensorView fold_batch_or_copy(const TensorView& t, const Shape& batch, Tensor& storage, const std::string& name) {
  if (auto folded = fold_batch(t, batch)) return *folded;
  if (!t.device.is_cpu()) {
    throw Error(name + ": on " + t.device.str() + " its batch dimensions must fold into one stride (a contiguous " +
                "tensor, or one expanded along whole leading dimensions); got shape " + t.shape_str());
  }
  // t expanded to the full batch shape (stride 0 where it broadcasts), then copied contiguous.
  Shape shape = batch, strides(batch.size() + 2, 0);
  shape.push_back(t.shape[t.ndim - 2]);
  shape.push_back(t.shape[t.ndim - 1]);
  const int n = static_cast<int>(batch.size()), tb = t.ndim - 2;
  for (int i = 0; i < n; ++i) {
    const int ti = i - (n - tb);
    if (ti >= 0 && t.shape[ti] != 1) strides[i] = t.strides[ti];
  }
  strides[n] = t.strides[t.ndim - 2];
  strides[n + 1] = t.strides[t.ndim - 1];
  storage = Tensor::copy_of(TensorView(t.data, t.dtype, shape, strides));
  return *fold_batch(storage.view(), batch);
}

Tensor sum_to_shape(const TensorView& full, const Shape& target, DType dtype, int threads) {
  require_cpu(full, "sum_to_shape");
  const int n = full.ndim, tn = static_cast<int>(target.size());
  if (tn > n) throw Error("sum_to_shape: target " + shape_str(target) + " has more dimensions than " + full.shape_str());
  const DType acc_dtype = dtype == DType::f64 || full.dtype == DType::f64 ? DType::f64 : DType::f32;
  Tensor acc = Tensor::zeros(target, acc_dtype);
  std::array<int64_t, kMaxDims> acc_strides{};  // over full's dimensions; 0 where target broadcasts
  for (int d = 0; d < n; ++d) {
    const int td = d - (n - tn);
    if (td < 0 || target[td] == 1) continue;
    if (target[td] != full.shape[d]) {
      throw Error("sum_to_shape: target " + shape_str(target) + " does not broadcast to " + full.shape_str());
    }
    acc_strides[d] = acc.view().strides[td];
  }
  if (full.dtype != DType::f32 && full.dtype != DType::f64) {
    throw Error("sum_to_shape: expected a float32 or float64 tensor, got " + std::string(dtype_name(full.dtype)));
  }
  if (full.numel() == 0) return dtype == acc_dtype ? acc : Tensor::copy_of(acc, dtype);  // empty sums: zeros
  const bool by_rows = n >= 1 && full.shape[n - 1] > 1 && full.strides[n - 1] == 1 && acc_strides[n - 1] == 1;
  auto sum = [&]<class Src, class Acc>(Acc* into) {
    if (by_rows) accumulate_rows<Src, Acc>(full, acc_strides, into, threads);
    else accumulate<Src, Acc>(full, acc_strides, into);
  };
  if (full.dtype == DType::f32 && acc_dtype == DType::f32) sum.operator()<float, float>(acc.data<float>());
  else if (full.dtype == DType::f32) sum.operator()<float, double>(acc.data<double>());
  else sum.operator()<double, double>(acc.data<double>());
  return dtype == acc_dtype ? acc : Tensor::copy_of(acc, dtype);
}

Tensor sum_to_input(const TensorView& full, const Shape& input, DType dtype, int threads) {
  const int n = static_cast<int>(input.size());
  if (full.ndim < 3 || n < 3) return sum_to_shape(full, input, dtype, threads);
  const int64_t heads = full.size(-3), own = input[n - 3];
  if (own <= 1 || own == heads || heads % own != 0) return sum_to_shape(full, input, dtype, threads);
  // Head h * r + j of `full` is repeat j of input head h: summed over j first (in that order),
  // into [..., own, rows, cols], then over what the input broadcasts along.
  if (full.dtype != DType::f32 && full.dtype != DType::f64) {
    throw Error("sum_to_input: expected a float32 or float64 tensor, got " + std::string(dtype_name(full.dtype)));
  }
  const Tensor dense = full.is_contiguous() ? Tensor() : Tensor::copy_of(full);
  const TensorView src = dense.defined() ? dense.view() : full;
  const int64_t repeats = heads / own, inner = full.size(-2) * full.size(-1);
  const int64_t outer = full.numel() / std::max<int64_t>(1, heads * inner);
  Shape grouped_shape = full.sizes();
  grouped_shape[full.ndim - 3] = own;
  Tensor grouped = Tensor::zeros(grouped_shape, full.dtype);
  auto sum_repeats = [&](auto* out, const auto* in) {
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t h = 0; h < own; ++h)
        for (int64_t j = 0; j < repeats; ++j) {
          const auto* from = in + ((o * heads) + h * repeats + j) * inner;
          auto* to = out + (o * own + h) * inner;
          for (int64_t e = 0; e < inner; ++e) to[e] += from[e];
        }
  };
  if (full.dtype == DType::f32) sum_repeats(grouped.data<float>(), src.data_as<const float>());
  else sum_repeats(grouped.data<double>(), src.data_as<const double>());
  return sum_to_shape(grouped.view(), input, dtype, threads);
}

}  // namespace mha::detail
