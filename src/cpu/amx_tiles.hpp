// The tile unit's (AMX) building blocks shared by the bfloat16 kernels: the tile configuration,
// the 2 x 2 block of tile products and the packed operand layouts (the 2^x for probabilities
// rounded to bfloat16, exp2_bf16, is simd_avx512_bf16.hpp's). Included only by files compiled for AMX (*_amx.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "core/host_memory.hpp"
#include "cpu/simd_avx512_bf16.hpp"
#include "cpu/transpose_avx512.hpp"

namespace mha::detail::amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes. The configuration is built once, in static storage: built on
// the stack at each call, GCC 12 let the stores of its column widths fall after the ldtilecfg
// that reads them (the intrinsic does not tell it the memory is read), which loaded an invalid
// configuration (a #GP) in one caller.
inline void configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&config);
}

// n bfloat16 values, 64-byte aligned, from the host block cache (a call of a module allocates
// the same packed panels every time: fresh pages would cost a fault and a zeroing each).
inline std::shared_ptr<std::byte> bf16_buffer(int64_t n) {
  std::shared_ptr<std::byte> p = host_allocate(static_cast<size_t>(n) * 2);
  if (p == nullptr && n > 0) throw std::bad_alloc();
  return p;
}

// float32 to bfloat16 bits, rounding to nearest even (local: this file is compiled for AMX, and
// its copy of a shared inline helper must not stand in for the portable one).
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// tmm0-3 += the 2 x 2 block of 16 x 16 tile products of A (rows a0 and a1: tmm4-5) and B (16
// columns at b0, 16 at b1: tmm6-7), strides in bytes: tmm0 = A0 B0, tmm1 = A0 B1, tmm2 = A1 B0,
// tmm3 = A1 B1. Each operand is loaded just before its first product, so that the tile unit
// starts while the rest load (the AMX backward 3-9% faster than loading all four first; the
// forward level).
inline void tile_products(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1,
                          int64_t b_stride) {
  _tile_loadd(4, a0, static_cast<long>(a_stride));
  _tile_loadd(6, b0, static_cast<long>(b_stride));
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b1, static_cast<long>(b_stride));
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, a1, static_cast<long>(a_stride));
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// The 2 x 2 block of 16 x 16 floats at c (rows ld floats apart) += A B through tmm0-3, where one
// operand stays loaded across calls and the other is loaded here (at p0 and p1, stride bytes):
// new_b, B's 16 columns at p0 and 16 at p1 (tmm6-7) against A in tmm4-5; new_a, A's rows at p0
// and p1 (tmm4-5) against B in tmm6-7. Each accumulator is loaded just before its product, so
// that the tile unit starts on the first while the others load (the AMX backward's dV and dK:
// 3-6% over loading all four first).
enum class NewOperand { a, b };
inline void accumulate_2x2(float* c, int64_t ld, NewOperand fresh, const void* p0, const void* p1, int64_t stride) {
  const long c_stride = static_cast<long>(ld * 4), s = static_cast<long>(stride);
  const bool a = fresh == NewOperand::a;
  _tile_loadd(0, c, c_stride);
  if (a) _tile_loadd(4, p0, s);
  else _tile_loadd(6, p0, s);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(1, c + 16, c_stride);
  if (!a) _tile_loadd(7, p1, s);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(2, c + 16 * ld, c_stride);
  if (a) _tile_loadd(5, p1, s);
  _tile_dpbf16ps(2, 5, 6);
  _tile_loadd(3, c + 16 * ld + 16, c_stride);
  _tile_dpbf16ps(3, 5, 7);
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c + 16 * ld, c_stride);
  _tile_stored(3, c + 16 * ld + 16, c_stride);
}

// tmm0-3 from / to the 2 x 2 block of 16 x 16 floats at c, rows ld floats apart: tmm0 at c,
// tmm1 16 columns right, tmm2 16 rows down, tmm3 both.
inline void load_accumulators(const float* c, int64_t ld) {
  const long stride = static_cast<long>(ld * 4);
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16, stride);
  _tile_loadd(2, c + 16 * ld, stride);
  _tile_loadd(3, c + 16 * ld + 16, stride);
}
inline void store_accumulators(float* c, int64_t ld) {
  const long stride = static_cast<long>(ld * 4);
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 16 * ld, stride);
  _tile_stored(3, c + 16 * ld + 16, stride);
}

// A head dim rounded up to the tile's depth of 32 bfloat16 values: rows are zero past the
// dim, which adds nothing to Q K^T, and past dv the output columns are dropped.
inline int64_t padded(int64_t d) { return (d + 31) / 32 * 32; }

// The row pitch of a packed operand whose rows hold `n` 32-bit words (or floats): a cache line
// more. A tile's 16 rows a multiple of 4 KiB apart (L = 1024 and up) would share one set of the
// 12-way L1, and each tile load would evict the previous one's lines.
inline int64_t pitch_of(int64_t n) { return n + 16; }

// Lanes [0, n) of a 32-lane 16-bit mask (all of them from 32 on, none below 0).
inline __mmask32 first_lanes(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : n <= 0 ? __mmask32{0} : static_cast<__mmask32>((uint32_t{1} << n) - 1);
}

// Rows [0, rows) of `dim` bfloat16 values (row r at src + r * row_stride) as the B operand of a
// product over the dims: pairs of dims, one 32-bit word per row and pair, transposed 16 x 16
// words at a time, dst[dim_padded / 2][pitch][2] (pitch 0: len_padded), of which the first
// len_padded words of each row are written. Zeros past dim and past rows. len_padded is a
// multiple of 16, dim_padded of 32.
inline void pack_pairs_of_dims(const uint16_t* src, int64_t row_stride, int64_t rows, int64_t dim, int64_t len_padded,
                               int64_t dim_padded, uint16_t* dst, int64_t pitch = 0) {
  if (pitch == 0) pitch = len_padded;
  uint32_t* words = reinterpret_cast<uint32_t*>(dst);
  for (int64_t j0 = 0; j0 < len_padded; j0 += 16) {
    for (int64_t d2 = 0; d2 < dim_padded / 2; d2 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < rows ? _mm512_maskz_loadu_epi16(first_lanes(dim - 2 * d2), src + (j0 + i) * row_stride + 2 * d2)
                             : _mm512_setzero_si512();
      transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(words + (d2 + i) * pitch + j0, r[i]);
    }
  }
}

// Two rows of 32 bfloat16 values, x0 and x1, as pairs per column (x0[c], x1[c]): columns 0-15 to
// dst[0..32), columns 16-31 to dst[32..64) (the tile unit's B layout over two rows).
inline void store_interleaved(__m512i x0, __m512i x1, uint16_t* dst) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x0, lo, x1));
  _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(x0, hi, x1));
}

// The same rows as the B operand of a product over the rows: pairs of rows interleaved per
// column, dst[len_padded / 2][dim_padded][2]. Zeros past dim and past rows. len_padded is even,
// dim_padded a multiple of 32.
inline void pack_pairs_of_rows(const uint16_t* src, int64_t row_stride, int64_t rows, int64_t dim, int64_t len_padded,
                               int64_t dim_padded, uint16_t* dst) {
  for (int64_t j = 0; j < len_padded; j += 2) {
    const uint16_t* r0 = j < rows ? src + j * row_stride : nullptr;
    const uint16_t* r1 = j + 1 < rows ? src + (j + 1) * row_stride : nullptr;
    uint16_t* out = dst + (j / 2) * dim_padded * 2;
    for (int64_t d = 0; d < dim_padded; d += 32) {
      const __mmask32 valid = first_lanes(dim - d);
      const __m512i x0 = r0 ? _mm512_maskz_loadu_epi16(valid, r0 + d) : _mm512_setzero_si512();
      const __m512i x1 = r1 ? _mm512_maskz_loadu_epi16(valid, r1 + d) : _mm512_setzero_si512();
      store_interleaved(x0, x1, out + 2 * d);
    }
  }
}

}  // namespace mha::detail::amx
