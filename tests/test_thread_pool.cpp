// The worker pool under many short jobs in a row: workers that spin between jobs, jobs whose
// tasks are all handed out before a helper wakes (it is then not waited for), and gaps longer
// than the spin, so that workers go to sleep and are woken again. Every task must run exactly
// once, each worker index below the thread count and never in use by two tasks at once.
// ctest runs this file again with MHA_SPIN_US=0 (workers always sleep) and with a malformed
// MHA_SPIN_US (a clear mha::Error).
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.hpp"
#include "mha/error.hpp"
#include "test_support.hpp"

namespace {

std::string spin_setting() {
  const char* env = std::getenv("MHA_SPIN_US");
  return env == nullptr ? "" : env;
}

bool spin_setting_is_malformed() {
  const std::string s = spin_setting();
  if (s.empty()) return false;
  char* end = nullptr;
  const long n = std::strtol(s.c_str(), &end, 10);
  return *end != '\0' || n < 0 || n > 10000;
}

TEST(Pool, ShortJobsInARowRunEveryTaskOnce) {
  if (spin_setting_is_malformed()) GTEST_SKIP() << "MHA_SPIN_US is malformed here (Pool.SpinSetting checks it)";
  const uint64_t seed = mha_test::test_seed();
  std::mt19937_64 rng(seed);
  constexpr int kMaxTasks = 24, kMaxThreads = 4;
  for (int job = 0; job < 3000; ++job) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % kMaxTasks);
    const int threads = 1 + static_cast<int>(rng() % kMaxThreads);
    const int work_ns = static_cast<int>(rng() % 4) * 2000;  // none, or a few microseconds per task
    std::array<std::atomic<int>, kMaxTasks> ran{};
    std::array<std::atomic<int>, kMaxThreads> busy{};
    std::atomic<int> bad_worker{-1}, shared_worker{-1};
    mha::detail::parallel_for(n, threads, [&](int64_t i, int worker) {
      if (worker < 0 || worker >= threads) {
        bad_worker = worker;
        return;
      }
      if (busy[worker].fetch_add(1) != 0) shared_worker = worker;
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(work_ns);
      while (std::chrono::steady_clock::now() < until) {
      }
      ran[i].fetch_add(1);
      busy[worker].fetch_sub(1);
    });
    ASSERT_EQ(bad_worker.load(), -1) << "job " << job << " threads " << threads << " seed " << seed;
    ASSERT_EQ(shared_worker.load(), -1) << "two tasks at once on one worker index; job " << job << " seed " << seed;
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ran[i].load(), 1) << "task " << i << " of job " << job << " seed " << seed;
    if (job % 500 == 499) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past any spin: workers sleep
  }
}

// Jobs from several user threads at once: one holds the pool, the others run their tasks on
// their own thread (parallel_for's contract), and every task still runs once.
TEST(Pool, JobsFromSeveralThreadsAtOnce) {
  if (spin_setting_is_malformed()) GTEST_SKIP() << "MHA_SPIN_US is malformed here (Pool.SpinSetting checks it)";
  std::atomic<int64_t> total{0};
  std::vector<std::thread> users;
  for (int u = 0; u < 3; ++u) {
    users.emplace_back([&] {
      for (int job = 0; job < 300; ++job) {
        std::atomic<int64_t> sum{0};
        mha::detail::parallel_for(17, 3, [&](int64_t i, int) { sum += i + 1; });
        total += sum.load() == 17 * 18 / 2 ? 1 : 0;
      }
    });
  }
  for (auto& t : users) t.join();
  EXPECT_EQ(total.load(), 3 * 300);
}

TEST(Pool, SpinSettingFromTheEnvironment) {
  const std::string setting = spin_setting();
  if (setting.empty()) GTEST_SKIP() << "MHA_SPIN_US not set (the ctest entries set it)";
  std::atomic<int64_t> count{0};
  auto job = [&] { mha::detail::parallel_for(8, 2, [&](int64_t, int) { ++count; }); };
  if (!spin_setting_is_malformed()) {
    job();
    EXPECT_EQ(count.load(), 8);
    return;
  }
  try {
    job();
    ADD_FAILURE() << "expected an mha::Error for MHA_SPIN_US=" << setting;
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MHA_SPIN_US: expected a whole number of microseconds"), std::string::npos)
        << e.what();
  }
}

}  // namespace
