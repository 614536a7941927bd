// The differential targets' measure: max|got - ref| / max|ref| over two tensors of any dtype (or
// over max(max|ref|, max magnitude) where a magnitude is given: the size of the terms each
// value sums), or infinity where `got` holds a non-finite value (the targets' inputs are finite).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "mha/tensor.hpp"

inline double normwise(const mha::TensorView& got_in, const mha::TensorView& ref_in, double* scale_out,
                       const mha::Tensor& magnitude = {}) {
  const mha::Tensor got = mha::Tensor::copy_of(got_in, mha::DType::f64), ref = mha::Tensor::copy_of(ref_in, mha::DType::f64);
  double err = 0, scale = 0;
  if (magnitude.defined()) {
    const mha::Tensor m = mha::Tensor::copy_of(magnitude, mha::DType::f64);
    for (int64_t i = 0; i < m.numel(); ++i) scale = std::max(scale, m.data<double>()[i]);
  }
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double r = ref.data<double>()[i], f = got.data<double>()[i];
    if (!std::isfinite(f)) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(f - r));
    scale = std::max(scale, std::abs(r));
  }
  *scale_out = scale;
  return err == 0 ? 0.0 : err / std::max(scale, 1e-30);
}
