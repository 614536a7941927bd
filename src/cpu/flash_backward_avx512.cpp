// The fused backward compiled for AVX-512 (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512)
#include "cpu/backward_delta.hpp"
#include "cpu/flash_backward.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void flash_backward_avx512(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  FlashBackward<simd::Avx512>{p, in, out}.run();
}
void backward_delta_avx512(const AttentionProblem& p, const BackwardInputs& in, float* delta) {
  backward_delta_all<simd::Avx512>(p, in, delta);
}
}  // namespace mha::detail
MHA_ISA_END
