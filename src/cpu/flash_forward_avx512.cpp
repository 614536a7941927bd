// The fused forward compiled for AVX-512 (this file only gets -mavx512*; see CMakeLists.txt).
#include "cpu/flash_forward.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void flash_forward_avx512(const AttentionProblem& p, const ForwardOutputs& o) {
  FlashForward<simd::Avx512>{p, o}.run();
}
}  // namespace mha::detail
