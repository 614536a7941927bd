// The fused backward compiled for AVX-512 (this file only gets -mavx512*; see CMakeLists.txt).
#include "cpu/flash_backward.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void flash_backward_avx512(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  FlashBackward<simd::Avx512>{p, in, out}.run();
}
}  // namespace mha::detail
