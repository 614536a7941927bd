#include "module/parameter_set.hpp"

#include "core/parallel_copy.hpp"
#include "mha/error.hpp"

namespace mha::detail {

const TensorView& ParameterSet::view(const std::string& name) const {
  for (const auto& [n, v] : views)
    if (n == name) return v;
  throw Error("internal error: no parameter '" + name + "' in this call's set");
}

ParameterSet float32_parameters(const NamedViews& views, int threads, bool weights_as_they_are) {
  ParameterSet set;
  for (const auto& [name, v] : views) {
    const bool weight = v.ndim == 2 && (v.strides[1] == 1 || v.shape[1] <= 1);
    if ((v.dtype == DType::f32 && v.is_contiguous()) || (weights_as_they_are && weight && v.dtype != DType::f32)) {
      set.views.emplace_back(name, v);
    } else {
      set.copies.push_back(parallel_copy_of(v, DType::f32, threads));
      set.views.emplace_back(name, set.copies.back().view());
    }
  }
  return set;
}

}  // namespace mha::detail
