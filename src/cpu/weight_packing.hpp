// Projection weights in the layouts oneDNN's matmul kernels read them in, written by our own code
// so that a call's threads share the packing (module/onednn_matmul.cpp). Both read 64 rows of
// b [cols][k] (rows ldb apart) from row 64 * slice, the slice's 64 columns of b^T, and write the
// slice's part of the packed weight at `out`, zeros past k and past cols. AVX-512 only: called
// where oneDNN chose these layouts, for its AVX-512 and AMX kernels.
#pragma once

#include <cstdint>

namespace mha::detail {

// oneDNN's BA16a64b2a over b^T (the AMX bf16 kernel's): 64 * round_up(k, 32) values, blocks of 32
// of k, each 16 pairs of k by 64 columns, a pair's two values adjacent.
void pack_bf16_weight_slice(const uint16_t* b, int64_t ldb, int64_t cols, int64_t k, int64_t slice, uint16_t* out);

// oneDNN's BA16a64b over b^T (the AVX-512 float32 kernel's): 64 * round_up(k, 16) values, blocks
// of 16 of k by 64 columns.
void pack_f32_weight_slice(const float* b, int64_t ldb, int64_t cols, int64_t k, int64_t slice, float* out);

}  // namespace mha::detail
