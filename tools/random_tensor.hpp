// Seeded random inputs for the tools and the benchmark binary: standard normal values, so that
// no kernel is measured or checked on the special cases of zeros or constants.
#pragma once

#include <cstdint>
#include <random>

#include "mha/tensor.hpp"

namespace mha::tools {

inline void fill_normal(const Tensor& t, std::mt19937_64& rng, float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  float* data = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) data[i] = normal(rng);
}

inline Tensor random_normal(const Shape& shape, std::mt19937_64& rng, float stddev = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::f32);
  fill_normal(t, rng, stddev);
  return t;
}

}  // namespace mha::tools
