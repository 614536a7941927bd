// An 8 x 8 float transpose in ymm registers (unpack, shuffle, swap halves), for the SIMD layers of
// CPUs with AVX (simd_avx2.hpp, simd_avx512.hpp). 24 shuffles and 16 moves where a scalar loop
// does 64 loads and 64 strided stores.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mha::detail::simd {

namespace {  // internal linkage, one copy per instruction set's files (simd_avx2.hpp says why)

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 8.
inline void transpose8x8_avx(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {  // interleave pairs of rows: (a0 b0 a1 b1 | a4 b4 a5 b5), ...
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // then pairs of pairs: (a0 b0 c0 d0 | a4 b4 c4 d4), ...
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {  // and the 128-bit halves of rows 0-3 with those of rows 4-7
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

}  // namespace

}  // namespace mha::detail::simd
