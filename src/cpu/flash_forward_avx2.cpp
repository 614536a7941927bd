// The fused forward compiled for AVX2 + FMA (this file only gets -mavx2 -mfma; see CMakeLists.txt).
#include "cpu/flash_forward.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {
void flash_forward_avx2(const AttentionProblem& p, const ForwardOutputs& o) { FlashForward<simd::Avx2>{p, o}.run(); }
}  // namespace mha::detail
