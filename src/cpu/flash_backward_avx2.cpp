// The fused backward compiled for AVX2 + FMA (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
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
MHA_ISA_END
