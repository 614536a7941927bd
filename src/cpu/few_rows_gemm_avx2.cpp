// few_rows_gemm with the avx2 SIMD layer (compiled for AVX2 + FMA + F16C in its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
#include "cpu/few_rows_gemm.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {
void few_rows_gemm_avx2(const FewRowsGemm& g, int64_t j0, int64_t j1) {
  few_rows_gemm_of<simd::Avx2>(g, j0, j1);
}
}  // namespace mha::detail
MHA_ISA_END
