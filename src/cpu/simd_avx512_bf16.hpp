// AVX-512 with AVX512-BF16: the float32 layer (simd_avx512.hpp) plus products of bfloat16 pairs,
// vdpbf16ps (lane i of the accumulator += a[2i] b[2i] + a[2i+1] b[2i+1], each product exact in
// float32). Twice the FMA's products per instruction at the same issue rate (Zen 4 and 5, Cooper
// Lake, Sapphire Rapids). Included only by *_avx512bf16.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/exp2_polynomial.hpp"
#include "cpu/simd_avx512.hpp"
#include "cpu/transpose_avx512.hpp"

namespace mha::detail {

namespace {  // internal linkage, one copy per instruction set's files (simd_avx2.hpp says why)

// 2^x for probabilities that are rounded to bfloat16 before they are multiplied (the AMX kernels'
// tile products, the pair products) and for their float32 sums:
// 2^(x - floor(x)) by kExp2PolyBf16From0 (relative error 7.5e-5, a 26th of bfloat16's half unit,
// 2^-9), scaled by 2^floor(x) exactly; below 2^-100 (and for -inf) zero. Six instructions per 16
// scores: the fraction in one (vreduceps) and the scaling taking x itself (vscalefps floors it),
// against nine with a rounding, a subtraction and a clamp (the bf16 forward 1170-1215 to
// 1300-1385 GFLOP/s). Arguments below -100 are not clamped: the mask zeroes their lanes, whatever
// the fraction and the scaling made of them (no subnormal is computed in a masked lane).
inline __m512 exp2_bf16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-100.0f), _CMP_LT_OQ);  // true for -inf, not NaN
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x), in [0, 1)
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kExp2PolyBf16From0[3]), f, _mm512_set1_ps(kExp2PolyBf16From0[2]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2PolyBf16From0[1]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2PolyBf16From0[0]));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), y, x);  // y 2^floor(x)
}

}  // namespace

namespace simd {
namespace {  // (internal linkage, as above)

struct Avx512Bf16 : Avx512 {
  // The fused kernels take bfloat16 products (tile_kernels.hpp's pair products) where every
  // operand is bfloat16.
  static constexpr bool kBf16Pairs = true;
  using W = __m512i;  // 16 words, each a pair of bfloat16 values (the first in the low half)

  // 2^x for probabilities rounded to bfloat16 (exp2_bf16: 7.5e-5 relative, 6 instructions per
  // vector against exp2's 9).
  static F exp2_for_bf16(F x) { return exp2_bf16(x); }
  static F dot_pairs(W a, W b, F acc) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static W load_w(const uint32_t* p) { return _mm512_loadu_si512(p); }
  // (A pair read from bfloat16 rows: at any 2-byte boundary, so through memcpy, one broadcast load.)
  static W broadcast_w(const uint32_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    return _mm512_set1_epi32(word);
  }
  static void store_w(uint32_t* p, W v) { _mm512_storeu_si512(p, v); }
  // The first n (1..16) words of a bfloat16 row at p, the rest zero.
  static W load_words(const uint16_t* p, int64_t n) {
    return _mm512_maskz_loadu_epi32(n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1), p);
  }
  // Lane i of lo and of hi rounded to bfloat16 (to nearest even) as the pair of word i.
  static W pairs_of(F lo, F hi) {
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values, then hi's
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, halves);
  }
  // x[0, 16 n) rounded to bfloat16 (to nearest even; subnormals flush to zero, as vdpbf16ps reads
  // them anyway) over the start of x itself: element 2w in the low half of word w, 2w + 1 in the
  // high (pairs of neighbours as words). Each vector is read before its words are written.
  static void narrow_in_place(float* x, int n) {
    for (int v = 0; v < n; ++v) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + v * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(x) + v * 16), h);
    }
  }
  // Elements [d, d + 16) of bfloat16 rows a and b (as bits; a null row reads zeros, as do elements
  // past n) as the pairs of 16 words: word i holds (a[d + i], b[d + i]).
  static W interleave_rows(const uint16_t* a, const uint16_t* b, int64_t d, int64_t n) {
    const __mmask16 valid = n - d >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - d)) - 1);
    const __m512i x = a ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(valid, a + d)) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(valid, b + d)) : _mm512_setzero_si512();
    const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(x, index, y);
  }
  // The same for elements [d, d + 32): the pairs of [d, d + 16) in *lo, of [d + 16, d + 32) in
  // *hi, from one 64-byte load of each row (two interleaves of 16 took 1.07-1.11x the time of a
  // decoding step with 16 query rows per key/value head, bf16 d=128).
  static void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t d, int64_t n, W* lo, W* hi) {
    const __mmask32 valid = n - d >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (n - d)) - 1);
    const __m512i x = a ? _mm512_maskz_loadu_epi16(valid, a + d) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_maskz_loadu_epi16(valid, b + d) : _mm512_setzero_si512();
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    *lo = _mm512_permutex2var_epi16(x, first, y);
    *hi = _mm512_permutex2var_epi16(x, second, y);
  }
  // dst[w * dst_stride + r] = word w of row r (pairs of bfloat16 values at src + r * row_stride),
  // for w < words and r < dst_stride (a multiple of 16), zero for rows from `rows` on: a block of
  // rows transposed to pairs per row, 16 x 16 words at a time.
  static void transpose_pairs(const uint16_t* src, int64_t row_stride, int64_t rows, int64_t words, uint32_t* dst,
                              int64_t dst_stride) {
    for (int64_t r0 = 0; r0 < dst_stride; r0 += 16) {
      for (int64_t w0 = 0; w0 < words; w0 += 16) {
        const int64_t n = std::min<int64_t>(16, words - w0);
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = r0 + i < rows ? _mm512_maskz_loadu_epi32(valid, src + (r0 + i) * row_stride + 2 * w0) : _mm512_setzero_si512();
        transpose16x16(r);
        for (int64_t i = 0; i < n; ++i) _mm512_storeu_si512(dst + (w0 + i) * dst_stride + r0, r[i]);
      }
    }
  }
};

}  // namespace
}  // namespace simd
}  // namespace mha::detail
