// 16 float lanes as two ymm registers: the AVX2 + FMA layer, for CPUs without AVX-512. The same
// operations as simd_avx512.hpp; masks are 16-bit integers (bit i: lane i), as there.
// Included only by *_avx2.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/exp2_polynomial.hpp"
#include "cpu/transpose_avx.hpp"
#include "mha/dtype.hpp"

namespace mha::detail::simd {

// Internal linkage (an unnamed namespace): each instruction set's files compile this header
// in their own target region (cpu/isa_region.hpp), and a definition shared between them would
// leave the linker one copy to keep for all, possibly another set's (an AVX-512 transpose ran on
// an AVX2 CPU, SIGILL, once the sanitizers' build stopped inlining it).
namespace {

struct Avx2 {
  static constexpr int kLanes = 16;
  // Register block of the tile products (tile_kernels.hpp): 6 rows x 1 vector (2 ymm): 12
  // accumulators + 2 operands + 1 broadcast of 16 ymm registers; 12 rows per dot_rows call.
  static constexpr int kBlockRows = 6, kBlockVecs = 1, kRowsPerTile = 12;
  struct F {
    __m256 lo, hi;
  };
  struct U {
    __m256i lo, hi;
  };
  using M = uint32_t;

  static F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, F v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  }
  // As Avx512::stream (p 64-byte aligned).
  static void stream(float* p, F v) {
    _mm256_stream_ps(p, v.lo);
    _mm256_stream_ps(p + 8, v.hi);
  }
  static void stream_fence() { _mm_sfence(); }
  static F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static F max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static F min(F a, F b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  // The lanes in reverse order (lane i takes lane 15 - i).
  static F reverse(F v) {
    const __m256i down = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    return {_mm256_permutevar8x32_ps(v.hi, down), _mm256_permutevar8x32_ps(v.lo, down)};
  }
  // a * b where a is finite kept finite (saturated at +-FLT_MAX rather than overflowing to inf);
  // an infinite or NaN a as multiplied.
  static F mul_saturated(F a, F b) {
    auto half = [](__m256 x, __m256 y) {
      const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
      const __m256 product = _mm256_mul_ps(x, y);
      const __m256 clamped = _mm256_min_ps(_mm256_max_ps(product, _mm256_sub_ps(_mm256_setzero_ps(), big)), big);
      const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
      return _mm256_blendv_ps(clamped, product, _mm256_cmp_ps(magnitude, big, _CMP_NLE_UQ));  // inf or NaN
    };
    return {half(a.lo, b.lo), half(a.hi, b.hi)};
  }
  static float reduce_max(F v) {
    const __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  }

  // out[0..4) = the sums of the lanes of a, b, c and d: a tree of horizontal adds, in registers
  // (dot products of whole rows, few_queries.hpp).
  static void sum4(F a, F b, F c, F d, float* out) {
    const __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
    const __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lanes 0-3: the low halves' sums, 4-7: the high ones'
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }

  // A lane mask from bits: lane i is all ones where bit i is set.
  static __m256 lanes_of(uint32_t bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
  }
  static M bits_of(__m256 lo, __m256 hi) {
    return static_cast<M>(_mm256_movemask_ps(lo)) | (static_cast<M>(_mm256_movemask_ps(hi)) << 8);
  }
  static F select(M m, F t, F f) {
    return {_mm256_blendv_ps(f.lo, t.lo, lanes_of(m & 0xffu)), _mm256_blendv_ps(f.hi, t.hi, lanes_of(m >> 8))};
  }
  static M eq(F a, F b) { return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)); }
  static M gt(F a, F b) { return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)); }
  static bool all(M m) { return m == 0xffffu; }

  // (Always inlined: called out of line, with its 16 lanes passed and returned through memory,
  // the exponential took 23% of an AVX2 forward at L=128 and the forward ran at 0.73x its speed.)
  // 2^x with the AVX-512 layer's rules: below 2^-100 flushed to zero (so -inf gives 0), the same
  // polynomial (kExp2Poly) on f = x - round(x), and 2^n built from the exponent bits.
  [[gnu::always_inline]] static __m256 exp2_half(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-100.0f), _CMP_LT_OQ);
    // The constant first: max/min return their second operand when either is NaN, so a NaN
    // score stays NaN (and propagates to the output) instead of being clamped away.
    x = _mm256_max_ps(_mm256_set1_ps(-100.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(128.0f), x);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    const __m256 p = exp2_polynomial(f, [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
                                     [](float c) { return _mm256_set1_ps(c); });
    // 2^n for n in [-100, 128]: n = 128 gives the bits of infinity, right for x >= 128 and a
    // factor of at most 1.42 early for x in [127.5, 128) (softmax arguments are never above 0).
    // Maximum relative error 7.7e-8 below that (tests/test_exp2.cpp).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
  [[gnu::always_inline]] static F exp2(F x) { return {exp2_half(x.lo), exp2_half(x.hi)}; }

  static void transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
    transpose8x8_avx(src, src_stride, dst, dst_stride);
  }

  static U load_u(const uint32_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
  }
  static U set1_u(uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x)), _mm256_set1_epi32(static_cast<int>(x))}; }
  static U xor_u(U a, U b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
  static U add_u(U a, U b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static U mullo_u(U a, U b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
  template <int n> static U shr_u(U a) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
  static M ge_u(U a, U b) {  // unsigned a >= b  <=>  max(a, b) == a
    const __m256i lo = _mm256_cmpeq_epi32(_mm256_max_epu32(a.lo, b.lo), a.lo);
    const __m256i hi = _mm256_cmpeq_epi32(_mm256_max_epu32(a.hi, b.hi), a.hi);
    return bits_of(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
  }
  static M lt_i(U a, U b) {
    return bits_of(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo)), _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi)));
  }

  // kLanes bfloat16 / float16 values (as bits) straight into a register, exactly.
  static F load_bf16(const uint16_t* p) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  }
  static F load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }

  // kLanes float8 e4m3 values (as bits) into a register, exactly: each byte b becomes the half
  // (b << 8) >> 1 (arithmetic) with bit 14 cleared, the same sign, exponent field and mantissa
  // under a bias of 15 against e4m3's 7, so a factor 2^-8 off, subnormals included; F16C widens
  // it and 2^8 restores the scale. NaN bytes (0x7f, 0xff: no half of this form) are rare, so
  // they are looked for 16 at a time and take the scalar conversion.
  static __m256 f8x8_over_256(__m128i bytes) {
    const __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);  // b << 8
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(w, 1), _mm_set1_epi16(static_cast<short>(0xbfff))));
  }
  // The values times 2^-8, exactly: a caller that folds the 2^8 into another operand (a power of
  // two moves no rounding) saves the multiplication.
  static F load_f8_over_256(const uint8_t* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i all = _mm_set1_epi8(static_cast<char>(0xff));
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_or_si128(x, _mm_set1_epi8(static_cast<char>(0x80))), all)) != 0) [[unlikely]] {
      alignas(32) float v[kLanes];
      for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(float8_e4m3::from_bits(p[i])) * 0.00390625f;
      return load(v);
    }
    return {f8x8_over_256(x), f8x8_over_256(_mm_unpackhi_epi64(x, x))};
  }
  // The same for bytes known to hold no NaN (f8_rows_free_of_nan): without the test.
  static F load_f8_over_256_finite(const uint8_t* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {f8x8_over_256(x), f8x8_over_256(_mm_unpackhi_epi64(x, x))};
  }
  // Whether no e4m3 NaN (0x7f, 0xff) lies in the first `width` bytes (a multiple of kLanes) of
  // rows[0..n): one test per block of rows, 32 bytes at a time, instead of one per 16 as loaded.
  static bool f8_rows_free_of_nan(const uint8_t* const* rows, int n, int64_t width) {
    const __m256i high = _mm256_set1_epi8(static_cast<char>(0x80)), all = _mm256_set1_epi8(static_cast<char>(0xff));
    __m256i hit = _mm256_setzero_si256();
    __m128i tail = _mm_setzero_si128();
    for (int r = 0; r < n; ++r) {
      int64_t d = 0;
      for (; d + 32 <= width; d += 32) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + d));
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi8(_mm256_or_si256(x, high), all));
      }
      if (d < width) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + d));
        tail = _mm_or_si128(tail, _mm_cmpeq_epi8(_mm_or_si128(x, _mm256_castsi256_si128(high)), _mm256_castsi256_si128(all)));
      }
    }
    return _mm256_testz_si256(hit, hit) && _mm_testz_si128(tail, tail);
  }
  static F load_f8(const uint8_t* p) { return mul(load_f8_over_256(p), set1(256.0f)); }
  // kLanes float8 e5m2 values (as bits) into a register, exactly: each byte shifted up is the half
  // (infinities, NaN and subnormals included), which F16C widens.
  static F load_f8e5m2(const uint8_t* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x)),
            _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), x))};
  }
  static void widen_f8e5m2(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(dst + i, load_f8e5m2(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(float8_e5m2::from_bits(src[i]));
  }
  static void widen_f8(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(dst + i, load_f8(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(float8_e4m3::from_bits(src[i]));
  }

  // n bfloat16 / float16 values (as bits) to float32, exactly (F16C for the halves).
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(bfloat16::from_bits(src[i]));
  }
  static void widen_f16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = static_cast<float>(float16::from_bits(src[i]));
  }

  // 8 floats rounded to bfloat16 or float16 (`half`) as bfloat16(x) and float16(x) round them (to
  // nearest even, subnormals kept, NaN quieted: bfloat16 keeps its payload's top bits, float16
  // writes sign | 0x7e00), the 16 bits in the low half of each 32-bit lane.
  static __m256i bits_16(__m256 x, bool half) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (half) {
      const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m128i quiet = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))), _mm_set1_epi16(0x7e00));
      const __m256i n32 = _mm256_castps_si256(nan);
      const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n32), _mm256_extracti128_si256(n32, 1));
      return _mm256_cvtepu16_epi32(_mm_blendv_epi8(h, quiet, n16));
    }
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quieted = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quieted, _mm256_castps_si256(nan)), 16);
  }

  // dst[d] = the 16-bit rounding (`dtype`: bfloat16 or float16) of src[d] * scale, d < n.
  static void store_16bit_row(DType dtype, const float* src, float scale, uint16_t* dst, int64_t n) {
    const bool half = dtype == DType::f16;
    const __m256 factor = _mm256_set1_ps(scale);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
      const __m256i b = bits_16(_mm256_mul_ps(_mm256_loadu_ps(src + d), factor), half);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
    for (; d < n; ++d) dst[d] = half ? float16(src[d] * scale).bits : bfloat16(src[d] * scale).bits;
  }
  // As store_16bit_row, past the caches (as stream): n a multiple of 16, dst 32-byte aligned.
  static void stream_16bit_row(DType dtype, const float* src, float scale, uint16_t* dst, int64_t n) {
    const bool half = dtype == DType::f16;
    const __m256 factor = _mm256_set1_ps(scale);
    for (int64_t d = 0; d < n; d += 8) {
      const __m256i b = bits_16(_mm256_mul_ps(_mm256_loadu_ps(src + d), factor), half);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + d), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
  }

  // Rows [0, rows) of a bfloat16 or float16 output (`dtype`) from its transpose: element d of row
  // r is the 16-bit rounding of ot[d * ot_stride + r] * scale[r], d < dims, the row at dst + r *
  // dst_stride. As on AVX-512: pairs of dims rounded into the 32-bit words they are in the row,
  // then transposed 8 x 8 words at a time. ot holds whole groups of 8 rows.
  static void store_16bit_rows(DType dtype, const float* ot, int64_t ot_stride, const float* scale, int64_t dims,
                               int64_t rows, uint16_t* dst, int64_t dst_stride) {
    const bool half = dtype == DType::f16;
    const int64_t words = (dims + 1) / 2;
    alignas(32) float block[64], out[64];  // 8 x 8 words, as floats for the transpose (bits kept)
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const __m256 factor = _mm256_loadu_ps(scale + r0);
      const int64_t nr = std::min<int64_t>(8, rows - r0);
      for (int64_t w0 = 0; w0 < words; w0 += 8) {
        const int64_t n = std::min<int64_t>(8, words - w0);
        for (int i = 0; i < 8; ++i) {
          __m256i w = _mm256_setzero_si256();
          if (i < n) {
            const int64_t d = 2 * (w0 + i);
            w = bits_16(_mm256_mul_ps(_mm256_loadu_ps(ot + d * ot_stride + r0), factor), half);
            if (d + 1 < dims) {
              const __m256i hi = bits_16(_mm256_mul_ps(_mm256_loadu_ps(ot + (d + 1) * ot_stride + r0), factor), half);
              w = _mm256_or_si256(w, _mm256_slli_epi32(hi, 16));
            }
          }
          _mm256_store_ps(block + 8 * i, _mm256_castsi256_ps(w));
        }
        transpose8x8_avx(block, 8, out, 8);
        const int64_t halves = std::min<int64_t>(16, dims - 2 * w0);
        for (int64_t i = 0; i < nr; ++i) {
          uint16_t* row = dst + (r0 + i) * dst_stride + 2 * w0;
          if (halves == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm256_castps_si256(_mm256_load_ps(out + 8 * i)));
          else std::memcpy(row, out + 8 * i, sizeof(uint16_t) * static_cast<size_t>(halves));
        }
      }
    }
  }
};

}  // namespace

}  // namespace mha::detail::simd
