// What the GPU attention kernels share: the problem as the kernels see it (Params), the 16-bit
// element types' packing and mma.sync, the small PTX helpers (shared addresses, cp.async, ex2,
// ldmatrix), tile copies into padded shared memory and the masks' bias. Device code only; included by the .cu files of src/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

namespace mha::detail::gpu {

constexpr int kMaxMasks = 3;

struct GpuMask {
  const void* data;
  int kind;  // 0: additive float32, 1: bool keep-if-true, 2: bool drop-if-true
  long long strides[4];
};

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // [B, Hq, Lq] contiguous, or null
  long long q_strides[3], k_strides[3], v_strides[3], out_strides[3];  // (b, h, l); the head dim is unit-stride
  int heads_q, group, len_q, len_k;
  float scale_log2;  // scale * log2(e): scores go straight to base-2 exponents
  int causal;
  long long causal_offset;  // query i sees key j iff j <= i + causal_offset
  int num_masks;
  GpuMask masks[kMaxMasks];
};

template <class T> struct Pack;
template <> struct Pack<__nv_bfloat16> {
  static __device__ uint32_t two(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Pack<__half> {
  static __device__ uint32_t two(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 2^x in one MUFU instruction (relative error about 2^-22, far below bf16/fp16 rounding);
// 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Starts a 16-byte copy from global to shared memory; with `bytes` = 0 nothing is read and the
// 16 bytes are zero-filled (`from` must still be a valid address).
__device__ __forceinline__ void copy_16_async(uint32_t to, const void* from, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(bytes) : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `pending` of this thread's committed copy groups are still in flight.
template <int pending> __device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// ldmatrix.x4: lane l addresses row l % 8 of 8x8 matrix l / 8 and receives its pieces of all four
// (the fragment layouts are in flash_forward.cu); .trans transposes each matrix on the way.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}

// Starts copying Rows rows of D elements into shared memory rows of D + Pad elements (rows past
// `valid` are zero-filled: the copy reads 0 bytes of them, from row 0, which exists). Completes
// at the matching wait. Each of the Threads threads copies one 16-byte column chunk of every
// Threads / (D / 8)-th row: a fixed trip count, so the loop unrolls into straight-line copies
// with one address step each.
template <class T, int D, int Rows, int Threads, int Pad>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* src, long long row_stride, int valid) {
  constexpr int kChunks = D / 8, kRowsPerPass = Threads / kChunks;
  static_assert(Rows % kRowsPerPass == 0, "a tile is a whole number of passes");
  const int r0 = threadIdx.x / kChunks, col = threadIdx.x % kChunks * 8;
  const T* from = src + r0 * row_stride + col;
  const uint32_t to = shared_address(tile + r0 * (D + Pad) + col);
#pragma unroll
  for (int pass = 0; pass < Rows / kRowsPerPass; ++pass) {
    const bool inside = r0 + pass * kRowsPerPass < valid;
    copy_16_async(to + static_cast<uint32_t>(pass * kRowsPerPass * (D + Pad) * sizeof(T)),
                  inside ? from + pass * kRowsPerPass * row_stride : src, inside ? 16 : 0);
  }
}

// What the masks add (in base-2 units) to score (b, h, i, j): 0, -inf or the additive value.
__device__ inline float mask_bias(const Params& p, int b, int h, int i, int j) {
  float bias = 0.0f;
  for (int m = 0; m < p.num_masks; ++m) {
    const GpuMask& mk = p.masks[m];
    const long long off = b * mk.strides[0] + h * mk.strides[1] + i * mk.strides[2] + j * mk.strides[3];
    if (mk.kind == 0) {
      // A finite value stays finite when scaled (Hugging Face's finfo.min would overflow to -inf,
      // and a row of it give zeros where PyTorch gives uniform weights), as on the CPU.
      const float value = static_cast<const float*>(mk.data)[off], scaled = value * 1.4426950408889634f;
      bias += isfinite(value) ? fminf(fmaxf(scaled, -FLT_MAX), FLT_MAX) : scaled;
    } else {
      const bool value = static_cast<const uint8_t*>(mk.data)[off] != 0;
      if (value != (mk.kind == 1)) bias = -INFINITY;
    }
  }
  return bias;
}

// The Hopper kernel (flash_forward_sm90.cu): head dim 64 or 128, no masks, compute capability 9.0.
// `bf16` picks bfloat16 over float16.
void launch_forward_sm90(const Params& params, int dim, int batch, bool bf16);

}  // namespace mha::detail::gpu
