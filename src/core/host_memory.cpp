#include "core/host_memory.hpp"

#include <cstdlib>
#include <string>

#include "core/block_cache.hpp"
#include "mha/error.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {
namespace {

constexpr size_t kSmallest = size_t{1} << 20;  // smaller blocks come from malloc's own free lists
constexpr size_t kGranule = size_t{1} << 16;   // sizes are rounded up to 64 KiB, so near sizes share

// AddressSanitizer should see every free: a cached block would hide a use after free.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheEnabled = false;
#else
constexpr bool kCacheEnabled = true;
#endif

// Never destroyed: blocks freed by tensors that outlive static destruction still find it.
using HostBlockCache = BlockCache<void (*)(void*)>;
HostBlockCache& cache() {
  static HostBlockCache* c = new HostBlockCache([](void* p) { std::free(p); });
  return *c;
}

}  // namespace

size_t cache_cap_from_environment(const char* variable) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return size_t{1} << 30;  // 1 GiB
  char* end = nullptr;
  const long long mb = std::strtoll(env, &end, 10);
  if (*end != '\0' || mb < 0 || mb > (1ll << 30)) {
    throw Error(std::string(variable) + ": expected a whole number of MiB >= 0, got '" + env + "'");
  }
  return static_cast<size_t>(mb) << 20;
}

std::shared_ptr<std::byte> host_allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  // Read once; a bad MHA_HOST_CACHE_MB is an Error on every allocation until it is fixed.
  static const size_t configured = cache_cap_from_environment("MHA_HOST_CACHE_MB");
  const size_t cap = kCacheEnabled ? configured : 0;
  const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
  const bool cached = bytes >= kSmallest && rounded <= cap;
  bytes = cached ? rounded : (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  void* p = cached ? cache().take(bytes) : nullptr;
  if (p == nullptr) p = std::aligned_alloc(64, bytes);
  if (p == nullptr) return nullptr;
  auto* base = static_cast<std::byte*>(p);
  if (!cached) return std::shared_ptr<std::byte>(base, [](std::byte* q) { std::free(q); });
  return std::shared_ptr<std::byte>(base, [bytes, cap](std::byte* q) { cache().give(q, bytes, cap); });
}

}  // namespace mha::detail

namespace mha {

size_t host_cache_bytes() { return detail::cache().cached_bytes(); }
void release_host_cache() { detail::cache().release_all(); }

}  // namespace mha
