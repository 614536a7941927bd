// The CUDA entry points of a build without the CUDA backend: each is an mha::Error that says so.
#ifndef MHA_WITH_CUDA

#include "core/device_memory.hpp"
#include "cuda/cuda_attention.hpp"
#include "mha/cuda.hpp"

namespace mha {
namespace {

[[noreturn]] void no_cuda(const std::string& what) {
  throw Error(what + ": this build of mha has no CUDA backend (configure with a CUDA toolkit and MHA_CUDA=ON)");
}

}  // namespace

namespace cuda {
bool is_built() { return false; }
bool is_available() { return false; }
int device_count() { return 0; }
int compute_capability(int) { return 0; }
std::string describe(int) { return "no CUDA backend in this build"; }
void synchronize(int device) { no_cuda("synchronizing cuda:" + std::to_string(device)); }
size_t cached_bytes(int) { return 0; }
void release_cache(int) {}
}  // namespace cuda

namespace detail {
std::shared_ptr<std::byte> device_allocate(int64_t, Device device) { no_cuda("allocating on " + device.str()); }
void copy_host_to_device(const void*, void*, int64_t, Device device) { no_cuda("copying to " + device.str()); }
void copy_device_to_host(const void*, void*, int64_t, Device device) { no_cuda("copying from " + device.str()); }
void cuda_attention_forward(const AttentionProblem& p, const TensorView&, float*) {
  no_cuda("attention on " + p.q.device.str());
}
void cuda_attention_backward(const AttentionProblem& p, const CudaBackwardViews&) {
  no_cuda("the attention backward on " + p.q.device.str());
}
}  // namespace detail

}  // namespace mha

#endif  // MHA_WITH_CUDA
