// A 16 x 16 transpose of 32-bit words in zmm registers, for code compiled for AVX-512 (the AMX
// kernels' packing, the projection weights' packing, bfloat16 pairs and output rows).
#pragma once

#include <immintrin.h>

namespace mha::detail {

namespace {  // internal linkage, one copy per instruction set's files (simd_avx2.hpp says why)

// r[i] becomes column i of the 16 x 16 matrix of 32-bit words whose rows r held: pairs of words,
// of pairs, of 128-bit blocks, interleaved in turn.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i + c], 128-bit block k: column 4k + c of rows 4i..4i+3.
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v, x, 0x88), r[8 + c] = _mm512_shuffle_i32x4(v, x, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(w, y, 0x88), r[12 + c] = _mm512_shuffle_i32x4(w, y, 0xdd);
  }
}

}  // namespace

}  // namespace mha::detail
