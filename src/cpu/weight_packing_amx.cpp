// A bfloat16 weight in the layout of oneDNN's AMX matmul (BA16a64b2a), written on the caller's
// thread so that a projection's threads can share its packing (module/bf16_matmul.cpp).
#include <immintrin.h>

#include <cstring>

#include "cpu/amx.hpp"
#include "cpu/amx_tiles.hpp"

namespace mha::detail {

namespace {
constexpr int64_t kSliceRows = 64, kDepth = 32, kPairs = kDepth / 2;
}  // namespace

void amx_pack_weight_slice(const uint16_t* b, int64_t ldb, int64_t cols, int64_t k, int64_t slice, uint16_t* out) {
  const int64_t k_blocks = (k + kDepth - 1) / kDepth, row0 = slice * kSliceRows;
  const int64_t full_blocks = k / kDepth;
  // As 32-bit words (a pair of k each), a block is the 16 x 64 transpose of its 64 rows' 16
  // words: whole groups of 16 rows by 16 x 16 transposes, the ends of k and of cols by scalars.
  for (int64_t r0 = 0; r0 < kSliceRows; r0 += 16) {
    const bool whole_rows = row0 + r0 + 16 <= cols;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      uint16_t* block = out + kb * kDepth * kSliceRows;
      if (whole_rows && kb < full_blocks) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(b + (row0 + r0 + i) * ldb + kb * kDepth);
        amx::transpose16x16(r);
        for (int pair = 0; pair < kPairs; ++pair) _mm512_storeu_si512(block + (pair * kSliceRows + r0) * 2, r[pair]);
        continue;
      }
      for (int64_t i = r0; i < r0 + 16; ++i) {
        const int64_t row = row0 + i;
        for (int64_t pair = 0; pair < kPairs; ++pair) {
          const int64_t d = kb * kDepth + pair * 2;
          uint16_t* to = block + (pair * kSliceRows + i) * 2;
          to[0] = row < cols && d < k ? b[row * ldb + d] : 0;
          to[1] = row < cols && d + 1 < k ? b[row * ldb + d + 1] : 0;
        }
      }
    }
  }
}

}  // namespace mha::detail
