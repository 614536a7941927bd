#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX512)
#include "cpu/weight_packing.hpp"
#include "cpu/transpose_avx512.hpp"

namespace mha::detail {

namespace {

constexpr int64_t kSliceCols = 64;

// Both layouts, as 32-bit words (a pair of bfloat16 values or one float each), are blocks of 16
// words of k by 64 columns: a block is the 16 x 64 transpose of its 64 rows' 16 words, whole
// groups of 16 rows by 16 x 16 transposes, the ends of k and of cols word by word (`scalar`).
template <typename Scalar>
void pack_words(const uint32_t* b, int64_t ldb_words, int64_t cols, int64_t k_words, int64_t slice, uint32_t* out,
                Scalar scalar) {
  const int64_t blocks = (k_words + 15) / 16, row0 = slice * kSliceCols;
  for (int64_t r0 = 0; r0 < kSliceCols; r0 += 16) {
    const bool whole_rows = row0 + r0 + 16 <= cols;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      uint32_t* block = out + kb * 16 * kSliceCols;
      if (whole_rows && kb * 16 + 16 <= k_words) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(b + (row0 + r0 + i) * ldb_words + kb * 16);
        transpose16x16(r);
        for (int w = 0; w < 16; ++w) _mm512_storeu_si512(block + w * kSliceCols + r0, r[w]);
        continue;
      }
      for (int64_t i = r0; i < r0 + 16; ++i)
        for (int64_t w = 0; w < 16; ++w) block[w * kSliceCols + i] = scalar(row0 + i, kb * 16 + w);
    }
  }
}

}  // namespace

void pack_bf16_weight_slice(const uint16_t* b, int64_t ldb, int64_t cols, int64_t k, int64_t slice, uint16_t* out) {
  // Whole words only where each row's pairs are: an odd k or ldb takes the scalar path throughout.
  const bool words = k % 2 == 0 && ldb % 2 == 0;
  auto scalar = [&](int64_t row, int64_t word) {
    const int64_t d = word * 2;
    const uint32_t lo = row < cols && d < k ? b[row * ldb + d] : 0, hi = row < cols && d + 1 < k ? b[row * ldb + d + 1] : 0;
    return lo | hi << 16;
  };
  pack_words(reinterpret_cast<const uint32_t*>(b), ldb / 2, words ? cols : 0, (k + 1) / 2, slice,
             reinterpret_cast<uint32_t*>(out), scalar);
}

void pack_f32_weight_slice(const float* b, int64_t ldb, int64_t cols, int64_t k, int64_t slice, float* out) {
  const auto* w = reinterpret_cast<const uint32_t*>(b);
  auto scalar = [&](int64_t row, int64_t d) { return row < cols && d < k ? w[row * ldb + d] : 0u; };
  pack_words(w, ldb, cols, k, slice, reinterpret_cast<uint32_t*>(out), scalar);
}

}  // namespace mha::detail
MHA_ISA_END
