// low_precision_gemv with the portable SIMD layer (compiled for the baseline ISA).
#include "cpu/gemv_low_precision.hpp"
#include "cpu/simd_portable.hpp"

namespace mha::detail {
void low_precision_gemv_portable(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  low_precision_gemv_of<simd::Portable>(g, j0, j1);
}

void low_precision_gemv(Isa isa, const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512: low_precision_gemv_avx512(g, j0, j1); break;
    case Isa::avx2: low_precision_gemv_avx2(g, j0, j1); break;
    case Isa::portable: low_precision_gemv_portable(g, j0, j1); break;
  }
}
}  // namespace mha::detail
