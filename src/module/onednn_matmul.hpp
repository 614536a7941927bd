// Projection blocks through oneDNN's matmul (its brgemm kernels on AVX-512, AVX512-BF16 or AMX):
// - bfloat16 A and B, which otherwise widen both operands and run float32 sgemm at a fraction of
//   what the CPU's bf16 dot products do (about 170 against 400 GFLOP/s on 2 Zen 4 cores, the
//   in-projection's shape);
// - float32 A and B on a weight packed once per call, about 15% faster than OpenBLAS's sgemm on
//   the same blocks (177-189 against 142-164 GFLOP/s on a Sapphire Rapids core), which also
//   repacks the weight for every block;
// - float32 blocks of the gradients' products, either operand transposed: OpenBLAS 0.3.21 (Debian
//   12's) takes Zen 5 for a Haswell and runs 256-bit kernels there, 125 GFLOP/s on one core
//   against oneDNN's 207-250 on the module backward's blocks.
#pragma once

#include <cstdint>
#include <memory>

namespace mha::detail {

// oneDNN was found when the library was built, the CPU has AVX512-BF16, and MHA_ISA does not ask
// for a path below AVX-512.
bool bf16_matmul_available();
// For tests: true turns the path off (projections widen and run sgemm, as without oneDNN).
void disable_bf16_matmul(bool disabled);

// oneDNN was found, and the active ISA is AVX-512 or AMX (MHA_ISA=avx2 keeps OpenBLAS).
bool f32_matmul_available();
// For tests: true turns the path off (float32 projections run OpenBLAS's sgemm).
void disable_f32_matmul(bool disabled);

// What a block computes:
// - accumulate_f32: c (float32) += a b^T, a and b bfloat16;
// - bf16_plus_bias: c (bfloat16) = a b^T + bias, a and b bfloat16, the float32 sum rounded once
//   to nearest even (a bfloat16 Linear's output, as PyTorch's);
// - f32_plus_bias: c (float32) = a b^T + bias, a and b float32.
enum class MatmulOutput { accumulate_f32, bf16_plus_bias, f32_plus_bias };

// One shape of block, its primitive created once: c[rows][cols] (+)= a[rows][k] b[cols][k]^T, rows
// of a, b and c lda, ldb and ldc elements apart. run() computes on the calling thread alone, so a
// block's bits do not depend on how many threads share the blocks.
class MatmulBlock {
 public:
  MatmulBlock(int64_t rows, int64_t cols, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, MatmulOutput output);
  // A block of a general product (a gradient's): c[rows][cols] = op(a) op(b) + beta c, op the
  // transpose where asked: a is [rows][k] or, transposed, [k][rows]; b is [k][cols] or,
  // transposed, [cols][k]. All float32, or with `bf16` all bfloat16 (the float32 sum rounded once;
  // beta must then be 0). beta = 0 never reads c.
  MatmulBlock(int64_t rows, int64_t cols, int64_t k, bool transpose_a, int64_t lda, bool transpose_b, int64_t ldb,
              int64_t ldc, float beta, bool bf16 = false);
  ~MatmulBlock();
  MatmulBlock(MatmulBlock&&) noexcept;
  // a, b: bfloat16 bits or floats (as the output kind says); c: float* or bfloat16 bits; bias:
  // the block's cols floats (the *_plus_bias kinds; null adds none).
  void run(const void* a, const void* b, void* c, const float* bias = nullptr) const;

  // The *_plus_bias blocks take b in the layout their kernel reads (repacked once for all blocks,
  // instead of by each block as it runs): packed_bytes() of it, written by pack() from b
  // [cols][k] (rows ldb apart); then run() with the packed copy as b. Blocks of one shape of b
  // (cols, k) may still differ in it: same_packing() tells.
  size_t packed_bytes() const;
  void pack(const void* b, void* packed) const;
  bool same_packing(const MatmulBlock& other) const;
  // Where that layout is one of cpu/weight_packing.hpp's, it is also written by our own code, in
  // slices of 64 rows of b that threads may share: pack_slices() of them (0 where only pack(),
  // oneDNN's own reorder, knows the layout), slice s by pack_slice(b, packed, s). Both write the
  // same bytes.
  int64_t pack_slices() const;
  void pack_slice(const void* b, void* packed, int64_t slice) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mha::detail
