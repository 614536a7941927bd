#include "core/scratch.hpp"

#include <cstdlib>
#include <memory>
#include <new>

namespace mha::detail {

void* thread_scratch(size_t bytes, ScratchSlot slot) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> buffers[2];
  thread_local size_t capacities[2] = {};
  const int which = slot == ScratchSlot::kernel ? 0 : 1;
  std::unique_ptr<void, Free>& buffer = buffers[which];
  size_t& capacity = capacities[which];
  if (bytes > capacity) {
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    buffer.reset();  // free first: the peak is one buffer, not two
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      capacity = 0;
      throw std::bad_alloc();
    }
    buffer.reset(p);
    capacity = rounded;
  }
  return buffer.get();
}

}  // namespace mha::detail
