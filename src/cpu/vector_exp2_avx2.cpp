// S::exp2 of the AVX2 layer over an array (compiled for AVX2 + FMA in its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
#include "cpu/simd_avx2.hpp"
#include "cpu/vector_exp2.hpp"

namespace mha::detail {
void vector_exp2_avx2(const float* x, float* y, int64_t n) { vector_exp2_of<simd::Avx2>(x, y, n); }
void vector_tanh_avx2(const float* x, float* y, float* slope, int64_t n) { vector_tanh_of<simd::Avx2>(x, y, slope, n); }
void vector_softcap_avx2(double c, const float* x, float* y, float* slope, int64_t n) {
  vector_softcap_of<simd::Avx2>(c, x, y, slope, n);
}
}  // namespace mha::detail
MHA_ISA_END
