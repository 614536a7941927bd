// The fused backward compiled for AVX2 + FMA (this file only gets -mavx2 -mfma; see CMakeLists.txt).
#include "cpu/backward_delta.hpp"
#include "cpu/flash_backward.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {
void flash_backward_avx2(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  FlashBackward<simd::Avx2>{p, in, out}.run();
}
void backward_delta_avx2(const AttentionProblem& p, const BackwardInputs& in, float* delta) {
  backward_delta_all<simd::Avx2>(p, in, delta);
}
}  // namespace mha::detail
