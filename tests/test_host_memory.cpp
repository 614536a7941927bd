// The host block cache behind Tensor: large blocks are reused for same-size requests, the cap
// holds, release_host_cache() empties it, MHA_HOST_CACHE_MB=0 turns it off and a malformed value
// is an error. (AddressSanitizer builds run without the cache, so that a use after free shows.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "mha/mha.hpp"

namespace {

std::string cache_setting() {
  const char* env = std::getenv("MHA_HOST_CACHE_MB");
  return env ? env : "";
}

TEST(HostCache, LargeBlocksAreReusedUpToTheCap) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the cache is off under AddressSanitizer";
#endif
  if (cache_setting() == "0" || !cache_setting().empty()) GTEST_SKIP() << "run with the default cache";
  mha::release_host_cache();
  const void* first;
  {
    const mha::Tensor t = mha::Tensor::empty({3, 1000, 1000});  // 12 MB
    first = t.data<float>();
  }
  EXPECT_GE(mha::host_cache_bytes(), 12'000'000u);
  {
    const mha::Tensor again = mha::Tensor::empty({1000, 3000});  // the same size: the same block
    EXPECT_EQ(again.data<float>(), first);
    EXPECT_EQ(mha::host_cache_bytes(), 0u);
    const mha::Tensor other = mha::Tensor::empty({1000, 3100});  // a different size: a new block
    EXPECT_NE(other.data<float>(), first);
  }
  const mha::Tensor small = mha::Tensor::empty({1000});  // below 1 MiB: never cached
  EXPECT_GE(mha::host_cache_bytes(), 24'000'000u);
  // Three 400 MiB blocks (never touched, so never resident) against the 1 GiB cap: the oldest goes.
  {
    const mha::Tensor a = mha::Tensor::empty({100, 1 << 20}), b = mha::Tensor::empty({100, 1 << 20}),
                      c = mha::Tensor::empty({100, 1 << 20});
  }
  EXPECT_LE(mha::host_cache_bytes(), size_t{1} << 30);
  EXPECT_GE(mha::host_cache_bytes(), size_t{800} << 20);
  mha::release_host_cache();
  EXPECT_EQ(mha::host_cache_bytes(), 0u);
}

TEST(HostCache, SettingFromTheEnvironment) {
  const std::string setting = cache_setting();
  if (setting.empty()) GTEST_SKIP() << "MHA_HOST_CACHE_MB not set (the ctest entries set it)";
  if (setting == "0") {
    { const mha::Tensor t = mha::Tensor::empty({4, 1 << 20}); }
    EXPECT_EQ(mha::host_cache_bytes(), 0u);
    return;
  }
  try {
    const mha::Tensor t = mha::Tensor::empty({4, 1 << 20});
    ADD_FAILURE() << "expected an mha::Error for MHA_HOST_CACHE_MB=" << setting;
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MHA_HOST_CACHE_MB: expected a whole number"), std::string::npos) << e.what();
  }
}

}  // namespace
