// Device memory for Tensor over the CUDA runtime, and what mha::cuda reports about the machine.
#include <string>
#include <vector>

#include "core/block_cache.hpp"
#include "core/device_memory.hpp"
#include "cuda/cuda_check.hpp"
#include "mha/cuda.hpp"

namespace mha {
namespace cuda {

bool is_built() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky status, report none
    return 0;
  }
  return n;
}

bool is_available() { return device_count() > 0; }

int compute_capability(int device) {
  if (device < 0 || device >= device_count()) return 0;
  int major = 0, minor = 0;
  MHA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MHA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

std::string describe(int device) {
  const int n = device_count();
  if (device < 0 || device >= n) {
    return "no CUDA device " + std::to_string(device) + " (" + std::to_string(n) + " present)";
  }
  cudaDeviceProp prop{};
  MHA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." +
         std::to_string(prop.minor) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
}

void synchronize(int device) {
  const int n = device_count();
  if (device < 0 || device >= n) {
    throw Error("synchronize: no CUDA device " + std::to_string(device) + " (" + std::to_string(n) + " present)");
  }
  detail::DeviceGuard guard(device);
  MHA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace cuda

namespace detail {
namespace {

void check_device(Device device) {
  const int n = cuda::device_count();
  if (device.type != DeviceType::cuda || device.index < 0 || device.index >= n) {
    throw Error("device: " + device.str() + " is not a CUDA device of this machine (" + std::to_string(n) +
                " present)");
  }
}

// Returns a block to the driver on its own device (a deleter: it must not throw, and a failure
// has nowhere to go).
struct DeviceFree {
  int index;
  void operator()(void* p) const {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(index);
    cudaFree(p);
    cudaSetDevice(previous);
  }
};
using DeviceBlockCache = BlockCache<DeviceFree>;

// One cache per device, made on first use and never destroyed (tensors freed during static
// destruction still find theirs).
DeviceBlockCache& device_cache(int index) {
  static std::vector<DeviceBlockCache*>* caches = [] {
    auto* v = new std::vector<DeviceBlockCache*>();
    for (int d = 0; d < cuda::device_count(); ++d) v->push_back(new DeviceBlockCache(DeviceFree{d}));
    return v;
  }();
  return *caches->at(static_cast<size_t>(index));
}

}  // namespace

std::shared_ptr<std::byte> device_allocate(int64_t bytes, Device device) {
  check_device(device);
  // MHA_CUDA_CACHE_MB: how much freed memory each device keeps (0 keeps none, as
  // compute-sanitizer's runs want, so that every free is seen); read once, as the host cache's.
  static const size_t cap = cache_cap_from_environment("MHA_CUDA_CACHE_MB");
  const int index = device.index;
  // Rounded so that near sizes share blocks: 512 bytes below 1 MiB, 2 MiB above (cudaMalloc's
  // own granule for large blocks).
  const size_t granule = static_cast<size_t>(bytes) < (size_t{1} << 20) ? 512 : size_t{2} << 20;
  const size_t rounded = (static_cast<size_t>(bytes) + granule - 1) / granule * granule;
  const bool cached = rounded <= cap;
  DeviceGuard guard(index);
  void* p = cached ? device_cache(index).take(rounded) : nullptr;
  if (p == nullptr) {
    cudaError_t status = cudaMalloc(&p, cached ? rounded : static_cast<size_t>(bytes));
    if (status == cudaErrorMemoryAllocation) {  // the kept blocks may be what fills the device
      cudaGetLastError();
      device_cache(index).release_all();
      status = cudaMalloc(&p, cached ? rounded : static_cast<size_t>(bytes));
    }
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw Error("Tensor::empty: cannot allocate " + std::to_string(bytes) + " bytes on " + device.str() + ": " +
                  cudaGetErrorString(status));
    }
  }
  if (cached) {
    // Kernels run in order on the device's default stream, so a block handed out again is
    // written only after the kernels that read it as a freed tensor have run.
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p),
                                      [index, rounded](std::byte* q) { device_cache(index).give(q, rounded, cap); });
  }
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [index](std::byte* q) { DeviceFree{index}(q); });
}

void copy_host_to_device(const void* host, void* dst, int64_t bytes, Device device) {
  check_device(device);
  DeviceGuard guard(device.index);
  MHA_CUDA_CHECK(cudaMemcpy(dst, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
}

void copy_device_to_host(const void* src, void* host, int64_t bytes, Device device) {
  check_device(device);
  DeviceGuard guard(device.index);
  MHA_CUDA_CHECK(cudaMemcpy(host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
}

}  // namespace detail
}  // namespace mha

namespace mha::cuda {

size_t cached_bytes(int device) {
  if (device < 0 || device >= device_count()) return 0;
  return detail::device_cache(device).cached_bytes();
}

void release_cache(int device) {
  if (device < 0 || device >= device_count()) return;
  detail::device_cache(device).release_all();
}

}  // namespace mha::cuda
