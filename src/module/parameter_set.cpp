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
    const bool weight16 = weights_as_they_are && v.ndim == 2 && v.dtype != DType::f32;
    if ((v.dtype == DType::f32 && v.is_contiguous()) || (weight16 && (v.strides[1] == 1 || v.shape[1] <= 1))) {
      set.views.emplace_back(name, v);
    } else if (weight16) {
      // Compacted in its own dtype, not widened: linear() then takes the path it takes for the
      // same weight stored contiguously, so a weight's layout never changes the results' bits.
      set.copies.push_back(parallel_copy_of(v, v.dtype, threads));
      set.views.emplace_back(name, set.copies.back().view());
    } else {
      set.copies.push_back(parallel_copy_of(v, DType::f32, threads));
      set.views.emplace_back(name, set.copies.back().view());
    }
  }
  return set;
}

namespace {
ParameterSet contiguous_parameters(const NamedViews& views, DType dtype, int threads) {
  ParameterSet set;
  for (const auto& [name, v] : views) {
    if (v.dtype == dtype && v.is_contiguous()) {
      set.views.emplace_back(name, v);
    } else {
      set.copies.push_back(parallel_copy_of(v, dtype, threads));
      set.views.emplace_back(name, set.copies.back().view());
    }
  }
  return set;
}
}  // namespace

ParameterSet float64_parameters(const NamedViews& views, int threads) {
  return contiguous_parameters(views, DType::f64, threads);
}

ParameterSet bfloat16_parameters(const NamedViews& views, int threads) {
  return contiguous_parameters(views, DType::bf16, threads);
}

}  // namespace mha::detail
