// The CUDA backend. Without a GPU (or without the backend) the GPU tests skip and the rest
// check that device memory is refused cleanly; on a GPU machine (tests/gpu/run.sh) they compare
// the fused GPU kernel with the float64 reference on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "mha/cuda.hpp"
#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

using mha_test::expect_error;
using mha_test::GpuTest;
using mha_test::KernelChoice;
using mha_test::kernels;
using mha_test::Operand;
using mha_test::operand;
using mha_test::poisoned;
using mha_test::tolerance;

// Views of device memory, whatever the build: the CPU functions refuse them by name, before
// touching the pointer (which here is not even valid).
TEST(Cuda, CpuFunctionsRefuseDeviceMemory) {
  static float dummy[64];
  const mha::TensorView host(dummy, {1, 2, 4, 8});
  const mha::TensorView device = host.on(mha::Device::cuda());
  expect_error([&] { mha::scaled_dot_product_attention(host, device, host); }, "key: expected the query's device");
  expect_error([&] { mha::scaled_dot_product_attention(device, device, device, {.attn_mask = host}); },
               "attn_mask: expected the query's device");
  expect_error([&] { mha::reference::scaled_dot_product_attention(device, device, device); }, "host (cpu) memory");
  // ALiBi's slopes are read on the host, and its biases are a host kernels' term.
  static float slopes[2] = {0.5f, 0.25f};
  const mha::TensorView host_slopes(slopes, {2});
  expect_error([&] { mha::scaled_dot_product_attention(host, host, host, {.alibi_slopes = host_slopes.on(mha::Device::cuda())}); },
               "alibi_slopes: expected a host tensor (the biases are built on the host), got one on cuda:0");
  expect_error([&] { mha::scaled_dot_product_attention(device, device, device, {.alibi_slopes = host_slopes}); },
               "alibi_slopes: ALiBi's biases are applied by the host kernels; on cuda:0");
  // Soft-capping is formed by the host kernels only.
  expect_error([&] { mha::scaled_dot_product_attention(device, device, device, {.softcap = 30.0}); },
               "softcap: logit soft-capping runs in the host kernels; got inputs on cuda:0");
  // float8 keys and values are widened by the host kernels.
  static uint8_t bytes[64];
  const mha::TensorView device8 = mha::TensorView(bytes, mha::DType::f8e4m3, {1, 2, 4, 8}).on(mha::Device::cuda());
  expect_error([&] { mha::scaled_dot_product_attention(device, device8, device8); },
               "key: float8 keys and values are read by the host kernels; got inputs on cuda:0");
  expect_error([&] { (void)mha::Tensor::copy_of(device); }, "host (cpu) memory");
  expect_error([&] { (void)device.at({0, 0, 0, 0}); }, "host (cpu) memory");
  const mha::MultiheadAttention m(8, 2);
  const mha::TensorView x = mha::TensorView(dummy, {4, 1, 8}).on(mha::Device::cuda());
  expect_error([&] { m.forward(x, x, x); }, "query: expected a tensor in host (cpu) memory");
  EXPECT_EQ(device.device.str(), "cuda:0");
  EXPECT_TRUE(host.device.is_cpu());
}

TEST(Cuda, WithoutADeviceAllocationIsAnError) {
  if (mha::cuda::is_available()) GTEST_SKIP() << "a CUDA device is present: " << mha::cuda::describe();
  std::printf("%s\n", mha::cuda::describe().c_str());
  EXPECT_EQ(mha::cuda::device_count(), 0);
  EXPECT_EQ(mha::cuda::cached_bytes(), 0u);
  mha::cuda::release_cache();  // nothing to return
  expect_error([] { mha::Tensor::empty({4}, mha::DType::f32, mha::Device::cuda()); }, "cuda:0");
  std::mt19937_64 rng(1);
  const mha::Tensor t = randn({4}, rng);
  expect_error([&] { (void)t.to(mha::Device::cuda()); }, "cuda:0");
}

// ---------------------------------------------------------------------------------------------
// On a GPU.

TEST_F(GpuTest, ForwardMatchesFloat64ReferenceAcrossOptions) {
  std::mt19937_64 rng(test_seed());
  for (const std::string& kernel : kernels()) {
    const KernelChoice choice(kernel);
    for (mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
      for (int64_t d : {64, 128, 256}) {
        for (int n = 0; n < 6; ++n) {
          // The wgmma kernel takes head dims 64 and 128 without masks (cases 2 and 5 have one).
          if (kernel == "wgmma" && (d == 256 || n == 2 || n == 5)) continue;
          const int64_t B = 1 + rng() % 2, Hkv = 1 + rng() % 3, group = 1 + rng() % 2, Hq = Hkv * group;
          const int64_t Lq = 1 + rng() % 300, Lk = n % 3 == 0 ? Lq : 1 + rng() % 300;
          mha::SdpaOptions o;
          o.enable_gqa = group > 1;
          o.is_causal = n % 2 == 1;
          o.causal_alignment = n % 4 == 1 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
          if (n == 4) o.scale = 0.3;
          const Operand q = operand({B, Hq, Lq, d}, rng, dtype), k = operand({B, Hkv, Lk, d}, rng, dtype),
                        v = operand({B, Hkv, Lk, d}, rng, dtype);
          mha::Tensor mask_host, mask_device;
          if (n == 2) {  // bool [Lq, Lk], true attends
            mask_host = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
            for (int64_t i = 0; i < mask_host.numel(); ++i) mask_host.data<bool>()[i] = rng() % 5 != 0;
          } else if (n == 5) {  // additive [B, 1, Lq, Lk] with some -inf
            mask_host = randn({B, 1, Lq, Lk}, rng);
            for (int64_t i = 0; i < mask_host.numel(); ++i)
              if (rng() % 10 == 0) mask_host.data<float>()[i] = -INFINITY;
          }
          mha::SdpaOptions o_host = o;
          if (mask_host.defined()) {
            mask_device = mask_host.to(mha::Device::cuda());
            o.attn_mask = mask_device.view();
            o_host.attn_mask = mask_host.view();
          }
          SCOPED_TRACE(kernel + " " + std::string(mha::dtype_name(dtype)) + " d=" + std::to_string(d) +
                       " B=" + std::to_string(B) +
                       " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) + " Lq=" + std::to_string(Lq) +
                       " Lk=" + std::to_string(Lk) + " case " + std::to_string(n));
          const mha::Tensor out = poisoned({B, Hq, Lq, d}, dtype);
          mha::scaled_dot_product_attention_into(q.device, k.device, v.device, out, o);
          const auto ref = mha::reference::scaled_dot_product_attention(q.host, k.host, v.host, o_host);
          EXPECT_LT(rel_error(out.to(mha::Device::cpu()), ref.output), tolerance(dtype));
          // The training forward: the same output and the log-sum-exp of every row.
          const auto t = mha::scaled_dot_product_attention_for_training(q.device, k.device, v.device, o);
          EXPECT_LT(rel_error(t.output.to(mha::Device::cpu()), ref.output), tolerance(dtype));
          const auto cpu = mha::scaled_dot_product_attention_for_training(
              mha::Tensor::copy_of(q.host, mha::DType::f32), mha::Tensor::copy_of(k.host, mha::DType::f32),
              mha::Tensor::copy_of(v.host, mha::DType::f32), o_host);
          EXPECT_LT(rel_error(t.lse.to(mha::Device::cpu()), cpu.lse), 1e-4);
        }
      }
    }
  }
}

// Sequences of many key tiles and query blocks (the tests above stay under 300), causal in both
// alignments, GQA, Lq != Lk, on every kernel of the device.
TEST_F(GpuTest, LongSequencesMatchTheFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (const std::string& kernel : kernels()) {
    const KernelChoice choice(kernel);
    for (int64_t d : {64, 128}) {
      for (int n = 0; n < 3; ++n) {
        const mha::DType dtype = n == 1 ? mha::DType::f16 : mha::DType::bf16;
        const int64_t Lq = 700 + rng() % 600, Lk = n == 0 ? Lq : 700 + rng() % 600;
        mha::SdpaOptions o{.is_causal = n != 2, .enable_gqa = true};
        o.causal_alignment = n == 1 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
        SCOPED_TRACE(kernel + " d=" + std::to_string(d) + " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) +
                     " case " + std::to_string(n));
        const Operand q = operand({1, 2, Lq, d}, rng, dtype), k = operand({1, 1, Lk, d}, rng, dtype),
                      v = operand({1, 1, Lk, d}, rng, dtype);
        const mha::Tensor out = poisoned({1, 2, Lq, d}, dtype);
        mha::scaled_dot_product_attention_into(q.device, k.device, v.device, out, o);
        const auto ref = mha::reference::scaled_dot_product_attention(q.host, k.host, v.host, o);
        EXPECT_LT(rel_error(out.to(mha::Device::cpu()), ref.output), tolerance(dtype));
      }
    }
  }
}

// MHA_CUDA_KERNEL names the kernel; asking for one that cannot run a problem is an error that says why.
TEST_F(GpuTest, KernelChoiceFromTheEnvironment) {
  std::mt19937_64 rng(test_seed());
  const Operand q = operand({1, 2, 33, 256}, rng, mha::DType::bf16);
  {
    const KernelChoice choice("wgmma");
    expect_error([&] { mha::scaled_dot_product_attention(q.device, q.device, q.device); },
                 mha::cuda::compute_capability() == 90 ? "head dim 64 or 128" : "compute capability 9.0");
  }
  {
    const KernelChoice choice("fastest");
    expect_error([&] { mha::scaled_dot_product_attention(q.device, q.device, q.device); },
                 "MHA_CUDA_KERNEL: expected auto, mma or wgmma, got 'fastest'");
  }
  if (mha::cuda::compute_capability() == 90) {
    const KernelChoice choice("wgmma");
    const Operand x = operand({1, 2, 33, 64}, rng, mha::DType::bf16);
    const mha::Tensor mask = mha::Tensor::zeros({33, 33}).to(mha::Device::cuda());
    expect_error([&] { mha::scaled_dot_product_attention(x.device, x.device, x.device, {.attn_mask = mask.view()}); },
                 "no attn_mask");
  }
}

// [B, L, H, D] storage viewed as [B, H, L, D] (a batch-first caller's layout), no copy.
TEST_F(GpuTest, StridedViewsOfBatchFirstStorage) {
  std::mt19937_64 rng(test_seed());
  for (const std::string& kernel : kernels()) {
    const KernelChoice choice(kernel);
    SCOPED_TRACE(kernel);
    const mha::DType dtype = mha::DType::bf16;
    const Operand q = operand({2, 77, 4, 64}, rng, dtype), k = operand({2, 130, 4, 64}, rng, dtype),
                  v = operand({2, 130, 4, 64}, rng, dtype);
    const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
    const mha::Tensor out = mha::scaled_dot_product_attention(q.device.view().transpose(1, 2),
                                                              k.device.view().transpose(1, 2),
                                                              v.device.view().transpose(1, 2), o);
    const auto ref = mha::reference::scaled_dot_product_attention(
        q.host.view().transpose(1, 2), k.host.view().transpose(1, 2), v.host.view().transpose(1, 2), o);
    EXPECT_LT(rel_error(out.to(mha::Device::cpu()), ref.output), tolerance(dtype));
  }
}

// Freed device memory is kept per device and handed out again for a request of the same rounded
// size, until release_cache returns it to the driver.
TEST_F(GpuTest, FreedDeviceMemoryIsKeptForReuse) {
  mha::cuda::release_cache();
  EXPECT_EQ(mha::cuda::cached_bytes(), 0u);
  for (const mha::Shape& shape : {mha::Shape{3, 1000, 1000}, mha::Shape{100}}) {  // 12 MB (2 MiB granule), 400 B
    const void* first = nullptr;
    {
      const mha::Tensor t = mha::Tensor::empty(shape, mha::DType::f32, mha::Device::cuda());
      first = t.view().data;
    }
    EXPECT_GT(mha::cuda::cached_bytes(), 0u);
    const mha::Tensor again = mha::Tensor::empty(shape, mha::DType::f32, mha::Device::cuda());
    EXPECT_EQ(again.view().data, first);
  }
  mha::cuda::release_cache();
  EXPECT_EQ(mha::cuda::cached_bytes(), 0u);
  // Memory handed out again holds what it held: a copy round trip is still exact.
  std::mt19937_64 rng(test_seed());
  const mha::Tensor h = randn({3, 1000, 1000}, rng);
  EXPECT_TRUE(mha_test::same_bits(h.to(mha::Device::cuda()).to(mha::Device::cpu()), h));
}

// Rows that see no key (top-left causality with Lq > Lk and a bool mask row of false) are zero.
TEST_F(GpuTest, FullyMaskedRowsAreZeroAndWhatTheKernelCannotDoIsAnError) {
  std::mt19937_64 rng(test_seed());
  const mha::DType dtype = mha::DType::f16;
  const Operand q = operand({1, 2, 40, 128}, rng, dtype), k = operand({1, 2, 25, 128}, rng, dtype),
                v = operand({1, 2, 25, 128}, rng, dtype);
  const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
  const mha::Tensor out = mha::scaled_dot_product_attention(q.device, k.device, v.device, o).to(mha::Device::cpu());
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 15; ++i)
      for (int64_t d = 0; d < 128; ++d) ASSERT_EQ(out.at({0, h, i, d}), 0.0);
  const auto ref = mha::reference::scaled_dot_product_attention(q.host, k.host, v.host, o);
  EXPECT_LT(rel_error(out, ref.output), tolerance(dtype));

  const Operand odd = operand({1, 2, 8, 48}, rng, dtype);
  expect_error([&] { mha::scaled_dot_product_attention(odd.device, odd.device, odd.device); }, "head dims 64, 128 or 256");
  const Operand f32 = operand({1, 2, 8, 64}, rng, mha::DType::f32);
  expect_error([&] { mha::scaled_dot_product_attention(f32.device, f32.device, f32.device); }, "bfloat16 or float16");
  expect_error([&] { mha::scaled_dot_product_attention_with_weights(q.device, k.device, v.device); }, "weights");
  expect_error([&] { mha::scaled_dot_product_attention(q.device, k.device, v.device, {.dropout_p = 0.1}); },
               "dropout");
}

// A row whose every key carries finfo.min (Hugging Face's padding) gets uniform weights, the mean
// of the values, as on the CPU and in PyTorch; not the zeros of an overflow to -inf.
TEST_F(GpuTest, HugeFiniteMaskValuesAreNotInfinite) {
  std::mt19937_64 rng(test_seed());
  const mha::DType dtype = mha::DType::bf16;
  const Operand q = operand({1, 2, 40, 64}, rng, dtype), k = operand({1, 2, 70, 64}, rng, dtype),
                v = operand({1, 2, 70, 64}, rng, dtype);
  mha::Tensor mask = mha::Tensor::zeros({40, 70});
  for (int64_t j = 0; j < 70; ++j) mask.data<float>()[3 * 70 + j] = std::numeric_limits<float>::lowest();  // row 3
  const mha::Tensor mask_device = mask.to(mha::Device::cuda());
  const mha::Tensor out =
      mha::scaled_dot_product_attention(q.device, k.device, v.device, {.attn_mask = mask_device.view()}).to(mha::Device::cpu());
  const mha::Tensor cpu = mha::scaled_dot_product_attention(q.host, k.host, v.host, {.attn_mask = mask.view()});
  EXPECT_LT(rel_error(out, cpu), tolerance(dtype));
  const mha::Tensor values = mha::Tensor::copy_of(v.host, mha::DType::f32);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t d = 0; d < 64; ++d) {
      double mean = 0;
      for (int64_t j = 0; j < 70; ++j) mean += values.at({0, h, j, d}) / 70.0;
      EXPECT_NEAR(out.at({0, h, 3, d}), mean, 2e-2) << h << " " << d;
    }
}

}  // namespace
