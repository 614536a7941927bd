// C += A B^T for bfloat16 A and B with float32 C, through oneDNN's matmul (its brgemm kernels on
// AVX512-BF16 or AMX): the projections of a bfloat16 module, which otherwise widen both operands
// and run float32 sgemm at a fraction of what the CPU's bf16 dot products do (about 170 against
// 400 GFLOP/s on 2 Zen 4 cores, the in-projection's shape).
#pragma once

#include <cstdint>
#include <memory>

namespace mha::detail {

// oneDNN was found when the library was built, the CPU has AVX512-BF16, and MHA_ISA does not ask
// for a path below AVX-512.
bool bf16_matmul_available();
// For tests: true turns the path off (projections widen and run sgemm, as without oneDNN).
void disable_bf16_matmul(bool disabled);

// What a block writes: c (float32) += a b^T; or c (bfloat16) = a b^T + bias, the float32 sum
// rounded once to nearest even (a bfloat16 Linear's output, as PyTorch's).
enum class Bf16Output { accumulate_f32, bf16_plus_bias };

// One shape of block, its primitive created once: c[rows][cols] (+)= a[rows][k] b[cols][k]^T, rows
// of a, b and c lda, ldb and ldc elements apart. run() computes on the calling thread alone, so a
// block's bits do not depend on how many threads share the blocks.
class Bf16MatmulBlock {
 public:
  Bf16MatmulBlock(int64_t rows, int64_t cols, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                  Bf16Output output = Bf16Output::accumulate_f32);
  ~Bf16MatmulBlock();
  Bf16MatmulBlock(Bf16MatmulBlock&&) noexcept;
  // c: float* (accumulate_f32) or uint16_t* bfloat16 bits; bias: the block's cols floats
  // (bf16_plus_bias; null adds none).
  void run(const uint16_t* a, const uint16_t* b, void* c, const float* bias = nullptr) const;

  // bf16_plus_bias blocks take b in the layout the tile kernel reads (repacked once for all
  // blocks, instead of by each block as it runs): packed_bytes() of it, written by pack() from
  // b [cols][k] (rows ldb apart); then run() with the packed copy as b. Blocks of one shape of b
  // (cols, k) may still differ in it: same_packing() tells.
  size_t packed_bytes() const;
  void pack(const uint16_t* b, void* packed) const;
  // Where the kernel's layout is the tile unit's (64 columns of b^T at a time, pairs of k
  // interleaved), it is also written here, in slices of 64 rows of b that threads may share:
  // pack_slices() of them (0 where only pack(), oneDNN's own reorder, knows the layout), slice s
  // by pack_slice(b, packed, s). Both write the same bytes.
  int64_t pack_slices() const;
  void pack_slice(const uint16_t* b, void* packed, int64_t slice) const;
  bool same_packing(const Bf16MatmulBlock& other) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mha::detail
