// run_attention: the step between a validated problem and an ISA's kernel.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"

namespace mha::detail {
namespace {

void fill_zero(float* base, const int64_t* shape, const int64_t* strides) {
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d)
          base[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]] = 0.0f;
}

}  // namespace

void run_attention(const AttentionProblem& problem, const ForwardOutputs& o) {
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max();
  if (problem.len_q > kMaxLen || problem.len_k > kMaxLen) {
    throw Error("query/key: sequence lengths up to 2^31 - 1 are supported, got Lq = " +
                std::to_string(problem.len_q) + ", Lk = " + std::to_string(problem.len_k));
  }
  if (problem.batch == 0 || problem.heads_q == 0 || problem.len_q == 0) return;  // nothing to write

  if (problem.dropout_p >= 1.0) {  // every weight dropped: the output and the weights are zero
    const int64_t out_shape[4] = {problem.batch, problem.heads_q, problem.len_q, problem.dim_v};
    fill_zero(o.out, out_shape, o.out_strides);
    if (o.weights) {
      const int64_t w_shape[4] = {problem.batch, problem.heads_q, problem.len_q, problem.len_k};
      fill_zero(o.weights, w_shape, o.weights_strides);
    }
    if (o.lse) {  // every weight is zero: +inf makes exp(score - lse) zero in a backward too
      std::fill_n(o.lse, problem.batch * problem.heads_q * problem.len_q, std::numeric_limits<float>::infinity());
    }
    return;
  }

  // The kernels read rows with unit stride; an input without it is copied once, here.
  AttentionProblem p = problem;
  std::vector<Tensor> copies;
  for (TensorView* t : {&p.q, &p.k, &p.v}) {
    if (t->strides[3] != 1 && t->shape[3] > 1) {
      copies.push_back(Tensor::copy_of(*t, DType::f32));
      *t = copies.back().view();
    }
  }
  switch (active_isa()) {
    case Isa::avx512: flash_forward_avx512(p, o); break;
    case Isa::portable: flash_forward_portable(p, o); break;
  }
}

}  // namespace mha::detail
