// Device memory for Tensor over the CUDA runtime, and what mha::cuda reports about the machine.
#include <string>

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

}  // namespace

std::shared_ptr<std::byte> device_allocate(int64_t bytes, Device device) {
  check_device(device);
  DeviceGuard guard(device.index);
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw Error("Tensor::empty: cannot allocate " + std::to_string(bytes) + " bytes on " + device.str() + ": " +
                cudaGetErrorString(status));
  }
  const int index = device.index;
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [index](std::byte* q) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(index);
    cudaFree(q);  // a deleter must not throw; a failure here has nowhere to go
    cudaSetDevice(previous);
  });
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
