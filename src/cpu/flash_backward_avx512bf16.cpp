// The fused backward with bfloat16 products (AVX512-BF16; its region adds AVX512-BF16 to
// AVX-512; cpu/isa_region.hpp), for the problems bf16_pairs_backward_takes takes.
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512BF16)
#include "cpu/flash_backward.hpp"
#include "cpu/simd_avx512_bf16.hpp"

namespace mha::detail {
void flash_backward_avx512bf16(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  if (!bf16_pairs_backward_takes(p, in, out)) {
    throw Error("internal error: the bfloat16-product backward was handed a problem it does not take");
  }
  FlashBackward<simd::Avx512Bf16>{p, in, out}.run();
}
}  // namespace mha::detail
MHA_ISA_END
