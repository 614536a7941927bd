// How the tools judge a float32 result against the float64 reference.
#pragma once

#include "mha/tensor.hpp"

namespace mha::tools {

// Normwise relative error max|a - r| / max|r| over all elements (shapes must match). Unlike an
// elementwise relative error it does not blow up on entries that are near zero by cancellation.
// Any NaN or infinity in either tensor gives infinity, so it can never pass a tolerance.
double max_relative_error(const TensorView& actual, const TensorView& reference);

}  // namespace mha::tools
