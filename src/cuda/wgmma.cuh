// The Hopper tensor-core instructions (wgmma, sm_90a) as the attention kernels use them: shared-
// memory matrix descriptors for the 128-byte swizzled layout, the fence / commit / wait that order
// the asynchronous products, and the product shapes (m64 n64/n128 k16, fp32 accumulators).
//
// Layout (PTX ISA, "asynchronous warpgroup level matrix shared memory layout"): a tile is stored
// as blocks of 64 columns (128 bytes of 16-bit elements per row); within a block, row r sits at
// r * 128 bytes and its 16-byte chunk c at ((c ^ (r % 8)) * 16): the 128-byte swizzle, which
// spreads any 8 rows' chunk c over all banks. Each block starts on a 1024-byte boundary.
//   K-major operand (Q and K for S = Q K^T: the reduction dim is the row's contiguous one):
//     8-row groups 1024 bytes apart (the stride byte offset); a k16 step is +32 bytes inside
//     the block, the next 64-column block at +rows * 128 bytes.
//   MN-major operand (V for O = P V: the reduction runs over rows, N along a row): 8-row groups
//     1024 bytes apart (stride byte offset), 64-column blocks rows * 128 bytes apart (leading
//     byte offset), transposed in the instruction; a k16 step is +16 rows = 2048 bytes.
// Accumulators of m64nN: warp w of the warpgroup holds rows 16 w .. 16 w + 15; with g = lane / 4
// and t = lane % 4, d[4 n + e] is row 16 w + g + 8 (e / 2), column 8 n + 2 t + e % 2: the same
// as n consecutive mma.m16n8 C fragments, and the A register fragment of m64k16 is mma.m16n8k16's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace mha::detail::gpu {

// A descriptor of a 128-byte-swizzled operand at shared address `address` (1024-byte aligned
// blocks; the 32-byte k16 steps inside a block keep the base offset 0).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | uint64_t{1} << 62;
}

// Orders register writes before the products that read them (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int pending> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Shared memory written by ordinary stores or cp.async, read next by wgmma (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across a wait.
template <int N> __device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_registers(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The accumulator operands of an N-column product (N / 2 floats per thread), as register
// numbers in the instruction and as asm operands.
#define MHA_WGMMA_D32_REGISTERS                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

#define MHA_WGMMA_D32_OPERANDS                                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define MHA_WGMMA_D64_REGISTERS                                                      \
  MHA_WGMMA_D32_REGISTERS ", "                                                       \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define MHA_WGMMA_D64_OPERANDS                                                                            \
  MHA_WGMMA_D32_OPERANDS,                                                                                 \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A B for a 64 x N x 16 step. ss: A and B from shared memory, both K-major; accumulate = 0
// overwrites d. rs: A from registers, B MN-major (transposed), always accumulates. The last
// argument picks the element type (one definition per shape, instantiated for bf16 and fp16).
#define MHA_WGMMA_SS_M64N128K16(TYPE, PTX_TYPE)                                                                       \
  __device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int accumulate, TYPE) { \
    asm volatile(                                                                                                     \
      "{\n.reg .pred p;\n"                                                                                            \
      "setp.ne.b32 p, %66, 0;\n"                                                                                      \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                                        \
      "{" MHA_WGMMA_D64_REGISTERS                                                                                     \
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                                                              \
      : MHA_WGMMA_D64_OPERANDS                                                                                        \
      : "l"(a), "l"(b), "r"(accumulate));                                                                             \
  }

#define MHA_WGMMA_RS_M64N64K16(TYPE, PTX_TYPE)                                                                   \
  __device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t b, TYPE) { \
    asm volatile(                                                                                                \
      "{\n.reg .pred p;\n"                                                                                       \
      "setp.ne.b32 p, %37, 0;\n"                                                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " "                                    \
      "{" MHA_WGMMA_D32_REGISTERS                                                                                \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                           \
      : MHA_WGMMA_D32_OPERANDS                                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                                             \
  }

#define MHA_WGMMA_RS_M64N128K16(TYPE, PTX_TYPE)                                                                   \
  __device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t b, TYPE) { \
    asm volatile(                                                                                                 \
      "{\n.reg .pred p;\n"                                                                                        \
      "setp.ne.b32 p, %69, 0;\n"                                                                                  \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                                    \
      "{" MHA_WGMMA_D64_REGISTERS                                                                                 \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                            \
      : MHA_WGMMA_D64_OPERANDS                                                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                                              \
  }

MHA_WGMMA_SS_M64N128K16(__nv_bfloat16, "bf16")
MHA_WGMMA_RS_M64N64K16(__nv_bfloat16, "bf16")
MHA_WGMMA_RS_M64N128K16(__nv_bfloat16, "bf16")
MHA_WGMMA_SS_M64N128K16(__half, "f16")
MHA_WGMMA_RS_M64N64K16(__half, "f16")
MHA_WGMMA_RS_M64N128K16(__half, "f16")

#undef MHA_WGMMA_SS_M64N128K16
#undef MHA_WGMMA_RS_M64N64K16
#undef MHA_WGMMA_RS_M64N128K16
#undef MHA_WGMMA_D32_REGISTERS
#undef MHA_WGMMA_D32_OPERANDS
#undef MHA_WGMMA_D64_REGISTERS
#undef MHA_WGMMA_D64_OPERANDS

}  // namespace mha::detail::gpu
