// Host memory for Tensor, with the large blocks kept for reuse. A module call allocates the same
// large buffers on every call (projections, attention output, the backward's gradients), and a
// freshly mapped block costs a page fault and a page zeroing per 4 KiB on first touch: measured,
// 15% of a training step of the module (E = 1024, L = 512) was spent in the kernel doing that.
// Freed blocks of at least 1 MiB are kept, up to a cap, and handed out again for a request of the
// same rounded size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace mha::detail {

// `bytes` bytes, 64-byte aligned; nullptr for 0 bytes or when memory runs out. A malformed
// MHA_HOST_CACHE_MB is an mha::Error.
std::shared_ptr<std::byte> host_allocate(size_t bytes);

}  // namespace mha::detail
