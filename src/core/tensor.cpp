#include "mha/tensor.hpp"

#include "core/device_memory.hpp"
#include "core/host_memory.hpp"
#include "cpu/convert_16bit.hpp"
#include "cpu/dispatch.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

namespace mha {

int64_t checked_numel(const Shape& shape, const std::string& what) {
  bool empty = false;
  for (int64_t s : shape) {
    if (s < 0) throw Error(what + ": sizes must be >= 0, got " + std::to_string(s));
    empty |= s == 0;
  }
  if (empty) return 0;  // whatever the other sizes, in any order
  int64_t n = 1;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) {
      std::ostringstream os;
      os << what << ": element count overflows 64 bits for shape [";
      for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
      os << "]";
      throw Error(os.str());
    }
  }
  return n;
}

TensorView::TensorView(const void* data_, DType dtype_, const Shape& shape_, const Shape& strides_)
    : data(const_cast<void*>(data_)), dtype(dtype_) {
  if (shape_.size() > static_cast<size_t>(kMaxDims)) {
    throw Error("TensorView: at most " + std::to_string(kMaxDims) + " dimensions, got " +
                std::to_string(shape_.size()));
  }
  if (!strides_.empty() && strides_.size() != shape_.size()) {
    throw Error("TensorView: strides must have one entry per dimension: " + std::to_string(shape_.size()) +
                " dimensions, " + std::to_string(strides_.size()) + " strides");
  }
  ndim = static_cast<int>(shape_.size());
  const int64_t n = checked_numel(shape_, "TensorView shape");
  int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    shape[d] = shape_[d];
    strides[d] = strides_.empty() ? running : strides_[d];
    if (strides[d] < 0) throw Error("TensorView: strides must be >= 0, got " + std::to_string(strides[d]));
    // Only an empty tensor (some size 0, which checked_numel allows) can overflow here; its
    // strides are never used to address anything.
    if (__builtin_mul_overflow(running, shape_[d], &running)) running = 0;
  }
  // The largest offset must be representable: sum of (size-1)*stride.
  int64_t max_offset = 0;
  for (int d = 0; d < ndim && n > 0; ++d) {
    int64_t term;
    if (__builtin_mul_overflow(shape[d] - 1, strides[d], &term) ||
        __builtin_add_overflow(max_offset, term, &max_offset)) {
      throw Error("TensorView: offsets overflow 64 bits for shape " + shape_str());
    }
  }
}

namespace {

// `data` advanced by `elements` of `dtype`. A null pointer stays null (views without data exist
// only to be validated, and must not be offset); an offset whose byte count overflows is an Error.
void* advance(void* data, int64_t elements, DType dtype) {
  if (data == nullptr) return nullptr;
  int64_t bytes;
  if (__builtin_mul_overflow(elements, dtype_size(dtype), &bytes)) throw Error("TensorView: offset overflows 64 bits");
  return static_cast<char*>(data) + bytes;
}

}  // namespace

int TensorView::normalize_dim(int dim) const {
  const int d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim) {
    throw Error("dimension " + std::to_string(dim) + " is out of range for a tensor with " + std::to_string(ndim) +
                " dimensions");
  }
  return d;
}

int64_t TensorView::numel() const {
  // A zero anywhere makes the count 0, whatever the other sizes (which may be absurd).
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 0) return 0;
  }
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) {
    if (__builtin_mul_overflow(n, shape[d], &n)) {
      throw Error("tensor of shape " + shape_str() + " has more elements than 64 bits can count");
    }
  }
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "]";
  return os.str();
}

TensorView TensorView::transpose(int a, int b) const {
  TensorView r = *this;
  const int da = normalize_dim(a), db = normalize_dim(b);
  std::swap(r.shape[da], r.shape[db]);
  std::swap(r.strides[da], r.strides[db]);
  return r;
}

TensorView TensorView::permute(const std::vector<int>& order) const {
  if (static_cast<int>(order.size()) != ndim) {
    throw Error("permute: expected " + std::to_string(ndim) + " dimensions in the order, got " +
                std::to_string(order.size()));
  }
  TensorView r = *this;
  std::array<bool, kMaxDims> seen{};
  for (int i = 0; i < ndim; ++i) {
    const int d = normalize_dim(order[i]);
    if (seen[d]) throw Error("permute: dimension " + std::to_string(d) + " appears twice");
    seen[d] = true;
    r.shape[i] = shape[d];
    r.strides[i] = strides[d];
  }
  return r;
}

TensorView TensorView::select(int dim, int64_t index) const {
  const int d = normalize_dim(dim);
  if (index < 0 || index >= shape[d]) {
    throw Error("select: index " + std::to_string(index) + " out of range for dimension " + std::to_string(d) +
                " of size " + std::to_string(shape[d]));
  }
  TensorView r = *this;
  // Within the view's checked extent; a view with no elements may carry strides whose products
  // overflow, and its pointer is never read, so it stays put.
  r.data = numel() == 0 ? data : advance(data, index * strides[d], dtype);
  for (int i = d; i + 1 < ndim; ++i) {
    r.shape[i] = shape[i + 1];
    r.strides[i] = strides[i + 1];
  }
  r.ndim = ndim - 1;
  r.shape[r.ndim] = 0;
  r.strides[r.ndim] = 0;
  return r;
}

TensorView TensorView::slice(int dim, int64_t start, int64_t stop) const {
  const int d = normalize_dim(dim);
  if (start < 0 || stop < start || stop > shape[d]) {
    throw Error("slice: range [" + std::to_string(start) + ", " + std::to_string(stop) +
                ") is not within dimension " + std::to_string(d) + " of size " + std::to_string(shape[d]));
  }
  TensorView r = *this;
  // An empty slice, or a slice of a view with no elements, stays put: its pointer is never read.
  r.data = (start < shape[d] && numel() != 0) ? advance(data, start * strides[d], dtype) : data;
  r.shape[d] = stop - start;
  return r;
}

TensorView TensorView::unsqueeze(int dim) const {
  if (ndim >= kMaxDims) throw Error("unsqueeze: already at the maximum of " + std::to_string(kMaxDims) + " dimensions");
  const int d = dim < 0 ? dim + ndim + 1 : dim;
  if (d < 0 || d > ndim) throw Error("unsqueeze: dimension " + std::to_string(dim) + " out of range");
  TensorView r = *this;
  for (int i = ndim; i > d; --i) {
    r.shape[i] = shape[i - 1];
    r.strides[i] = strides[i - 1];
  }
  r.shape[d] = 1;
  // Any stride works for size 1; the natural one where it is representable, else 0.
  int64_t natural = 1;
  if (d < ndim && __builtin_mul_overflow(strides[d], shape[d], &natural)) natural = 0;
  r.strides[d] = natural;
  r.ndim = ndim + 1;
  return r;
}

TensorView TensorView::split_dim(int dim, int64_t outer) const {
  const int d = normalize_dim(dim);
  if (ndim >= kMaxDims) throw Error("split_dim: already at the maximum of " + std::to_string(kMaxDims) + " dimensions");
  if (outer <= 0 || shape[d] % outer != 0) {
    throw Error("split_dim: dimension " + std::to_string(d) + " of size " + std::to_string(shape[d]) +
                " is not divisible into " + std::to_string(outer) + " parts");
  }
  TensorView r = *this;
  for (int i = ndim; i > d + 1; --i) {
    r.shape[i] = shape[i - 1];
    r.strides[i] = strides[i - 1];
  }
  const int64_t inner = shape[d] / outer;
  r.shape[d] = outer;
  // (outer - 1) * inner * stride lies within the view; only outer == 1 can overflow, and a
  // dimension of size 1 takes any stride.
  int64_t outer_stride = 0;
  if (__builtin_mul_overflow(strides[d], inner, &outer_stride)) outer_stride = 0;
  r.strides[d] = outer_stride;
  r.shape[d + 1] = inner;
  r.strides[d + 1] = strides[d];
  r.ndim = ndim + 1;
  return r;
}

namespace {

double load(const void* base, DType t, int64_t offset) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[offset];
    case DType::f64: return static_cast<const double*>(base)[offset];
    case DType::bf16: return static_cast<float>(static_cast<const bfloat16*>(base)[offset]);
    case DType::f16: return static_cast<float>(static_cast<const float16*>(base)[offset]);
    case DType::boolean: return static_cast<const uint8_t*>(base)[offset] != 0 ? 1.0 : 0.0;  // any nonzero byte
    case DType::f8e4m3: return static_cast<float>(static_cast<const float8_e4m3*>(base)[offset]);
    case DType::f8e5m2: return static_cast<float>(static_cast<const float8_e5m2*>(base)[offset]);
  }
  return 0;
}

void store(void* base, DType t, int64_t offset, double value) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[offset] = static_cast<float>(value); break;
    case DType::f64: static_cast<double*>(base)[offset] = value; break;
    case DType::bf16: static_cast<bfloat16*>(base)[offset] = bfloat16(static_cast<float>(value)); break;
    case DType::f16: static_cast<float16*>(base)[offset] = float16(static_cast<float>(value)); break;
    case DType::boolean: static_cast<bool*>(base)[offset] = value != 0.0; break;
    case DType::f8e4m3: static_cast<float8_e4m3*>(base)[offset] = float8_e4m3(static_cast<float>(value)); break;
    case DType::f8e5m2: static_cast<float8_e5m2*>(base)[offset] = float8_e5m2(static_cast<float>(value)); break;
  }
}

// dst[i] = src[i] through float, for the conversions between float32 and the 16-bit types.
template <class Src, class Dst>
void convert_span(const void* src, void* dst, int64_t n) {
  const Src* a = static_cast<const Src*>(src);
  Dst* b = static_cast<Dst*>(dst);
  for (int64_t i = 0; i < n; ++i) b[i] = Dst(static_cast<float>(a[i]));
}

using SpanCopy = void (*)(const void* src, void* dst, int64_t n);

template <class T>
void move_span(const void* src, void* dst, int64_t n) {
  std::memmove(dst, src, static_cast<size_t>(n) * sizeof(T));  // the two may be one
}

// How n elements go from a unit-stride span of dtype a to one of dtype b: a memmove or a typed
// loop that the compiler vectorises, instead of a dtype switch per element. Null for the pairs it
// does not cover (bool goes element-wise: any nonzero byte becomes exactly 1).
// Whether the 16-bit conversions run in vectors (the same bits): on AVX2 and above. A bad MHA_ISA
// is the kernels' error to report; copies then take the scalar loops.
bool vector_conversions() {
  try {
    return detail::active_isa() >= detail::Isa::avx2;
  } catch (const Error&) {
    return false;
  }
}

SpanCopy span_copy(DType a, DType b) {
  if (vector_conversions()) {
    if (a == DType::f16 && b == DType::f32) return detail::widen_f16_avx2;
    if (a == DType::f32 && b == DType::f16) return detail::narrow_f16_avx2;
    if (a == DType::f32 && b == DType::bf16) return detail::narrow_bf16_avx2;
  }
  if (a == b && a == DType::f32) return move_span<float>;
  if (a == b && a == DType::f64) return move_span<double>;
  if (a == b && (a == DType::bf16 || a == DType::f16)) return move_span<uint16_t>;
  if (a == b && is_float8(a)) return move_span<uint8_t>;
  if (a == DType::f8e5m2 && b == DType::f32) return convert_span<float8_e5m2, float>;
  if (a == DType::f32 && b == DType::f8e5m2) return convert_span<float, float8_e5m2>;
  if (a == DType::f8e4m3 && b == DType::f32) return convert_span<float8_e4m3, float>;
  if (a == DType::f32 && b == DType::f8e4m3) return convert_span<float, float8_e4m3>;
  if (a == DType::bf16 && b == DType::f32) return convert_span<bfloat16, float>;
  if (a == DType::f16 && b == DType::f32) return convert_span<float16, float>;
  if (a == DType::f32 && b == DType::bf16) return convert_span<float, bfloat16>;
  if (a == DType::f32 && b == DType::f16) return convert_span<float, float16>;
  return nullptr;
}

// The offsets (in elements) of the same index in two views of one shape, walked in row-major
// order over their leading `dims` dimensions.
struct PairedOffsets {
  const TensorView& a;
  const TensorView& b;
  int dims;
  std::array<int64_t, kMaxDims> idx{};
  int64_t a_offset = 0, b_offset = 0;

  void advance() {  // odometer increment
    for (int d = dims - 1; d >= 0; --d) {
      ++idx[d];
      a_offset += a.strides[d];
      b_offset += b.strides[d];
      if (idx[d] < a.shape[d]) return;
      a_offset -= a.strides[d] * a.shape[d];
      b_offset -= b.strides[d] * b.shape[d];
      idx[d] = 0;
    }
  }
};

// The common cases of copy_into: both sides contiguous (one span), or both with a unit-stride last
// dimension, as a transposed or sliced view of rows has (one span per row). False where neither
// applies.
bool copy_spans(const TensorView& src, const TensorView& dst, int64_t n) {
  const SpanCopy copy = span_copy(src.dtype, dst.dtype);
  if (copy == nullptr) return false;
  if (src.is_contiguous() && dst.is_contiguous()) {
    copy(src.data, dst.data, n);
    return true;
  }
  const int last = src.ndim - 1;
  const int64_t len = src.shape[last];
  if (len > 1 && (src.strides[last] != 1 || dst.strides[last] != 1)) return false;
  const int64_t a_size = dtype_size(src.dtype), b_size = dtype_size(dst.dtype);
  PairedOffsets at{src, dst, last};
  for (int64_t row = 0; row < n / len; ++row, at.advance()) {
    copy(static_cast<const char*>(src.data) + at.a_offset * a_size, static_cast<char*>(dst.data) + at.b_offset * b_size,
         len);
  }
  return true;
}

}  // namespace

void require_cpu(const TensorView& t, const std::string& name) {
  if (!t.device.is_cpu()) {
    throw Error(name + ": expected a tensor in host (cpu) memory, got one on " + t.device.str() +
                " (this function runs on the CPU; copy with Tensor::to(Device::cpu()))");
  }
}

double TensorView::at(const std::vector<int64_t>& index) const {
  require_cpu(*this, "at");
  if (static_cast<int>(index.size()) != ndim) {
    throw Error("at: expected " + std::to_string(ndim) + " indices, got " + std::to_string(index.size()));
  }
  int64_t offset = 0;
  for (int d = 0; d < ndim; ++d) {
    if (index[d] < 0 || index[d] >= shape[d]) {
      throw Error("at: index " + std::to_string(index[d]) + " out of range for dimension " + std::to_string(d) +
                  " of size " + std::to_string(shape[d]));
    }
    offset += index[d] * strides[d];
  }
  return load(data, dtype, offset);
}

void copy_into(const TensorView& src, const TensorView& dst) {
  if (src.sizes() != dst.sizes()) {
    throw Error("copy_into: shapes differ: source " + src.shape_str() + ", destination " + dst.shape_str());
  }
  require_cpu(src, "copy_into: source");
  require_cpu(dst, "copy_into: destination");
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.data == nullptr || dst.data == nullptr) throw Error("copy_into: null data pointer");
  if (copy_spans(src, dst, n)) return;
  PairedOffsets at{src, dst, src.ndim};
  for (int64_t e = 0; e < n; ++e, at.advance()) {
    store(dst.data, dst.dtype, at.b_offset, load(src.data, src.dtype, at.a_offset));
  }
}

// Out of line, in a file of the baseline instruction set: a kernel file (compiled for AVX2 or
// AVX-512) that wrote Shape{...} itself defined a copy of the vector's constructor, which the
// linker could keep for every caller (tests/check_isa_copies.py).
Tensor Tensor::empty(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  return empty(Shape(shape), dtype, device);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  const int64_t n = checked_numel(shape, "Tensor::empty");
  int64_t bytes;
  if (__builtin_mul_overflow(n, dtype_size(dtype), &bytes)) {
    throw Error("Tensor::empty: byte count overflows 64 bits");
  }
  // aligned_alloc wants a multiple of the alignment; a count within 63 of the int64 limit can
  // neither be rounded up nor allocated.
  if (bytes > std::numeric_limits<int64_t>::max() - 63) {
    throw Error("Tensor::empty: cannot allocate " + std::to_string(bytes) + " bytes for shape " +
                TensorView(nullptr, dtype, shape).shape_str());
  }
  Tensor t;
  const size_t alloc = static_cast<size_t>((bytes + 63) / 64 * 64);
  if (!device.is_cpu()) {
    if (bytes > 0) t.storage_ = detail::device_allocate(bytes, device);
    t.view_ = TensorView(t.storage_.get(), dtype, shape).on(device);
    t.defined_ = true;
    return t;
  }
  if (alloc > 0) {
    t.storage_ = detail::host_allocate(alloc);
    if (t.storage_ == nullptr) {
      throw Error("Tensor::empty: cannot allocate " + std::to_string(bytes) + " bytes for shape " +
                  TensorView(nullptr, dtype, shape).shape_str());
    }
  }
  t.view_ = TensorView(t.storage_.get(), dtype, shape);
  t.defined_ = true;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (t.numel() > 0) std::memset(t.storage_.get(), 0, static_cast<size_t>(t.numel() * dtype_size(dtype)));
  return t;
}

Tensor Tensor::to(Device device) const {
  if (!defined_) throw Error("Tensor::to: the tensor is undefined");
  const int64_t bytes = numel() * dtype_size(dtype());
  if (view_.device == device) return clone_on_device();
  if (view_.device.is_cpu()) {
    const Tensor host = view_.is_contiguous() ? *this : clone();
    Tensor t = empty(sizes(), dtype(), device);
    if (bytes > 0) detail::copy_host_to_device(host.view_.data, t.view_.data, bytes, device);
    return t;
  }
  if (!device.is_cpu()) {
    throw Error("Tensor::to: copies between two devices (" + view_.device.str() + " to " + device.str() +
                ") go through the host: .to(Device::cpu()).to(device)");
  }
  Tensor t = empty(sizes(), dtype());
  if (bytes > 0) detail::copy_device_to_host(view_.data, t.view_.data, bytes, view_.device);
  return t;
}

Tensor Tensor::clone_on_device() const {
  if (view_.device.is_cpu()) return clone();
  return to(Device::cpu()).to(view_.device);
}

Tensor Tensor::copy_of(const TensorView& src, DType dtype) {
  require_cpu(src, "copy_of");
  Tensor t = empty(src.sizes(), dtype);
  copy_into(src, t.view());
  return t;
}

}  // namespace mha
