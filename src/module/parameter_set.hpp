// The parameters one call of MultiheadAttention reads: the module's own, or views the caller
// passes instead (forward_with / backward_with), as contiguous float32 (float64 for a float64
// module, bfloat16 for a bfloat16 one in bfloat16 products).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

using NamedViews = std::vector<std::pair<std::string, TensorView>>;

struct ParameterSet {
  NamedViews views;           // named_parameters() order; contiguous, of the compute dtype (but see below)
  std::vector<Tensor> copies;  // the storage of those that had to be converted or compacted
  const TensorView& view(const std::string& name) const;
  template <typename T = float>
  const T* data(const std::string& name) const {
    return view(name).data_as<T>();
  }
};

// Views as they are where already contiguous float32 (no copy: a float32 module reads its own
// parameters, or a PyTorch module's, in place), converted copies (over the pool) where not. With
// `weights_as_they_are`, the bfloat16/float16 projection weights (2-D) stay in their dtype, as
// they are where their last stride is 1 and compacted where not, for linear() to read or widen as
// the call's row count suits.
ParameterSet float32_parameters(const NamedViews& views, int threads, bool weights_as_they_are = false);
// The same for a float64 module: contiguous float64 views, in place where they already are.
ParameterSet float64_parameters(const NamedViews& views, int threads);
// The same for a bfloat16 module that runs in bfloat16 products (module_low_precision.cpp).
ParameterSet bfloat16_parameters(const NamedViews& views, int threads);

}  // namespace mha::detail
