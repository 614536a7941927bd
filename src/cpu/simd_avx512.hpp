// 16 float lanes in one zmm register. Included only by *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/exp2_polynomial.hpp"
#include "cpu/transpose_avx.hpp"
#include "cpu/transpose_avx512.hpp"
#include "mha/dtype.hpp"

namespace mha::detail::simd {

namespace {  // internal linkage, one copy per instruction set's files (simd_avx2.hpp says why)

struct Avx512 {
  static constexpr int kLanes = 16;
  // Register block of the tile products (tile_kernels.hpp): 8 rows x 3 vectors: 24 accumulators + 3 operands + 1 broadcast of 32 zmm registers.
  static constexpr int kBlockRows = 8, kBlockVecs = 3, kRowsPerTile = 8;
  using F = __m512;
  using U = __m512i;  // 16 x uint32
  using M = __mmask16;

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // A store that bypasses the caches (p 64-byte aligned): for outputs written once and too large
  // to be read from cache soon; the writer calls stream_fence() before another thread reads them.
  static void stream(float* p, F v) { _mm512_stream_ps(p, v); }
  static void stream_fence() { _mm_sfence(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  // The lanes in reverse order (lane i takes lane 15 - i).
  static F reverse(F v) { return _mm512_permutexvar_ps(_mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), v); }
  // a * b where a is finite kept finite (saturated at +-FLT_MAX rather than overflowing to inf);
  // an infinite or NaN a as multiplied.
  static F mul_saturated(F a, F b) {
    const F big = _mm512_set1_ps(std::numeric_limits<float>::max());
    const F product = _mm512_mul_ps(a, b);
    const F clamped = _mm512_min_ps(_mm512_max_ps(product, _mm512_sub_ps(_mm512_setzero_ps(), big)), big);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(a), big, _CMP_NLE_UQ), clamped, product);
  }
  static void transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
    transpose8x8_avx(src, src_stride, dst, dst_stride);
  }
  static F select(M m, F if_true, F if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static bool all(M m) { return m == 0xffff; }

  // 2^x, with results below 2^-100 flushed to zero: they cannot change a softmax whose largest
  // term is 1, and letting them reach the subnormal range costs a microcode assist per lane (a
  // masked score, -inf, would otherwise land there). 2^x = 2^floor(x) 2^(x - floor(x)): the
  // fraction in one instruction (vreduceps), 2^f by kExp2PolyFrom0 (1.9e-9 relative, below float
  // rounding), scaled by 2^floor(x) exactly by vscalefps taking x itself (it floors it; past 128
  // it gives +inf). No rounding, subtraction or clamps: 9 instructions per vector, not 13. Below
  // -100 (and -inf) the mask gives 0 whatever was computed in those lanes (no subnormal is
  // computed in a masked lane); a NaN stays NaN (it compares false).
  static F exp2(F x) {
    const M tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-100.0f), _CMP_LT_OQ);
    const F f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // in [0, 1)
    const F p = exp2_polynomial(f, [](F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); },
                                [](float c) { return _mm512_set1_ps(c); }, kExp2PolyFrom0);
    return _mm512_maskz_scalef_ps(static_cast<M>(~tiny), p, x);
  }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  // out[0..4) = the sums of the lanes of a, b, c and d: pairs of lanes added within each 128-bit
  // quarter, then the quarters added. (The decoding kernel's dot mode: scores of 4 keys at once.)
  static void sum4(F a, F b, F c, F d, float* out) {
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const F abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // a b c d per quarter
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
  }
  // Query rows whose dot-mode scores share each load of a key vector: 4 rows of 4 keys are 16
  // accumulators, which with the 4 key vectors fit the 32 registers.
  static constexpr int kDotScoreRows = 4;

  static U load_u(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static U set1_u(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static U xor_u(U a, U b) { return _mm512_xor_si512(a, b); }
  static U add_u(U a, U b) { return _mm512_add_epi32(a, b); }
  static U mullo_u(U a, U b) { return _mm512_mullo_epi32(a, b); }
  template <int n> static U shr_u(U a) { return _mm512_srli_epi32(a, n); }
  static M ge_u(U a, U b) { return _mm512_cmp_epu32_mask(a, b, _MM_CMPINT_NLT); }
  static M lt_i(U a, U b) { return _mm512_cmp_epi32_mask(a, b, _MM_CMPINT_LT); }

  // kLanes bfloat16 / float16 values (as bits) straight into a register, exactly.
  // (The zero-masking forms with every lane set: GCC 12's unmasked ones start from an "undefined"
  // register that -Wuninitialized reports wherever they are inlined.)
  static F load_bf16(const uint16_t* p) {
    const __m512i x = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, x, 16));
  }
  static F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

  // kLanes float8 e4m3 values (as bits) into a register, exactly: each byte becomes the half
  // with the same sign, exponent field and mantissa (bias 15 against e4m3's 7, so a factor 2^-8
  // off, subnormals included), widened as a half and scaled by 2^8; 0x7f / 0xff are NaN.
  // load_f8_over_256: the values times 2^-8, exactly (for callers that fold the 2^8 elsewhere).
  static F load_f8_over_256(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i em = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8), _mm256_slli_epi16(em, 7));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7c00)));
    return _mm512_maskz_cvtph_ps(0xffff, h);
  }
  static F load_f8(const uint8_t* p) { return _mm512_mul_ps(load_f8_over_256(p), _mm512_set1_ps(256.0f)); }
  // NaN bytes are handled lane by lane above, without a branch: no test per block of rows.
  static F load_f8_over_256_finite(const uint8_t* p) { return load_f8_over_256(p); }
  static bool f8_rows_free_of_nan(const uint8_t* const*, int, int64_t) { return false; }
  // kLanes float8 e5m2 values (as bits), exactly: each byte shifted up is the half.
  static F load_f8e5m2(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_maskz_cvtph_ps(0xffff, _mm256_slli_epi16(w, 8));
  }
  static void widen_f8e5m2(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_f8e5m2(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(float8_e5m2::from_bits(src[i]));
  }
  static void widen_f8(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_f8(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(float8_e4m3::from_bits(src[i]));
  }

  // n bfloat16 / float16 values (as bits) to float32, exactly.
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(bfloat16::from_bits(src[i]));
  }
  static void widen_f16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    for (; i < n; ++i) dst[i] = static_cast<float>(float16::from_bits(src[i]));
  }

  // x rounded to bfloat16 as bfloat16(x) rounds (to nearest even, subnormals kept, NaN quieted),
  // the 16 bits in the high half of each lane. (vcvtne2ps2bf16 flushes subnormals to zero: fine
  // for probabilities, not for an output that must equal the rounded float32 one.)
  static __m512i bf16_high_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
  }

  // x rounded to float16 as float16(x) rounds (to nearest even, subnormals kept, past 65504 to
  // infinity), NaN as its sign | 0x7e00, the 16 bits in the high half of each lane.
  static __m512i f16_high_bits(__m512 x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))),
                                          _mm256_set1_epi16(0x7e00));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_mask_mov_epi16(h, nan, quiet)), 16);
  }

  // dst[d] = the 16-bit rounding (`dtype`: bfloat16 or float16) of src[d] * scale, d < n.
  static void store_16bit_row(DType dtype, const float* src, float scale, uint16_t* dst, int64_t n) {
    const bool half = dtype == DType::f16;
    const __m512 factor = _mm512_set1_ps(scale);
    auto rounded = [&](__m512 x) {
      x = _mm512_mul_ps(x, factor);
      return _mm512_cvtepi32_epi16(_mm512_srli_epi32(half ? f16_high_bits(x) : bf16_high_bits(x), 16));
    };
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), rounded(_mm512_loadu_ps(src + d)));
    if (d < n) {
      const __mmask16 valid = static_cast<__mmask16>((1u << (n - d)) - 1);
      _mm256_mask_storeu_epi16(dst + d, valid, rounded(_mm512_maskz_loadu_ps(valid, src + d)));
    }
  }
  // As store_16bit_row, past the caches (as stream): n a multiple of 16, dst 32-byte aligned.
  static void stream_16bit_row(DType dtype, const float* src, float scale, uint16_t* dst, int64_t n) {
    const bool half = dtype == DType::f16;
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t d = 0; d < n; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + d), factor);
      const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(half ? f16_high_bits(x) : bf16_high_bits(x), 16));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + d), bits);
    }
  }

  // Rows [0, rows) of a bfloat16 or float16 output (`dtype`) from its transpose: element d of row
  // r is the 16-bit rounding of ot[d * ot_stride + r] * scale[r], d < dims, the row at dst + r *
  // dst_stride. Pairs of dims are rounded into the 32-bit words they are in the row, then
  // transposed 16 x 16 words at a time: no float32 row buffer and no element-wise rounding. ot
  // holds whole vectors of rows (r < round_up(rows, 16)).
  static void store_16bit_rows(DType dtype, const float* ot, int64_t ot_stride, const float* scale, int64_t dims,
                               int64_t rows, uint16_t* dst, int64_t dst_stride) {
    const bool half = dtype == DType::f16;
    auto high_bits = [half](__m512 x) { return half ? f16_high_bits(x) : bf16_high_bits(x); };
    const int64_t words = (dims + 1) / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const __m512 factor = _mm512_loadu_ps(scale + r0);
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      for (int64_t w0 = 0; w0 < words; w0 += 16) {
        const int64_t n = std::min<int64_t>(16, words - w0);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          if (i >= n) {
            r[i] = _mm512_setzero_si512();
            continue;
          }
          const int64_t d = 2 * (w0 + i);
          const __m512i lo = high_bits(_mm512_mul_ps(_mm512_loadu_ps(ot + d * ot_stride + r0), factor));
          const __m512i hi = d + 1 < dims ? high_bits(_mm512_mul_ps(_mm512_loadu_ps(ot + (d + 1) * ot_stride + r0), factor))
                                          : _mm512_setzero_si512();
          r[i] = _mm512_mask_mov_epi16(_mm512_srli_epi32(lo, 16), 0xaaaaaaaau, hi);  // (lo, hi) in one word
        }
        transpose16x16(r);
        const int64_t halves = std::min<int64_t>(32, dims - 2 * w0);
        const __mmask32 valid = halves == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << halves) - 1);
        for (int64_t i = 0; i < nr; ++i) _mm512_mask_storeu_epi16(dst + (r0 + i) * dst_stride + 2 * w0, valid, r[i]);
      }
    }
  }
};

}  // namespace

}  // namespace mha::detail::simd
