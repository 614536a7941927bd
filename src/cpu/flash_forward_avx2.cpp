// The fused forward compiled for AVX2 + FMA (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
#include "cpu/flash_forward.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {
void flash_forward_avx2(const AttentionProblem& p, const ForwardOutputs& o) { FlashForward<simd::Avx2>{p, o}.run(); }
}  // namespace mha::detail
MHA_ISA_END
