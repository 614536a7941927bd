// low_precision_gemv with the avx512 SIMD layer (compiled for AVX-512; see CMakeLists.txt).
#include "cpu/gemv_low_precision.hpp"
#include "cpu/simd_avx512.hpp"

namespace mha::detail {
void low_precision_gemv_avx512(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  low_precision_gemv_of<simd::Avx512>(g, j0, j1);
}
}  // namespace mha::detail
