// Freed memory blocks kept for reuse, by exact (rounded) size, up to a cap: the host's
// (host_memory.cpp) and each CUDA device's (cuda/device_memory.cu). A call that allocates the
// same large buffers every time (a module's projections, a backward's gradients) then gets them
// back without the system's cost: page faults and zeroing on the host, cudaMalloc and the device
// synchronisation of cudaFree on a GPU. `Release` returns a block to the system.
#pragma once

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace mha::detail {

// A cache's cap from the environment variable `variable`, a whole number of MiB (default 1 GiB;
// 0 keeps nothing); anything else is an mha::Error naming the variable.
size_t cache_cap_from_environment(const char* variable);

template <class Release>
class BlockCache {
 public:
  explicit BlockCache(Release release) : release_(std::move(release)) {}

  // A kept block of exactly `bytes`, newest first (on the host its pages are the likeliest in
  // cache), or nullptr.
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = blocks_.size(); i-- > 0;) {
      if (blocks_[i].bytes == bytes) {
        void* p = blocks_[i].data;
        cached_ -= bytes;
        blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i));
        return p;
      }
    }
    return nullptr;
  }
  // Keeps the block, releasing the oldest ones to stay under `cap`.
  void give(void* p, size_t bytes, size_t cap) {
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (!blocks_.empty() && cached_ + bytes > cap) {
        evicted.push_back(blocks_.front().data);
        cached_ -= blocks_.front().bytes;
        blocks_.erase(blocks_.begin());
      }
      blocks_.push_back({p, bytes});
      cached_ += bytes;
    }
    for (void* e : evicted) release_(e);
  }
  void release_all() {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(blocks_);
      cached_ = 0;
    }
    for (const Block& b : blocks) release_(b.data);
  }
  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  Release release_;
  std::mutex mutex_;
  std::vector<Block> blocks_;  // oldest first
  size_t cached_ = 0;
};

}  // namespace mha::detail
