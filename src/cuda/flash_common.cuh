// What the GPU attention kernels share: the problem as the kernels see it (Params), the 16-bit
// element types' packing and mma.sync, and the small PTX helpers (shared addresses, cp.async,
// ex2). Device code only; included by the .cu files of src/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// The Hopper kernel (flash_forward_sm90.cu): head dim 64 or 128, no masks, compute capability 9.0.
// `bf16` picks bfloat16 over float16.
void launch_forward_sm90(const Params& params, int dim, int batch, bool bf16);

}  // namespace mha::detail::gpu
