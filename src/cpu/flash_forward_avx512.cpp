// The fused forward compiled for AVX-512 (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512)
#include "cpu/flash_forward.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void flash_forward_avx512(const AttentionProblem& p, const ForwardOutputs& o) {
  FlashForward<simd::Avx512>{p, o}.run();
}
}  // namespace mha::detail
MHA_ISA_END
