// Threads: one module shared by many user threads, the pool called from many threads and from a
// forked child, exceptions thrown inside worker tasks reaching the caller, and the pool's
// conversion copies matching the serial one.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel_copy.hpp"
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

// One module run by many threads at once, each on its own parameters (forward_with and
// backward_with, as mha.nn's modules do): each gets its parameters' results, as when run alone.
TEST(Concurrency, SharedModuleWithGivenParameters) {
  std::mt19937_64 rng(mha_test::test_seed());
  mha::MultiheadAttention m(32, 4, {.add_bias_kv = true, .seed = 5});
  const mha::Tensor x = mha_test::randn({40, 3, 32}, rng), grad = mha_test::randn({40, 3, 32}, rng);
  std::vector<std::vector<mha::Tensor>> owned(6);
  std::vector<mha::ParameterViews> params(6);
  std::vector<mha::Tensor> serial_out(6), serial_dx(6), out(6), dx(6);
  for (int t = 0; t < 6; ++t) {
    for (const auto& [name, p] : m.named_parameters()) {
      owned[t].push_back(mha_test::randn(p.sizes(), rng));
      params[t][name] = owned[t].back().view();
    }
    mha::ForwardContext ctx;
    serial_out[t] = m.forward_with(params[t], x, x, x, {}, &ctx).output;
    serial_dx[t] = m.backward_with(params[t], ctx, grad).query;
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        mha::ForwardContext ctx;
        out[t] = m.forward_with(params[t], x, x, x, {}, &ctx).output;
        dx[t] = m.backward_with(params[t], ctx, grad).query;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 6; ++t) {
    EXPECT_TRUE(mha_test::same_bits(out[t], serial_out[t])) << t;
    EXPECT_TRUE(mha_test::same_bits(dx[t], serial_dx[t])) << t;
  }
  EXPECT_FALSE(mha_test::same_bits(serial_out[0], serial_out[1]));
}

// The widening and rounding around the low-precision kernels: the serial copy's bits, for strided
// views, conversions both ways and shapes whose leading dimensions are 1 or odd, or whose first
// dimension is split into ranges of rows (a matrix of short rows).
TEST(Concurrency, ParallelCopyMatchesTheSerialCopy) {
  std::mt19937_64 rng(mha_test::test_seed());
  for (const mha::Shape& shape : std::vector<mha::Shape>{{3, 5, 257, 70}, {1, 2, 2100, 67}, {2, 700, 190}, {1500, 131}}) {
    const mha::Tensor src = mha_test::randn(shape, rng);
    const mha::TensorView strided = src.view().slice(-1, 1, shape.back() - 2);  // rows with a gap
    const mha::Tensor bf16 = mha::Tensor::copy_of(strided, mha::DType::bf16);
    for (int threads : {1, 2, 3, 8}) {
      const mha::Tensor serial = mha::Tensor::copy_of(strided, mha::DType::bf16);
      const mha::Tensor parallel = mha::detail::parallel_copy_of(strided, mha::DType::bf16, threads);
      EXPECT_EQ(std::memcmp(serial.data<uint16_t>(), parallel.data<uint16_t>(), 2 * serial.numel()), 0) << threads;
      const mha::Tensor wide = mha::detail::parallel_copy_of(bf16.view(), mha::DType::f32, threads);
      EXPECT_TRUE(mha_test::same_bits(wide, mha::Tensor::copy_of(bf16.view(), mha::DType::f32))) << threads;
      mha::Tensor back = mha::Tensor::copy_of(src.view(), mha::DType::f32);  // into a strided destination
      mha::detail::parallel_copy_into(bf16.view(), back.view().slice(-1, 1, shape.back() - 2), threads);
      const mha::Tensor written = mha::Tensor::copy_of(back.view().slice(-1, 1, shape.back() - 2), mha::DType::f32);
      EXPECT_TRUE(mha_test::same_bits(written, wide)) << threads;
    }
  }
  const mha::Tensor a = mha::Tensor::empty({4, 300, 300}), b = mha::Tensor::empty({4, 300, 301});
  EXPECT_THROW(mha::detail::parallel_copy_into(a.view(), b.view(), 2), mha::Error);
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
  if (mha_test::under_user_mode_emulator()) GTEST_SKIP() << "qemu-user cannot fork a process that runs threads";
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

// The OpenMP home for the parallel work (mha::set_threading): the pool's bits, forward and
// backward, at several thread counts; exceptions, nesting and fork behave as with the pool.
// (Skipped under ThreadSanitizer, which cannot see libgomp's synchronisation.)
TEST(Concurrency, OpenMpThreadingGivesThePoolsBits) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "libgomp is not instrumented for ThreadSanitizer";
#endif
  if (!mha::openmp_available()) {
    EXPECT_THROW(mha::set_threading(mha::Threading::openmp), mha::Error);
    GTEST_SKIP() << "built without OpenMP";
  }
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Threading before = mha::get_threading();
  const mha::Tensor q = mha_test::randn({2, 4, 150, 32}, rng), g = mha_test::randn({2, 4, 150, 32}, rng);
  mha::MultiheadAttention m(32, 4, {.seed = 5});
  const mha::Tensor x = mha_test::randn({40, 3, 32}, rng);
  auto run = [&](int threads) {
    std::vector<mha::Tensor> out;
    const mha::AttentionForTraining f = mha::scaled_dot_product_attention_for_training(q, q, q, {.is_causal = true, .num_threads = threads});
    out.push_back(f.output);
    const mha::AttentionGradients d = mha::scaled_dot_product_attention_backward(q, q, q, f, g, {.is_causal = true, .num_threads = threads});
    out.push_back(d.query);
    out.push_back(d.key);
    const mha::ForwardResult r = m(x, x, x, {.num_threads = threads});  // with head-averaged weights
    out.push_back(r.output);
    out.push_back(*r.weights);
    return out;
  };
  mha::set_threading(mha::Threading::pool);
  const std::vector<mha::Tensor> expected = run(3);
  const std::vector<mha::Tensor> one_thread = run(1);
  for (size_t i = 0; i < one_thread.size(); ++i) EXPECT_TRUE(mha_test::same_bits(one_thread[i], expected[i])) << i;
  mha::set_threading(mha::Threading::openmp);
  EXPECT_EQ(mha::get_threading(), mha::Threading::openmp);
  for (int threads : {2, 3}) {
    const std::vector<mha::Tensor> got = run(threads);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(mha_test::same_bits(got[i], expected[i])) << i << " " << threads;
  }
  EXPECT_THROW(mha::detail::parallel_for(100, 3, [](int64_t i, int) { if (i == 5) throw std::runtime_error("5"); }),
               std::runtime_error);
  std::atomic<int64_t> count{0};
  std::atomic<int> largest_worker{0};
  mha::detail::parallel_for(8, 3, [&](int64_t, int worker) {
    largest_worker = std::max(largest_worker.load(), worker);
    mha::detail::parallel_for(10, 3, [&](int64_t, int) { ++count; });
  });
  EXPECT_EQ(count.load(), 80);
  EXPECT_LT(largest_worker.load(), 3);
  // A forked child cannot use the parent's OpenMP team: it computes on a pool of its own.
  if (!mha_test::under_user_mode_emulator()) {  // (qemu-user cannot fork a process that runs threads)
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(mha_test::same_bits(run(3)[0], expected[0]) ? 0 : 1);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  mha::set_threading(before);
}

}  // namespace
