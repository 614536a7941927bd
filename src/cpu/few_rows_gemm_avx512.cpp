// few_rows_gemm with the avx512 SIMD layer (compiled for AVX-512 in its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512)
#include "cpu/few_rows_gemm.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void few_rows_gemm_avx512(const FewRowsGemm& g, int64_t j0, int64_t j1) {
  few_rows_gemm_of<simd::Avx512>(g, j0, j1);
}
}  // namespace mha::detail
MHA_ISA_END
