// Threads: one module shared by many user threads, the pool called from many threads and from a
// forked child, and exceptions thrown inside worker tasks reaching the caller.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/thread_pool.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

TEST(Concurrency, SharedModuleGivesTheSerialResults) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::MultiheadAttention m(32, 4, {.dropout = 0.2, .add_bias_kv = true, .seed = 5});
  const mha::Tensor x = mha_test::randn({40, 3, 32}, rng);
  std::vector<mha::Tensor> serial;
  for (uint64_t t = 0; t < 8; ++t) serial.push_back(m(x, x, x, {.is_causal = t % 2 == 1, .dropout_seed = t}).output);
  std::vector<mha::Tensor> parallel(8);
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        parallel[t] = m(x, x, x, {.is_causal = t % 2 == 1, .dropout_seed = t}).output;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 8; ++t) EXPECT_TRUE(mha_test::same_bits(parallel[t], serial[t])) << t;
}

TEST(Concurrency, ExceptionsInTasksReachTheCaller) {
  std::atomic<int> ran{0};
  EXPECT_THROW(mha::detail::parallel_for(100, 3,
                                         [&](int64_t i, int) {
                                           ++ran;
                                           if (i == 37) throw std::runtime_error("task 37");
                                         }),
               std::runtime_error);
  EXPECT_GE(ran.load(), 1);
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  mha::detail::parallel_for(1000, 3, [&](int64_t i, int) { sum += i; });
  EXPECT_EQ(sum.load(), 999 * 1000 / 2);
}

TEST(Concurrency, NestedCallsDoNotDeadlock) {
  std::atomic<int64_t> count{0};
  mha::detail::parallel_for(8, 3, [&](int64_t, int) {
    mha::detail::parallel_for(10, 3, [&](int64_t, int) { ++count; });
  });
  EXPECT_EQ(count.load(), 80);
}

TEST(Concurrency, ForkedChildComputesWithItsOwnPool) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor q = mha_test::randn({2, 4, 100, 16}, rng);
  const mha::Tensor expected = mha::scaled_dot_product_attention(q, q, q, {.num_threads = 3});  // pool running
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const mha::Tensor got = mha::scaled_dot_product_attention(q, q, q, {.num_threads = 3});
    _exit(mha_test::same_bits(got, expected) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // And the parent's pool is unaffected.
  EXPECT_TRUE(mha_test::same_bits(mha::scaled_dot_product_attention(q, q, q, {.num_threads = 3}), expected));
}

}  // namespace
