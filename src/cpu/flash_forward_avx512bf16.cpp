// The fused forward with bfloat16 products (AVX512-BF16; its region adds AVX512-BF16 to
// AVX-512; cpu/isa_region.hpp), for problems whose q, k and v are all bfloat16
// (bf16_pairs_supports).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512BF16)
#include "cpu/flash_forward.hpp"
#include "cpu/simd_avx512_bf16.hpp"

namespace mha::detail {
void flash_forward_avx512bf16(const AttentionProblem& p, const ForwardOutputs& o) {
  if (!bf16_pairs_supports(p)) throw Error("internal error: the bfloat16-product kernel was handed a problem it does not take");
  FlashForward<simd::Avx512Bf16>{p, o}.run();
}

bool bf16_pairs_take_few_queries(const AttentionProblem& p, const ForwardOutputs& o) {
  using Few = FewQueries<simd::Avx512Bf16>;
  // (Weights come from dot mode, which the float32 kernel runs.)
  return Few::applies(p, o) && Few::pair_products(p) && o.weights == nullptr && o.average_weights == nullptr;
}

void exp2_bf16_of(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, k, exp2_bf16(_mm512_maskz_loadu_ps(k, x + i)));
  }
}
}  // namespace mha::detail
MHA_ISA_END
