// few_rows_gemm with the portable SIMD layer (compiled for the baseline ISA).
#include "cpu/few_rows_gemm.hpp"
#include "cpu/simd_portable.hpp"

namespace mha::detail {
void few_rows_gemm_portable(const FewRowsGemm& g, int64_t j0, int64_t j1) {
  few_rows_gemm_of<simd::Portable>(g, j0, j1);
}

void few_rows_gemm(Isa isa, const FewRowsGemm& g, int64_t j0, int64_t j1) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: few_rows_gemm_avx512(g, j0, j1); break;
    case Isa::avx2: few_rows_gemm_avx2(g, j0, j1); break;
    case Isa::portable: few_rows_gemm_portable(g, j0, j1); break;
  }
}
}  // namespace mha::detail
