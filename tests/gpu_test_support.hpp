// Shared by the GPU tests (test_cuda*.cpp): the fixture that skips without a device, random
// operands with their host copies, NaN-poisoned outputs, the kernels a device runs, and the
// tolerances per dtype.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "mha/cuda.hpp"
#include "test_support.hpp"

namespace mha_test {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!mha::cuda::is_available()) GTEST_SKIP() << mha::cuda::describe() << "; the GPU tests need a CUDA device";
    std::printf("%s\n", mha::cuda::describe().c_str());
  }
};

// A host tensor of `shape` in `dtype` on the GPU, with its host copy for the reference.
struct Operand {
  mha::Tensor host, device;
};
inline Operand operand(const mha::Shape& shape, std::mt19937_64& rng, mha::DType dtype) {
  Operand o;
  o.host = mha_test::randn(shape, rng, dtype);
  o.device = o.host.to(mha::Device::cuda());
  return o;
}

// An output buffer on the GPU filled with NaN, so that an element the kernel does not write fails.
inline mha::Tensor poisoned(const mha::Shape& shape, mha::DType dtype) {
  mha::Tensor h = mha::Tensor::empty(shape, mha::DType::f32);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  return mha::Tensor::copy_of(h, dtype).to(mha::Device::cuda());
}

// The GPU kernels this device runs: the mma.sync one everywhere, the wgmma one on Hopper.
inline std::vector<std::string> kernels() {
  std::vector<std::string> names = {"mma"};
  if (mha::cuda::compute_capability() == 90) names.push_back("wgmma");
  return names;
}

// Sets an environment variable the GPU entry points read at every call (MHA_CUDA_KERNEL by
// default) for a scope, then restores it.
class KernelChoice {
 public:
  explicit KernelChoice(const std::string& value, const std::string& variable = "MHA_CUDA_KERNEL")
      : variable_(variable) {
    if (const char* before = std::getenv(variable_.c_str())) previous_ = before;
    setenv(variable_.c_str(), value.c_str(), 1);
  }
  ~KernelChoice() {
    if (previous_) {
      setenv(variable_.c_str(), previous_->c_str(), 1);
    } else {
      unsetenv(variable_.c_str());
    }
  }
  KernelChoice(const KernelChoice&) = delete;
  KernelChoice& operator=(const KernelChoice&) = delete;

 private:
  std::string variable_;
  std::optional<std::string> previous_;
};

// bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per element, on inputs, on P
// and on the output), fp16 11 (2^-12 ~ 2.4e-4): normwise 1e-2 and 3e-3 leave room for the sums.
inline double tolerance(mha::DType dtype) { return dtype == mha::DType::bf16 ? 1e-2 : 3e-3; }

}  // namespace mha_test
