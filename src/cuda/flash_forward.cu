// Fused attention forward on the GPU, flash-attention style, with mma.sync tensor-core
// instructions (m16n8k16, bf16/fp16 in, fp32 accumulate): runs on Ampere (sm_80) and Hopper
// (built for sm_90a as well). On Hopper, head dim 128 without masks runs the wgmma kernel instead
// (flash_forward_sm90.cu; d = 64 on request); this file also holds the entry point that chooses.
//
// One block of 4 warps owns Br = 64 * MT query rows of one (batch, head); each warp owns 16 * MT
// rows (MT m-tiles share every K and V fragment the warp loads, halving shared-memory traffic
// per FLOP at MT = 2). The block walks the keys in tiles of Bc: K and V tiles are copied to
// shared memory with cp.async, two buffers deep, so the next tile's copy overlaps this tile's
// products. Fragments come out of shared memory through ldmatrix (.trans for V). S = Q K^T is
// formed in registers, masked and scaled, folded into the running row max and sum (online
// softmax in base 2), and P V is accumulated into the output registers. The score matrix never
// reaches device memory. Key tiles beyond the causal diagonal are skipped, not masked, and
// tiles that every row sees whole skip the per-element checks.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4,
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, column):     b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8..2t+9, n = g)
//   C (16x8, fp32):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// so the C fragments of two adjacent 8-key tiles of S are exactly the A fragment of P for a
// 16-key step of P V: P never leaves registers. ldmatrix.x4 hands lane l the fragment pieces
// of four 8x8 matrices whose rows are addressed by lanes 8m..8m+7.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/cuda_attention.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/flash_common.cuh"
#include "cuda/kernel_params.hpp"

namespace mha::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;  // elements of padding per shared-memory row: 16 bytes, so ldmatrix rows rotate banks

using gpu::commit_copies;
using gpu::fast_exp2;
using gpu::ldmatrix_x4;
using gpu::ldmatrix_x4_trans;
using gpu::mask_bias;
using gpu::Pack;
using gpu::Params;
using gpu::require;
using gpu::wait_copies;

template <class T, int D, int Rows>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* src, long long row_stride, int valid) {
  gpu::copy_tile_async<T, D, Rows, kThreads, kPad>(tile, src, row_stride, valid);
}

// Scores to base-2 exponents: scaled and, where kChecked, -inf for keys past the end or the
// causal diagonal, plus the masks' bias (kMasked, staged in shared memory). One straight-line
// version per case: a branch around every element's checks would cost more than the checks.
// Element (m, n, e) of s is row row0 + 16 m + 8 (e / 2), key k0 + 8 n + 2 t + e % 2.
template <bool kChecked, bool kMasked, int MT, int Bc, int kBiasStride>
__device__ __forceinline__ void to_exponents(float (&s)[MT][Bc / 8][4], const Params& p, int k0, int row0, int t,
                                             const float* bias_rows) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[m][n][e] * p.scale_log2;
        if constexpr (kChecked) {
          const int i = row0 + m * 16 + e / 2 * 8, j = k0 + n * 8 + 2 * t + e % 2;
          const bool visible = j < p.len_k && (!p.causal || j <= i + p.causal_offset);
          if constexpr (kMasked) x += bias_rows[(m * 16 + e / 2 * 8) * kBiasStride + n * 8 + e % 2];
          x = visible ? x : -INFINITY;
        }
        s[m][n][e] = x;
      }
    }
  }
}

template <int D, int Bc, int MT>
struct Tiling {
  static constexpr int kRows = kWarps * 16 * MT;  // query rows per block
  static constexpr int kStride = D + kPad;         // elements per shared-memory row
  // Q, then two K buffers, then two V buffers.
  static constexpr int kSharedElements = (kRows + 4 * Bc) * kStride;
  // With masks, the tile's bias (float, in base-2 units) follows; rows padded against bank conflicts.
  static constexpr int kBiasStride = Bc + 4;
  static constexpr int kBiasBytes = kRows * kBiasStride * 4;
};

template <class T, int D, int Bc, int MT>
__global__ void __launch_bounds__(kThreads) flash_forward_kernel(const Params p) {
  using Tile = Tiling<D, Bc, MT>;
  constexpr int Br = Tile::kRows, S = Tile::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);
  T* k_tiles = q_tile + Br * S;
  T* v_tiles = k_tiles + 2 * Bc * S;
  float* bias_tile = reinterpret_cast<float*>(v_tiles + 2 * Bc * S);  // only with masks

  // Causal blocks differ in work: the longest (last query rows) start first.
  const int q_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int b = blockIdx.z, h = blockIdx.y, q0 = q_block * Br;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
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

  // This thread's rows: m-tile m, half r (g or g + 8), and their running statistics.
  const int warp_row0 = q0 + warp * 16 * MT;
  float row_max[MT][2], row_sum[MT][2];
  float o[MT][D / 8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
  }

  if (num_tiles > 0) {
    copy_tile_async<T, D, Br>(q_tile, q + q0 * p.q_strides[2], p.q_strides[2], p.len_q - q0);
    copy_tile_async<T, D, Bc>(k_tiles, k, ks, p.len_k);
    copy_tile_async<T, D, Bc>(v_tiles, v, vs, p.len_k);
    commit_copies();
  }
  // Where this lane's ldmatrix row addresses point inside a tile (see the fragment layouts).
  const T* q_lane = q_tile + (warp * 16 * MT + lane % 16) * S + lane / 16 * 8;
  const int k_lane = (lane / 16 * 8 + lane % 8) * S + lane / 8 % 2 * 8;
  const int v_lane = (lane / 8 % 2 * 8 + lane % 8) * S + lane / 16 * 8;

  for (int j = 0; j < num_tiles; ++j) {
    const int k0 = j * Bc, buffer = j & 1;
    if (j + 1 < num_tiles) {  // the next tile's copy runs under this tile's products
      const int k1 = k0 + Bc;
      copy_tile_async<T, D, Bc>(k_tiles + (buffer ^ 1) * Bc * S, k + k1 * ks, ks, p.len_k - k1);
      copy_tile_async<T, D, Bc>(v_tiles + (buffer ^ 1) * Bc * S, v + k1 * vs, vs, p.len_k - k1);
    }
    commit_copies();  // possibly empty, so that one group always stays pending below
    if (p.num_masks > 0) {
      // The masks' bias for this tile, read once by the whole block (consecutive threads read
      // consecutive keys) while the copies are in flight; the score loop below then reads one
      // shared float per element instead of inlining the mask lookups for every one.
      for (int c = threadIdx.x; c < Br * Bc; c += kThreads) {
        const int i = q0 + c / Bc, j2 = k0 + c % Bc;
        bias_tile[c / Bc * Tile::kBiasStride + c % Bc] = i < p.len_q && j2 < p.len_k ? mask_bias(p, b, h, i, j2) : 0.0f;
      }
    }
    wait_copies<1>();
    __syncthreads();
    const T* k_tile = k_tiles + buffer * Bc * S;
    const T* v_tile = v_tiles + buffer * Bc * S;

    // S = Q K^T for the warp's 16 * MT rows and Bc keys.
    float s[MT][Bc / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) ldmatrix_x4(a[m], q_lane + m * 16 * S + kk * 16);
#pragma unroll
      for (int n2 = 0; n2 < Bc / 16; ++n2) {
        uint32_t bk[4];  // keys n2*16 .. +15: {b0, b1} of the first 8, then of the second 8
        ldmatrix_x4(bk, k_tile + k_lane + n2 * 16 * S + kk * 16);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          Pack<T>::mma(s[m][2 * n2], a[m], bk[0], bk[1]);
          Pack<T>::mma(s[m][2 * n2 + 1], a[m], bk[2], bk[3]);
        }
      }
    }

    // Scale to base 2, mask, and fold into the running max and sum. A tile that every row of
    // the warp sees whole (inside the keys, not cut by the diagonal, no mask) needs no checks.
    const bool whole = k0 + Bc <= p.len_k && p.num_masks == 0 &&
                       (!p.causal || k0 + Bc - 1 <= warp_row0 + p.causal_offset);
    const float* bias_rows = bias_tile + (warp * 16 * MT + g) * Tile::kBiasStride + 2 * t;
    if (whole) {
      to_exponents<false, false, MT, Bc, Tile::kBiasStride>(s, p, k0, warp_row0 + g, t, bias_rows);
    } else if (p.num_masks == 0) {
      to_exponents<true, false, MT, Bc, Tile::kBiasStride>(s, p, k0, warp_row0 + g, t, bias_rows);
    } else {
      to_exponents<true, true, MT, Bc, Tile::kBiasStride>(s, p, k0, warp_row0 + g, t, bias_rows);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s[m][n][0], s[m][n][1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s[m][n][2], s[m][n][3]));
      }
      float scale_old[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The 4 threads of a quad hold one row between them.
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[m][r], tile_max[r]);
        base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing visible yet stays at zero
        scale_old[r] = fast_exp2(row_max[m][r] - base[r]);
        row_max[m][r] = new_max;
        row_sum[m][r] *= scale_old[r];
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[m][n][0] *= scale_old[0];
        o[m][n][1] *= scale_old[0];
        o[m][n][2] *= scale_old[1];
        o[m][n][3] *= scale_old[1];
      }
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[m][n][e] = fast_exp2(s[m][n][e] - base[e / 2]);
          row_sum[m][e / 2] += s[m][n][e];
        }
      }
    }

    // O += P V, 16 keys at a time; P's A fragments are the C fragments of two 8-key tiles of S.
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        a[m][0] = Pack<T>::two(s[m][2 * kk][0], s[m][2 * kk][1]);
        a[m][1] = Pack<T>::two(s[m][2 * kk][2], s[m][2 * kk][3]);
        a[m][2] = Pack<T>::two(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
        a[m][3] = Pack<T>::two(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
      }
#pragma unroll
      for (int n2 = 0; n2 < D / 16; ++n2) {
        uint32_t bv[4];  // head dims n2*16 .. +15: {b0, b1} of the first 8, then of the second 8
        ldmatrix_x4_trans(bv, v_tile + v_lane + kk * 16 * S + n2 * 16);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          Pack<T>::mma(o[m][2 * n2], a[m], bv[0], bv[1]);
          Pack<T>::mma(o[m][2 * n2 + 1], a[m], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // this buffer is refilled by the copy issued next iteration
  }

  // Normalise and store. A row that saw no key has sum 0: its output is zero and its
  // log-sum-exp +inf, as on the CPU.
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[m][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = warp_row0 + m * 16 + g + 8 * r;
      if (row >= p.len_q) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      T* dst = out + static_cast<long long>(row) * p.out_strides[2] + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<uint32_t*>(dst + n * 8) = Pack<T>::two(o[m][n][2 * r] * inv, o[m][n][2 * r + 1] * inv);
      }
      if (p.lse && t == 0) {
        const float lse = sum > 0.0f ? (row_max[m][r] + log2f(sum)) * 0.6931471805599453f : INFINITY;
        p.lse[(static_cast<long long>(b) * gridDim.y + h) * p.len_q + row] = lse;
      }
    }
  }
}

template <class T, int D, int Bc, int MT>
void launch(const Params& params, int batch) {
  using Tile = Tiling<D, Bc, MT>;
  const int smem = Tile::kSharedElements * static_cast<int>(sizeof(T)) + (params.num_masks > 0 ? Tile::kBiasBytes : 0);
  auto kernel = flash_forward_kernel<T, D, Bc, MT>;
  MHA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((params.len_q + Tile::kRows - 1) / Tile::kRows, params.heads_q, batch);
  kernel<<<grid, kThreads, smem>>>(params);
  MHA_CUDA_CHECK(cudaGetLastError());
}

// Keys per tile and m-tiles per warp: the fastest of those measured on an H100 (docs/CUDA.md).
// At D = 64 and 128 each K/V fragment serves two m-tiles (128 query rows per block; ptxas
// spills a few bytes at 255 registers, and the tilings that do not spill measured slower);
// D = 256 runs one m-tile per warp (64 rows) to keep its 256-column O in registers.
template <class T>
void launch_for_dim(const Params& params, int dim, int batch) {
  switch (dim) {
    case 64: launch<T, 64, 128, 2>(params, batch); break;
    case 128: launch<T, 128, 64, 2>(params, batch); break;
    default: launch<T, 256, 32, 1>(params, batch); break;
  }
}

// Which kernel runs a problem: the Hopper one (wgmma) on a device of compute capability 9.0 for
// head dim 128 without masks, the mma.sync one otherwise (at d = 64 both measured level on an
// H200; docs/CUDA.md). MHA_CUDA_KERNEL=mma forces the mma.sync kernel everywhere (to compare);
// =wgmma asks for the Hopper one wherever it can run (d = 64 too), and is an error naming what it
// lacks where it cannot.
bool use_hopper_kernel(const AttentionProblem& p, int device) {
  const char* env = std::getenv("MHA_CUDA_KERNEL");
  const std::string want = env ? env : "";
  require(want.empty() || want == "auto" || want == "mma" || want == "wgmma",
          "MHA_CUDA_KERNEL: expected auto, mma or wgmma, got '" + want + "'");
  if (want == "mma") return false;
  int major = 0, minor = 0;
  MHA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MHA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  std::string lacks;
  if (major != 9 || minor != 0) {
    lacks = "a device of compute capability 9.0, got " + std::to_string(major) + "." + std::to_string(minor);
  } else if (p.dim_qk != 64 && p.dim_qk != 128) {
    lacks = "head dim 64 or 128, got " + std::to_string(p.dim_qk);
  } else if (p.num_masks > 0) {
    lacks = "no attn_mask (masks run on the mma.sync kernel)";
  }
  require(want != "wgmma" || lacks.empty(), "MHA_CUDA_KERNEL=wgmma: the Hopper kernel needs " + lacks);
  return lacks.empty() && (want == "wgmma" || p.dim_qk == 128);
}

}  // namespace

void cuda_attention_forward(const AttentionProblem& p, const TensorView& out4, float* lse) {
  gpu::check_supported(p);
  if (p.batch == 0 || p.heads_q == 0 || p.len_q == 0) return;
  Params params = gpu::kernel_params(p);
  params.out = out4.data;
  params.lse = lse;
  gpu::copy_strides(out4, "out", params.out_strides);

  DeviceGuard guard(p.q.device.index);
  if (use_hopper_kernel(p, p.q.device.index)) {
    gpu::launch_forward_sm90(params, static_cast<int>(p.dim_qk), static_cast<int>(p.batch), p.q.dtype == DType::bf16);
  } else if (p.q.dtype == DType::bf16) {
    launch_for_dim<__nv_bfloat16>(params, static_cast<int>(p.dim_qk), static_cast<int>(p.batch));
  } else {
    launch_for_dim<__half>(params, static_cast<int>(p.dim_qk), static_cast<int>(p.batch));
  }
}

}  // namespace mha::detail
