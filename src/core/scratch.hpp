// Per-thread scratch memory for the kernels: one 64-byte aligned buffer per thread, grown when a
// task needs more and reused by every later task on that thread, so a task costs no allocation.
#pragma once

#include <cstddef>

namespace mha::detail {

// At least `bytes` bytes, 64-byte aligned, valid until the calling thread asks again. Contents are
// whatever the previous task left: callers initialise what they read.
void* thread_scratch(size_t bytes);

}  // namespace mha::detail
