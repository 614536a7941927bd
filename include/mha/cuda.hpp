// The CUDA backend: what this build and this machine offer.
//
// Built when CMake finds a CUDA toolkit (MHA_CUDA=AUTO, the default; ON requires it, OFF skips
// it). With it, scaled_dot_product_attention accepts views of CUDA memory (TensorView::on,
// Tensor::empty(shape, dtype, Device::cuda()), Tensor::to) and runs the fused GPU kernel:
// bfloat16 or float16 inputs, head dims 64, 128 and 256, causal in both alignments, GQA,
// Lq != Lk, bool and additive masks, the log-sum-exp for training. On Hopper (compute capability
// 9.0) head dim 128 without masks runs a wgmma kernel, everything else an mma.sync one;
// MHA_CUDA_KERNEL=mma in the environment forces the latter, =wgmma asks for the former wherever it
// can run (head dims 64 and 128 without masks; an mha::Error elsewhere).
// scaled_dot_product_attention_backward runs the GPU backward on such operands (deterministic).
//
// Device memory freed by tensors is kept per device for reuse, up to MHA_CUDA_CACHE_MB (default
// 1024; 0 keeps none), as PyTorch's caching allocator does: cudaMalloc and the synchronisation
// of cudaFree are paid once rather than per call.
#pragma once

#include <cstddef>
#include <string>

namespace mha::cuda {

// Whether the library was built with the CUDA backend.
bool is_built();
// Whether a CUDA device can be used now (built, a driver, at least one device).
bool is_available();
// The number of CUDA devices (0 without the backend or a driver).
int device_count();
// Compute capability as 10 * major + minor (90 on an H100), or 0 without such a device.
int compute_capability(int device = 0);
// "NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs", or why there is none.
std::string describe(int device = 0);
// Kernels are queued on the device's default stream and return at once, as in PyTorch; this
// waits for all of them to finish (and reports a failure of any as an mha::Error).
void synchronize(int device = 0);
// Bytes of freed device memory kept for reuse on `device`, and returning them to the driver
// (for other libraries in the process; both do nothing without such a device).
size_t cached_bytes(int device = 0);
void release_cache(int device = 0);

}  // namespace mha::cuda
