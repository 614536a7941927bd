// Merging attention results over disjoint sets of keys (mha/paged_attention.hpp): each row's
// output is the two parts' outputs weighted by their shares of the union's softmax, read off the
// parts' log-sum-exp. Computed in float64 on contiguous copies: a merge reads each element once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "mha/paged_attention.hpp"

namespace mha {
namespace {

void check_host(const TensorView& t, const char* name) {
  require_cpu(t, name);
  if (t.numel() > 0 && t.data == nullptr) throw Error(std::string(name) + ": data pointer is null");
}

// The merge of both public forms: rows [.., Dv] with lse [..], or packed rows [Tq, Hq, Dv] with
// lse [Hq, Tq].
PagedAttentionOutput merge(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                           const TensorView& lse_b, bool packed) {
  check_host(out_a, "out_a");
  check_host(lse_a, "lse_a");
  check_host(out_b, "out_b");
  check_host(lse_b, "lse_b");
  if (out_a.sizes() != out_b.sizes() || out_a.dtype != out_b.dtype) {
    throw Error("out_b: expected out_a's shape and dtype " + out_a.shape_str() + " " + std::string(dtype_name(out_a.dtype)) + ", got " +
                out_b.shape_str() + " " + std::string(dtype_name(out_b.dtype)));
  }
  if (lse_a.sizes() != lse_b.sizes() || lse_a.dtype != lse_b.dtype) {
    throw Error("lse_b: expected lse_a's shape and dtype " + lse_a.shape_str() + " " + std::string(dtype_name(lse_a.dtype)) + ", got " +
                lse_b.shape_str() + " " + std::string(dtype_name(lse_b.dtype)));
  }
  if (out_a.dtype == DType::boolean) throw Error("out_a: expected a floating dtype, got bool");
  if (lse_a.dtype != DType::f32 && lse_a.dtype != DType::f64) {
    throw Error("lse_a: expected float32 or float64, got " + std::string(dtype_name(lse_a.dtype)));
  }
  const Shape out_shape = out_a.sizes(), lse_shape = lse_a.sizes();
  if (packed) {
    if (out_a.ndim != 3) throw Error("out_a: expected packed rows [Tq, Hq, Dv], got " + out_a.shape_str());
    const Shape want{out_shape[1], out_shape[0]};
    if (lse_shape != want) {
      throw Error("lse_a: expected [Hq, Tq] = " + TensorView(nullptr, DType::f32, want).shape_str() + ", got " +
                  lse_a.shape_str());
    }
  } else {
    if (out_a.ndim < 1) throw Error("out_a: expected at least one dimension (Dv), got a scalar");
    const Shape want(out_shape.begin(), out_shape.end() - 1);
    if (lse_shape != want) {
      throw Error("lse_a: expected the output's shape without its last dimension, " +
                  TensorView(nullptr, DType::f32, want).shape_str() + ", got " + lse_a.shape_str());
    }
  }
  // Row r of the copies below is row r of the outputs: packed lse are read transposed.
  const Tensor oa = Tensor::copy_of(out_a, DType::f64), ob = Tensor::copy_of(out_b, DType::f64);
  const Tensor la = Tensor::copy_of(packed ? lse_a.transpose(0, 1) : lse_a, DType::f64);
  const Tensor lb = Tensor::copy_of(packed ? lse_b.transpose(0, 1) : lse_b, DType::f64);
  const int64_t rows = la.numel(), dv = out_shape.back();
  Tensor out = Tensor::empty(out_shape, DType::f64), lse = Tensor::empty(la.sizes(), DType::f64);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    // +inf (a part that saw no key) carries no weight.
    const double x = la.data<double>()[r] == inf ? -inf : la.data<double>()[r];
    const double y = lb.data<double>()[r] == inf ? -inf : lb.data<double>()[r];
    const double top = std::max(x, y);
    const double m = top == -inf ? 0.0 : top;
    const double wa = std::exp(x - m), wb = std::exp(y - m), total = wa + wb;
    lse.data<double>()[r] = total > 0 ? m + std::log(total) : inf;
    const double sa = total > 0 ? wa / total : 0.0, sb = total > 0 ? wb / total : 0.0;
    const double* pa = oa.data<double>() + r * dv;
    const double* pb = ob.data<double>() + r * dv;
    double* po = out.data<double>() + r * dv;
    for (int64_t e = 0; e < dv; ++e) po[e] = sa * pa[e] + sb * pb[e];
  }
  return {Tensor::copy_of(out, out_a.dtype), Tensor::copy_of(packed ? lse.view().transpose(0, 1) : lse.view(), lse_a.dtype)};
}

}  // namespace

PagedAttentionOutput merge_attention_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                                            const TensorView& lse_b) {
  return merge(out_a, lse_a, out_b, lse_b, false);
}

PagedAttentionOutput merge_attention_states_varlen(const TensorView& out_a, const TensorView& lse_a,
                                                   const TensorView& out_b, const TensorView& lse_b) {
  return merge(out_a, lse_a, out_b, lse_b, true);
}

}  // namespace mha
