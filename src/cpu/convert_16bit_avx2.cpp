// Conversions between float32 and the 16-bit types compiled for AVX2 + F16C (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
#include "cpu/convert_16bit.hpp"
#include "cpu/simd_avx2.hpp"

namespace mha::detail {

void widen_f16_avx2(const void* src, void* dst, int64_t n) {
  const auto* a = static_cast<const uint16_t*>(src);
  auto* b = static_cast<float*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
    // vcvtph2ps quiets a signalling NaN; the scalar widening keeps every infinity and NaN as sign,
    // an all-ones exponent and the mantissa moved up, which these lanes take instead.
    const __m256i w = _mm256_cvtepu16_epi32(h);
    const __m256i exponent = _mm256_and_si256(w, _mm256_set1_epi32(0x7c00));
    const __m256i special = _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7c00));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
                                         _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                                                         _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13)));
    const __m256 x = _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(bits), _mm256_castsi256_ps(special));
    _mm256_storeu_ps(b + i, x);
  }
  for (; i < n; ++i) b[i] = static_cast<float>(float16::from_bits(a[i]));
}

// (x * 1 is x, but for a signalling NaN, which it quiets as both scalar roundings do.)
void narrow_f16_avx2(const void* src, void* dst, int64_t n) {
  simd::Avx2::store_16bit_row(DType::f16, static_cast<const float*>(src), 1.0f, static_cast<uint16_t*>(dst), n);
}

void narrow_bf16_avx2(const void* src, void* dst, int64_t n) {
  simd::Avx2::store_16bit_row(DType::bf16, static_cast<const float*>(src), 1.0f, static_cast<uint16_t*>(dst), n);
}

}  // namespace mha::detail
MHA_ISA_END
