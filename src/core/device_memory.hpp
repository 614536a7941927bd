// Device memory for Tensor: allocation and host <-> device copies. Implemented over the CUDA
// runtime in src/cuda/device_memory.cu when the library is built with CUDA, and by
// src/core/without_cuda.cpp (every call an mha::Error) when it is not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mha/tensor.hpp"

namespace mha::detail {

// `bytes` of memory on `device` (256-byte aligned), freed when the last owner goes.
std::shared_ptr<std::byte> device_allocate(int64_t bytes, Device device);

// Plain byte copies between contiguous buffers; `device` names the CUDA side.
void copy_host_to_device(const void* host, void* dst, int64_t bytes, Device device);
void copy_device_to_host(const void* src, void* host, int64_t bytes, Device device);

}  // namespace mha::detail
