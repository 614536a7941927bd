// low_precision_gemv with the avx2 SIMD layer (compiled with -mavx2 -mfma -mf16c; see CMakeLists.txt).
#include "cpu/gemv_low_precision.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {
void low_precision_gemv_avx2(const LowPrecisionGemv& g, int64_t j0, int64_t j1) {
  low_precision_gemv_of<simd::Avx2>(g, j0, j1);
}
}  // namespace mha::detail
