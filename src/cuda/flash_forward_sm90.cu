// Fused attention forward for Hopper (sm_90a): both products on wgmma, the warpgroup-wide
// asynchronous tensor-core instruction, which on an H100 issues about 1.5x the work per cycle
// that mma.sync can (flash_forward.cu, the kernel for every other case, runs mma.sync).
//
// A block of two warpgroups (256 threads) owns 128 query rows of one (batch, head): each
// warpgroup 64 rows, the M of one m64 product. The block walks the keys in tiles of 128: K and V
// tiles are copied with cp.async into the 128-byte swizzled layout wgmma reads (wgmma.cuh), two
// buffers deep, so the next tile's copy runs under this tile's products. Per tile and
// warpgroup: S = Q K^T (D/16 steps of m64n128k16, both operands from shared memory), the online
// softmax in registers (base 2, as in flash_forward.cu; the accumulator layout is mma.sync's),
// then O += P V with P from registers (the S accumulators packed to 16 bits are the A fragments)
// and V from shared memory, transposed by the instruction. While one warpgroup runs its softmax
// the other's products keep the tensor cores busy (a named barrier staggers the two). Tiles past
// the causal diagonal are skipped; a tile that every row of a warp sees whole runs no
// per-element checks.
//
// Takes head dims 64 and 128 without masks (the common case: causal or not, GQA, Lq != Lk,
// strided views). The entry point (flash_forward.cu) runs it by default at d = 128, where it is
// 1.2-1.5x the mma.sync kernel (H200); at d = 64 the two measured level (the softmax, the same
// work per score at any d, dominates there), and the mma.sync kernel stays the default.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/flash_common.cuh"
#include "cuda/wgmma.cuh"

namespace mha::detail::gpu {
namespace {

constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;

template <int D>
struct HopperTiling {
  static constexpr int kRows = 64 * kWarpgroups;  // query rows per block
  static constexpr int kKeys = 128;               // keys per tile
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kTileBytes = kKeys * D * 2;  // one K or V buffer
  // Q, two K buffers, two V buffers, and room to round the base up to 1024 bytes.
  static constexpr int kSharedBytes = kQBytes + 4 * kTileBytes + 1024;
};

// Starts copying Rows rows of D 16-bit elements from global memory (rows `row_stride` elements
// apart) into the swizzled layout at shared address `tile`; rows at or past `valid` are
// zero-filled. Consecutive threads copy consecutive 16-byte chunks of a row (coalesced reads);
// each pass covers a multiple of 8 rows, so a thread's swizzle is the same in every pass.
template <class T, int D, int Rows>
__device__ __forceinline__ void copy_tile_swizzled(uint32_t tile, const T* src, long long row_stride, int valid) {
  constexpr int kChunks = D / 8, kRowsPerPass = kThreads / kChunks;
  static_assert(Rows % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "whole passes of whole 8-row groups");
  const int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const uint32_t to = tile + c / 8 * (Rows * 128) + r0 * 128 + ((c % 8) ^ (r0 % 8)) * 16;
  const T* from = src + r0 * row_stride + c * 8;
#pragma unroll
  for (int pass = 0; pass < Rows / kRowsPerPass; ++pass) {
    const bool inside = r0 + pass * kRowsPerPass < valid;
    copy_16_async(to + pass * kRowsPerPass * 128, inside ? from + pass * kRowsPerPass * row_stride : src,
                  inside ? 16 : 0);
  }
}

template <class T, int D>
__device__ __forceinline__ void product_pv(float (&o)[D / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (D == 64) {
    wgmma_rs_m64n64k16(o, a, b, T{});
  } else {
    wgmma_rs_m64n128k16(o, a, b, T{});
  }
}

// Named barrier 1 orders the two warpgroups' products within a tile: warpgroup 1 issues its
// Q K^T only after warpgroup 0 has issued its own, so the tensor cores run them one after the
// other rather than interleaved (both would then finish together and both softmaxes leave the
// tensor cores idle), and warpgroup 0's softmax runs under warpgroup 1's Q K^T, warpgroup 1's
// under warpgroup 0's P V: 453 TFLOP/s against 390 without it (H200, d = 128, L = 8192).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif

template <class T, int D>
__global__ void __launch_bounds__(kThreads, 1) flash_forward_sm90_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = HopperTiling<D>;
  constexpr int Br = Tile::kRows, Bc = Tile::kKeys;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t q_tile = (shared_address(smem) + 1023) & ~1023u;
  const uint32_t k_tiles = q_tile + Tile::kQBytes;  // buffer i at + i * kTileBytes
  const uint32_t v_tiles = k_tiles + 2 * Tile::kTileBytes;

  // Causal blocks differ in work: the longest (last query rows) start first.
  const int q_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int b = blockIdx.z, h = blockIdx.y, q0 = q_block * Br;
  const int hk = h / p.group;
  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + hk * p.k_strides[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + hk * p.v_strides[1];
  const long long ks = p.k_strides[2], vs = p.v_strides[2];

  // Causality: keys at or past key_end are invisible to every row of this block.
  int key_end = p.len_k;
  if (p.causal) {
    const long long last = static_cast<long long>(q0) + Br - 1 + p.causal_offset + 1;
    key_end = static_cast<int>(max(0LL, min(static_cast<long long>(p.len_k), last)));
  }
  const int num_tiles = (key_end + Bc - 1) / Bc;

  // This thread's rows are warp_row0 + g and + 8; their running max and sum, and O.
  const int warp_row0 = q0 + wg * 64 + warp * 16;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;

  if (num_tiles > 0) {
    copy_tile_swizzled<T, D, Br>(q_tile, q + q0 * p.q_strides[2], p.q_strides[2], p.len_q - q0);
    copy_tile_swizzled<T, D, Bc>(k_tiles, k, ks, p.len_k);
    copy_tile_swizzled<T, D, Bc>(v_tiles, v, vs, p.len_k);
    commit_copies();
  }

  for (int j = 0; j < num_tiles; ++j) {
    const int k0 = j * Bc, buffer = j & 1;
    if (j + 1 < num_tiles) {  // the next tile's copy runs under this tile's products
      const int k1 = k0 + Bc;
      copy_tile_swizzled<T, D, Bc>(k_tiles + (buffer ^ 1) * Tile::kTileBytes, k + k1 * ks, ks, p.len_k - k1);
      copy_tile_swizzled<T, D, Bc>(v_tiles + (buffer ^ 1) * Tile::kTileBytes, v + k1 * vs, vs, p.len_k - k1);
    }
    commit_copies();  // possibly empty, so that one group always stays pending below
    wait_copies<1>();
    fence_async_shared();  // this thread's copies, now complete, are read next by wgmma
    __syncthreads();
    const uint32_t k_tile = k_tiles + buffer * Tile::kTileBytes, v_tile = v_tiles + buffer * Tile::kTileBytes;

    // S = Q K^T: the warpgroup's 64 rows against the tile's 128 keys, D / 16 steps of k16.
    float s[Bc / 2];
    fence_registers(s);
    if (wg == 1) named_barrier_sync(1, kThreads);  // after warpgroup 0 has issued its Q K^T
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t a = q_tile + kk / 4 * (Br * 128) + wg * 64 * 128 + kk % 4 * 32;
      const uint32_t bk = k_tile + kk / 4 * (Bc * 128) + kk % 4 * 32;
      wgmma_ss_m64n128k16(s, smem_descriptor(a, 16, 1024), smem_descriptor(bk, 16, 1024), kk > 0 ? 1 : 0, T{});
    }
    wgmma_commit();
    if (wg == 0) named_barrier_arrive(1, kThreads);
    wgmma_wait<0>();
    fence_registers(s);

    // Scale to base 2, check bounds and the diagonal where some row of the warp needs it, and
    // fold into the running max and sum. Element 4 n + e is row warp_row0 + g + 8 (e / 2),
    // key k0 + 8 n + 2 t + e % 2.
    const bool whole = k0 + Bc <= p.len_k && (!p.causal || k0 + Bc - 1 <= warp_row0 + p.causal_offset);
    if (whole) {
#pragma unroll
      for (int i = 0; i < Bc / 2; ++i) s[i] *= p.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < Bc / 2; ++i) {
        const int row = warp_row0 + g + i % 4 / 2 * 8, key = k0 + i / 4 * 8 + 2 * t + i % 2;
        const bool visible = key < p.len_k && (!p.causal || key <= row + p.causal_offset);
        s[i] = visible ? s[i] * p.scale_log2 : -INFINITY;
      }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < Bc / 2; ++i) tile_max[i % 4 / 2] = fmaxf(tile_max[i % 4 / 2], s[i]);
    float scale_old[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The 4 threads of a quad hold one row between them.
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing visible yet stays at zero
      scale_old[r] = fast_exp2(row_max[r] - base[r]);
      row_max[r] = new_max;
      row_sum[r] *= scale_old[r];
    }
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= scale_old[i % 4 / 2];
    uint32_t pa[Bc / 16][4];  // P, packed to 16 bits: the A fragments of the k16 steps of P V
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const float lo = fast_exp2(s[8 * kk + 2 * f] - base[f % 2]);
        const float hi = fast_exp2(s[8 * kk + 2 * f + 1] - base[f % 2]);
        row_sum[f % 2] += lo + hi;
        pa[kk][f] = Pack<T>::two(lo, hi);
      }
    }

    // O += P V: Bc / 16 steps of k16; V is MN-major (the head dim runs along its rows).
    fence_registers(o);
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) fence_registers(pa[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      product_pv<T, D>(o, pa[kk], smem_descriptor(v_tile + kk * 16 * 128, Bc * 128, 1024));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o);
    __syncthreads();  // this buffer is refilled by the copy issued next iteration
  }

  // Normalise and store. A row that saw no key has sum 0: its output is zero and its
  // log-sum-exp +inf, as on the CPU.
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = warp_row0 + g + 8 * r;
    if (row >= p.len_q) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* dst = out + static_cast<long long>(row) * p.out_strides[2] + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) = Pack<T>::two(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
    }
    if (p.lse && t == 0) {
      const float lse = sum > 0.0f ? (row_max[r] + log2f(sum)) * 0.6931471805599453f : INFINITY;
      p.lse[(static_cast<long long>(b) * gridDim.y + h) * p.len_q + row] = lse;
    }
  }
#else
  __trap();  // launched only on compute capability 9.0 (flash_forward.cu checks)
#endif
}

template <class T, int D>
void launch(const Params& params, int batch) {
  using Tile = HopperTiling<D>;
  auto kernel = flash_forward_sm90_kernel<T, D>;
  MHA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSharedBytes));
  const dim3 grid((params.len_q + Tile::kRows - 1) / Tile::kRows, params.heads_q, batch);
  kernel<<<grid, kThreads, Tile::kSharedBytes>>>(params);
  MHA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_forward_sm90(const Params& params, int dim, int batch, bool bf16) {
  if (bf16) {
    dim == 64 ? launch<__nv_bfloat16, 64>(params, batch) : launch<__nv_bfloat16, 128>(params, batch);
  } else {
    dim == 64 ? launch<__half, 64>(params, batch) : launch<__half, 128>(params, batch);
  }
}

}  // namespace mha::detail::gpu
