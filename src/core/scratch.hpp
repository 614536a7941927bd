// Per-thread scratch memory for the kernels: one 64-byte aligned buffer per thread, grown when a
// task needs more and reused by every later task on that thread, so a task costs no allocation.
#pragma once

#include <cstddef>

namespace mha::detail {

// Which of a thread's two buffers: the kernels' own, or one for a library that runs while the
// first is in use (oneDNN's scratchpad, as a projection block writes into the first).
enum class ScratchSlot { kernel, library };

// At least `bytes` bytes, 64-byte aligned, valid until the calling thread asks again for the same
// slot. Contents are whatever the previous task left: callers initialise what they read.
void* thread_scratch(size_t bytes, ScratchSlot slot = ScratchSlot::kernel);

}  // namespace mha::detail
