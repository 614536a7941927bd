#include "accuracy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mha::tools {

double max_relative_error(const TensorView& actual, const TensorView& reference) {
  if (actual.sizes() != reference.sizes()) {
    throw Error("max_relative_error: shapes differ, " + actual.shape_str() + " vs " + reference.shape_str());
  }
  // Contiguous float64 copies make the loop trivial and handle any strides and dtypes.
  const Tensor a = Tensor::copy_of(actual, DType::f64);
  const Tensor r = Tensor::copy_of(reference, DType::f64);
  const double* pa = a.data<double>();
  const double* pr = r.data<double>();
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (!std::isfinite(pa[i]) || !std::isfinite(pr[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::abs(pa[i] - pr[i]));
    max_ref = std::max(max_ref, std::abs(pr[i]));
  }
  if (max_ref == 0) return max_diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return max_diff / max_ref;
}

}  // namespace mha::tools
