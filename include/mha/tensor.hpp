// Tensors: a non-owning strided view (TensorView) and an owning, contiguous Tensor.
//
// Strides are in elements, not bytes, and may be zero (broadcast) or any positive value, so a
// [B, L, H, D] buffer viewed as [B, H, L, D], a sequence-first input, or one third of a packed
// QKV projection are all plain views: no API of the library needs a copy to accept them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "mha/dtype.hpp"
#include "mha/error.hpp"

namespace mha {

inline constexpr int kMaxDims = 6;

using Shape = std::vector<int64_t>;

// Where a tensor's data lives. CUDA memory is reachable only where the library was built with
// CUDA (cuda::is_available() in mha/cuda.hpp); the CPU functions refuse device data with an
// mha::Error naming the argument.
enum class DeviceType : uint8_t { cpu, cuda };
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // the CUDA ordinal

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  Device device{};

  TensorView() = default;
  // A view of `data` with the given shape; contiguous (row-major) strides when none are given.
  TensorView(const void* data, DType dtype, const Shape& shape, const Shape& strides = {});
  template <class T>
  TensorView(const T* data, const Shape& shape, const Shape& strides = {})
      : TensorView(static_cast<const void*>(data), dtype_of<T>(), shape, strides) {}

  // Size and stride of a dimension; negative indices count from the end, as in PyTorch.
  int64_t size(int dim) const { return shape[normalize_dim(dim)]; }
  int64_t stride(int dim) const { return strides[normalize_dim(dim)]; }
  int64_t numel() const;
  bool is_contiguous() const;
  Shape sizes() const { return Shape(shape.begin(), shape.begin() + ndim); }
  std::string shape_str() const;  // "[2, 3, 4]"

  TensorView transpose(int a, int b) const;
  TensorView permute(const std::vector<int>& order) const;
  TensorView select(int dim, int64_t index) const;  // drops the dimension
  TensorView slice(int dim, int64_t start, int64_t stop) const;
  TensorView unsqueeze(int dim) const;
  // Splits dimension `dim` of size a*b into (a, b): [L, N, E] -> [L, N, H, E/H].
  TensorView split_dim(int dim, int64_t outer) const;
  // The same view of memory on `d` (for wrapping a device pointer: TensorView(ptr, ...).on(d)).
  TensorView on(Device d) const {
    TensorView r = *this;
    r.device = d;
    return r;
  }

  template <class T> T* data_as() const { return static_cast<T*>(data); }
  // The element at `index` (one entry per dimension), converted to double. For tests and tools.
  double at(const std::vector<int64_t>& index) const;

  int normalize_dim(int dim) const;
};

// Owns 64-byte aligned storage and a contiguous view of it. Copies share the storage
// (like a PyTorch tensor); use clone() for a deep copy.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
  // From a braced list of sizes, Tensor::empty({2, 3}): the shape is built inside the library.
  static Tensor empty(std::initializer_list<int64_t> shape, DType dtype = DType::f32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::f32);
  // A contiguous copy on `device` (host <-> CUDA), same dtype. Any strides on the host side;
  // a CUDA source must be contiguous.
  Tensor to(Device device) const;
  // A contiguous copy of any view, converted to `dtype`.
  static Tensor copy_of(const TensorView& src, DType dtype);
  static Tensor copy_of(const TensorView& src) { return copy_of(src, src.dtype); }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable as a view
  Tensor clone() const { return copy_of(view_); }

  bool defined() const { return defined_; }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int ndim() const { return view_.ndim; }
  int64_t size(int dim) const { return view_.size(dim); }
  Shape sizes() const { return view_.sizes(); }
  int64_t numel() const { return view_.numel(); }
  std::string shape_str() const { return view_.shape_str(); }
  template <class T> T* data() const { return view_.data_as<T>(); }
  double at(const std::vector<int64_t>& index) const { return view_.at(index); }

 private:
  Tensor clone_on_device() const;  // a deep copy on the same device

  std::shared_ptr<std::byte> storage_;
  TensorView view_;
  bool defined_ = false;
};

// Copies `src` into `dst` element by element (shapes must match), converting the dtype. Host
// memory only.
void copy_into(const TensorView& src, const TensorView& dst);

// mha::Error naming `name` unless `t` is in host memory: for functions that read the data.
void require_cpu(const TensorView& t, const std::string& name);

// Host blocks of 1 MiB and more are kept for reuse when their tensors go, so that repeated calls
// of one shape do not map (and fault in, and zero) fresh pages every time. The cache holds at most
// MHA_HOST_CACHE_MB MiB (default 1024; 0 turns it off), evicting the oldest blocks first.
size_t host_cache_bytes();  // bytes held now
void release_host_cache();  // returns them all to the system

// Product of `shape`, or mha::Error naming `what` if it is negative or overflows int64.
int64_t checked_numel(const Shape& shape, const std::string& what);

}  // namespace mha
