// Every CUDA runtime call goes through MHA_CUDA_CHECK: a failure becomes an mha::Error naming the
// call and CUDA's message, never a silently ignored status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "mha/error.hpp"

#define MHA_CUDA_CHECK(call)                                                                          \
  do {                                                                                                \
    const cudaError_t mha_status_ = (call);                                                           \
    if (mha_status_ != cudaSuccess) {                                                                 \
      throw ::mha::Error(std::string(#call) + " failed: " + cudaGetErrorString(mha_status_));         \
    }                                                                                                 \
  } while (0)

namespace mha::detail {

// Makes `index` the current device for the scope, restoring the previous one after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    MHA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (index != previous_) MHA_CUDA_CHECK(cudaSetDevice(index));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mha::detail
