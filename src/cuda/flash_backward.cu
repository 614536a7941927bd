// Fused attention backward on the GPU, flash-attention style, with mma.sync tensor-core
// instructions (m16n8k16, bf16/fp16 in, fp32 accumulate): runs on Ampere (sm_80) and Hopper.
//
// With P = softmax(scale * Q K^T + bias) recomputed from the forward's log-sum-exp, dO the
// output's gradient and delta_i = sum_d dO_id O_id (= sum_j P_ij dP_ij):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale dS K,   dK = scale dS^T Q.
// Three kernels, none with atomics, so the gradients are bit-identical from run to run:
//   1. row_delta: delta per query row (one warp per row);
//   2. key_block: a block owns 64 keys of one (batch, key/value head) and walks every query
//      tile of every query head of its group (GQA sums in registers), forming S^T = K Q^T and
//      dP^T = V dO^T with keys as the rows of the products, so that P^T and dS^T come out of
//      the accumulators as the A fragments of dV += P^T dO and dK += dS^T Q;
//   3. query_block: a block owns 64 query rows of one (batch, head) and walks the key tiles,
//      forming S = Q K^T and dP = dO V^T, then dQ += dS K.
// Kernel 3 recomputes the two products that kernel 2 also forms (7 products where a backward
// with atomic dQ sums has 5): the price of determinism without a float32 dQ buffer.
// Tiles past the causal diagonal are skipped; a tile that every score of a warp sees whole runs
// no per-element checks; masks are staged per tile in shared memory, as in the forward.
// The fragment layouts are in flash_forward.cu; each product below names the ldmatrix form that
// feeds its B operand: "rows" for a tile stored [n][k] (k contiguous, as K in the forward's
// Q K^T), "transposed" for a tile stored [k][n] (as V in the forward's P V).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
constexpr int kPad = 8;     // elements of padding per shared-memory row (ldmatrix rows rotate banks)
constexpr int kKeys = 64;   // keys per key_block block: 16 per warp
constexpr int kRows = 64;   // query rows per query_block block: 16 per warp
constexpr float kLog2e = 1.4426950408889634f;

using gpu::commit_copies;
using gpu::fast_exp2;
using gpu::ldmatrix_x4;
using gpu::ldmatrix_x4_trans;
using gpu::mask_bias;
using gpu::Pack;
using gpu::Params;
using gpu::wait_copies;

struct BackwardParams {
  Params f;  // q, k, v, the saved output as f.out, its log-sum-exp as f.lse, the problem
  const void* grad_out;
  long long grad_out_strides[3];
  void* dq;  // each null when not wanted
  void* dk;
  void* dv;
  long long dq_strides[3], dk_strides[3], dv_strides[3];
  float* delta;  // [B, Hq, Lq]
  float scale;
};

template <class T, int D, int Rows>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* src, long long row_stride, int valid) {
  gpu::copy_tile_async<T, D, Rows, kThreads, kPad>(tile, src, row_stride, valid);
}

// The ldmatrix lane offsets (elements, in tiles of row stride S) of the three operand forms:
// an A fragment (16 rows x 16 k) of a tile stored [m][k]; two B fragments (16 n x 16 k) of a
// tile stored [n][k] ("rows"); two B fragments of a tile stored [k][n] ("transposed").
template <int S> __device__ __forceinline__ int a_lane(int lane) { return (lane % 16) * S + lane / 16 * 8; }
template <int S> __device__ __forceinline__ int rows_lane(int lane) { return (lane / 16 * 8 + lane % 8) * S + lane / 8 % 2 * 8; }
template <int S> __device__ __forceinline__ int trans_lane(int lane) { return (lane / 8 % 2 * 8 + lane % 8) * S + lane / 16 * 8; }

// acc[N/8][4] += A (16 x K, A fragments from a [m][k] tile at `a`) times B^T, B a [n][k] tile.
template <class T, int K, int N, int S>
__device__ __forceinline__ void product_rows(float (&acc)[N / 8][4], const T* a, const T* b, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + a_lane<S>(lane) + kk * 16);
#pragma unroll
    for (int n2 = 0; n2 < N / 16; ++n2) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b + rows_lane<S>(lane) + n2 * 16 * S + kk * 16);
      Pack<T>::mma(acc[2 * n2], af, bf[0], bf[1]);
      Pack<T>::mma(acc[2 * n2 + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[N/8][4] += A B, A (16 x K) in registers as the accumulators of a 16 x K product (their C
// fragments, two 8-column tiles per 16-step, are A fragments once packed to 16 bits), B a
// [k][n] tile of K rows.
template <class T, int K, int N, int S>
__device__ __forceinline__ void product_from_registers(float (&acc)[N / 8][4], const float (&c)[K / 8][4],
                                                       const T* b, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    af[0] = Pack<T>::two(c[2 * kk][0], c[2 * kk][1]);
    af[1] = Pack<T>::two(c[2 * kk][2], c[2 * kk][3]);
    af[2] = Pack<T>::two(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    af[3] = Pack<T>::two(c[2 * kk + 1][2], c[2 * kk + 1][3]);
#pragma unroll
    for (int n2 = 0; n2 < N / 16; ++n2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b + trans_lane<S>(lane) + kk * 16 * S + n2 * 16);
      Pack<T>::mma(acc[2 * n2], af, bf[0], bf[1]);
      Pack<T>::mma(acc[2 * n2 + 1], af, bf[2], bf[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Stores 16 rows of D accumulators (times `factor`) as T: rows row0 + g and row0 + g + 8.
template <class T, int D>
__device__ __forceinline__ void store_rows(const float (&acc)[D / 8][4], T* base, long long row_stride, int row0,
                                           int valid_rows, float factor, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= valid_rows) continue;
    T* dst = base + static_cast<long long>(row) * row_stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) = Pack<T>::two(acc[n][2 * r] * factor, acc[n][2 * r + 1] * factor);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1. delta_i = sum_d dO_id O_id, in float32, one warp per row.

template <class T>
__global__ void __launch_bounds__(kThreads) row_delta_kernel(const BackwardParams p, int dim) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, h = blockIdx.y;
  if (row >= p.f.len_q) return;
  const T* o = static_cast<const T*>(p.f.out) + b * p.f.out_strides[0] + h * p.f.out_strides[1] +
               row * p.f.out_strides[2];
  const T* d_o = static_cast<const T*>(p.grad_out) + b * p.grad_out_strides[0] + h * p.grad_out_strides[1] +
                 row * p.grad_out_strides[2];
  float sum = 0.0f;
  for (int c = 2 * lane; c < dim; c += 64) {
    sum += static_cast<float>(o[c]) * static_cast<float>(d_o[c]) +
           static_cast<float>(o[c + 1]) * static_cast<float>(d_o[c + 1]);
  }
#pragma unroll
  for (int s = 16; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (lane == 0) p.delta[(static_cast<long long>(b) * gridDim.y + h) * p.f.len_q + row] = sum;
}

// ---------------------------------------------------------------------------------------------
// 2. dK and dV for 64 keys, over every query tile of every query head of the group.

template <int D, int Br>
struct KeyTiling {
  static constexpr int kStride = D + kPad;
  // K, V (one tile each), then two buffers each of Q and dO.
  static constexpr int kElements = (2 * kKeys + 4 * Br) * kStride;
  // Then two buffers of the tile's log-sum-exp (base 2) and delta, and with masks the bias,
  // [key][query] with rows padded against bank conflicts.
  static constexpr int kRowFloats = 4 * Br;
  static constexpr int kBiasStride = Br + 4;
  static constexpr int kBiasFloats = kKeys * kBiasStride;
};

// kDK / kDV: which of the two gradients this launch forms (at D = 256 one launch each, so that
// a warp's accumulators fit its registers).
template <class T, int D, int Br, bool kDK, bool kDV>
__global__ void __launch_bounds__(kThreads) key_block_kernel(const BackwardParams p) {
  using Tile = KeyTiling<D, Br>;
  constexpr int S = Tile::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = k_tile + kKeys * S;
  T* q_tiles = v_tile + kKeys * S;
  T* do_tiles = q_tiles + 2 * Br * S;
  float* lse_rows = reinterpret_cast<float*>(do_tiles + 2 * Br * S);  // [2][Br]
  float* delta_rows = lse_rows + 2 * Br;                              // [2][Br]
  float* bias_tile = delta_rows + 2 * Br;                             // only with masks

  const Params& f = p.f;
  const int b = blockIdx.z, hk = blockIdx.y, k0 = blockIdx.x * kKeys;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_key0 = k0 + warp * 16;

  // Query tiles that see a key of this block: causally, rows i with k0 <= i + offset.
  int first_tile = 0;
  const int q_tiles_per_head = (f.len_q + Br - 1) / Br;
  if (f.causal) {
    const long long first_row = max(0LL, static_cast<long long>(k0) - f.causal_offset);
    first_tile = static_cast<int>(min(static_cast<long long>(q_tiles_per_head), first_row / Br));
  }
  const int tiles_per_head = q_tiles_per_head - first_tile;
  const int num_steps = tiles_per_head * f.group;

  const T* k = static_cast<const T*>(f.k) + b * f.k_strides[0] + hk * f.k_strides[1];
  const T* v = static_cast<const T*>(f.v) + b * f.v_strides[0] + hk * f.v_strides[1];
  auto head_of = [&](int step) { return hk * f.group + step / tiles_per_head; };
  auto row_of = [&](int step) { return (first_tile + step % tiles_per_head) * Br; };
  // Starts the copies of step `step`'s Q and dO tiles into `buffer`, and fills its rows'
  // log-sum-exp (base 2; +inf past the end, so that those rows' P is 0) and delta.
  auto load_step = [&](int step, int buffer) {
    const int h = head_of(step), q0 = row_of(step);
    const T* q = static_cast<const T*>(f.q) + b * f.q_strides[0] + h * f.q_strides[1] + q0 * f.q_strides[2];
    const T* d_o = static_cast<const T*>(p.grad_out) + b * p.grad_out_strides[0] + h * p.grad_out_strides[1] +
                   q0 * p.grad_out_strides[2];
    copy_tile_async<T, D, Br>(q_tiles + buffer * Br * S, q, f.q_strides[2], f.len_q - q0);
    copy_tile_async<T, D, Br>(do_tiles + buffer * Br * S, d_o, p.grad_out_strides[2], f.len_q - q0);
    const long long row_base = (static_cast<long long>(b) * f.heads_q + h) * f.len_q + q0;
    for (int i = threadIdx.x; i < Br; i += kThreads) {
      const bool inside = q0 + i < f.len_q;
      lse_rows[buffer * Br + i] = inside ? f.lse[row_base + i] * kLog2e : INFINITY;
      delta_rows[buffer * Br + i] = inside ? p.delta[row_base + i] : 0.0f;
    }
  };

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);

  if (num_steps > 0) {
    copy_tile_async<T, D, kKeys>(k_tile, k + static_cast<long long>(k0) * f.k_strides[2], f.k_strides[2], f.len_k - k0);
    copy_tile_async<T, D, kKeys>(v_tile, v + static_cast<long long>(k0) * f.v_strides[2], f.v_strides[2], f.len_k - k0);
    load_step(0, 0);
    commit_copies();
  }
  const T* k_warp = k_tile + warp * 16 * S;
  const T* v_warp = v_tile + warp * 16 * S;

  for (int step = 0; step < num_steps; ++step) {
    const int buffer = step & 1, h = head_of(step), q0 = row_of(step);
    if (step + 1 < num_steps) load_step(step + 1, buffer ^ 1);  // runs under this step's products
    commit_copies();
    if (f.num_masks > 0) {
      // Consecutive threads read consecutive keys of one query row (coalesced for a [.., Lq, Lk] mask).
      for (int c = threadIdx.x; c < Br * kKeys; c += kThreads) {
        const int i = q0 + c / kKeys, j = k0 + c % kKeys;
        bias_tile[c % kKeys * Tile::kBiasStride + c / kKeys] =
            i < f.len_q && j < f.len_k ? mask_bias(f, b, h, i, j) : 0.0f;
      }
    }
    wait_copies<1>();
    __syncthreads();
    const T* q_tile = q_tiles + buffer * Br * S;
    const T* do_tile = do_tiles + buffer * Br * S;
    const float* lse2 = lse_rows + buffer * Br;
    const float* delta = delta_rows + buffer * Br;

    // S^T = K Q^T: the warp's 16 keys by Br queries (Q "rows").
    float st[Br / 8][4];
    zero(st);
    product_rows<T, D, Br, S>(st, k_warp, q_tile, lane);

    // P^T = 2^(scale_log2 S^T + bias - lse2). Element (n, e): key warp_key0 + g + 8 (e / 2),
    // query q0 + 8 n + 2 t + e % 2. Keys past the end need no check: their rows are not stored.
    const bool whole = f.num_masks == 0 && (!f.causal || warp_key0 + 15 <= q0 + f.causal_offset);
#pragma unroll
    for (int n = 0; n < Br / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = n * 8 + 2 * t + e % 2;
        float x = st[n][e] * f.scale_log2;
        if (!whole) {
          const int key_local = warp * 16 + g + 8 * (e / 2);
          if (f.num_masks > 0) x += bias_tile[key_local * Tile::kBiasStride + qi];
          if (f.causal && k0 + key_local > q0 + qi + f.causal_offset) x = -INFINITY;
        }
        st[n][e] = fast_exp2(x - lse2[qi]);
      }
    }

    if constexpr (kDV) product_from_registers<T, Br, D, S>(dv, st, do_tile, lane);  // dV += P^T dO ("transposed")
    if constexpr (kDK) {
      // dP^T = V dO^T (dO "rows"), then dS^T = P^T (dP^T - delta), and dK += dS^T Q ("transposed").
      float dpt[Br / 8][4];
      zero(dpt);
      product_rows<T, D, Br, S>(dpt, v_warp, do_tile, lane);
#pragma unroll
      for (int n = 0; n < Br / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e] * (dpt[n][e] - delta[n * 8 + 2 * t + e % 2]);
      product_from_registers<T, Br, D, S>(dk, dpt, q_tile, lane);
    }
    __syncthreads();  // this buffer is refilled by the copy issued next step
  }

  // Keys that no query sees (past the causal diagonal, or no query rows) get zeros.
  if constexpr (kDK) {
    if (p.dk) {
      T* out = static_cast<T*>(p.dk) + b * p.dk_strides[0] + hk * p.dk_strides[1];
      store_rows<T, D>(dk, out, p.dk_strides[2], warp_key0, f.len_k, p.scale, g, t);
    }
  }
  if constexpr (kDV) {
    if (p.dv) {
      T* out = static_cast<T*>(p.dv) + b * p.dv_strides[0] + hk * p.dv_strides[1];
      store_rows<T, D>(dv, out, p.dv_strides[2], warp_key0, f.len_k, 1.0f, g, t);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. dQ for 64 query rows, over the key tiles.

template <int D, int Bc>
struct QueryTiling {
  static constexpr int kStride = D + kPad;
  // Q, dO, then two buffers each of K and V.
  static constexpr int kElements = (2 * kRows + 4 * Bc) * kStride;
  static constexpr int kBiasStride = Bc + 4;
  static constexpr int kBiasFloats = kRows * kBiasStride;
};

template <class T, int D, int Bc>
__global__ void __launch_bounds__(kThreads) query_block_kernel(const BackwardParams p) {
  using Tile = QueryTiling<D, Bc>;
  constexpr int S = Tile::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);
  T* do_tile = q_tile + kRows * S;
  T* k_tiles = do_tile + kRows * S;
  T* v_tiles = k_tiles + 2 * Bc * S;
  float* bias_tile = reinterpret_cast<float*>(v_tiles + 2 * Bc * S);  // only with masks

  const Params& f = p.f;
  const int q_block = f.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
  const int b = blockIdx.z, h = blockIdx.y, q0 = q_block * kRows, hk = h / f.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row0 = q0 + warp * 16;
  const T* q = static_cast<const T*>(f.q) + b * f.q_strides[0] + h * f.q_strides[1];
  const T* d_o = static_cast<const T*>(p.grad_out) + b * p.grad_out_strides[0] + h * p.grad_out_strides[1];
  const T* k = static_cast<const T*>(f.k) + b * f.k_strides[0] + hk * f.k_strides[1];
  const T* v = static_cast<const T*>(f.v) + b * f.v_strides[0] + hk * f.v_strides[1];
  const long long ks = f.k_strides[2], vs = f.v_strides[2];

  int key_end = f.len_k;
  if (f.causal) {
    const long long last = static_cast<long long>(q0) + kRows - 1 + f.causal_offset + 1;
    key_end = static_cast<int>(max(0LL, min(static_cast<long long>(f.len_k), last)));
  }
  const int num_tiles = (key_end + Bc - 1) / Bc;

  // This thread's two rows' log-sum-exp (base 2) and delta.
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + g + 8 * r;
    const long long at = (static_cast<long long>(b) * f.heads_q + h) * f.len_q + row;
    lse2[r] = row < f.len_q ? f.lse[at] * kLog2e : INFINITY;
    delta[r] = row < f.len_q ? p.delta[at] : 0.0f;
  }

  float dq[D / 8][4];
  zero(dq);
  if (num_tiles > 0) {
    copy_tile_async<T, D, kRows>(q_tile, q + q0 * f.q_strides[2], f.q_strides[2], f.len_q - q0);
    copy_tile_async<T, D, kRows>(do_tile, d_o + q0 * p.grad_out_strides[2], p.grad_out_strides[2], f.len_q - q0);
    copy_tile_async<T, D, Bc>(k_tiles, k, ks, f.len_k);
    copy_tile_async<T, D, Bc>(v_tiles, v, vs, f.len_k);
    commit_copies();
  }
  const T* q_warp = q_tile + warp * 16 * S;
  const T* do_warp = do_tile + warp * 16 * S;

  for (int j = 0; j < num_tiles; ++j) {
    const int k0 = j * Bc, buffer = j & 1;
    if (j + 1 < num_tiles) {
      const int k1 = k0 + Bc;
      copy_tile_async<T, D, Bc>(k_tiles + (buffer ^ 1) * Bc * S, k + k1 * ks, ks, f.len_k - k1);
      copy_tile_async<T, D, Bc>(v_tiles + (buffer ^ 1) * Bc * S, v + k1 * vs, vs, f.len_k - k1);
    }
    commit_copies();
    if (f.num_masks > 0) {
      for (int c = threadIdx.x; c < kRows * Bc; c += kThreads) {
        const int i = q0 + c / Bc, jj = k0 + c % Bc;
        bias_tile[c / Bc * Tile::kBiasStride + c % Bc] = i < f.len_q && jj < f.len_k ? mask_bias(f, b, h, i, jj) : 0.0f;
      }
    }
    wait_copies<1>();
    __syncthreads();
    const T* k_tile = k_tiles + buffer * Bc * S;
    const T* v_tile = v_tiles + buffer * Bc * S;

    // S = Q K^T (K "rows"), P = 2^(scale_log2 S + bias - lse2). Element (n, e): row
    // warp_row0 + g + 8 (e / 2), key k0 + 8 n + 2 t + e % 2.
    float s[Bc / 8][4];
    zero(s);
    product_rows<T, D, Bc, S>(s, q_warp, k_tile, lane);
    const bool whole = k0 + Bc <= f.len_k && f.num_masks == 0 &&
                       (!f.causal || k0 + Bc - 1 <= warp_row0 + f.causal_offset);
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e] * f.scale_log2;
        if (!whole) {
          const int row_local = warp * 16 + g + 8 * (e / 2), key = k0 + n * 8 + 2 * t + e % 2;
          if (f.num_masks > 0) x += bias_tile[row_local * Tile::kBiasStride + n * 8 + 2 * t + e % 2];
          const bool visible = key < f.len_k && (!f.causal || key <= q0 + row_local + f.causal_offset);
          x = visible ? x : -INFINITY;
        }
        s[n][e] = fast_exp2(x - lse2[e / 2]);
      }
    }

    // dP = dO V^T (V "rows"), dS = P (dP - delta), dQ += dS K (K "transposed").
    float dp[Bc / 8][4];
    zero(dp);
    product_rows<T, D, Bc, S>(dp, do_warp, v_tile, lane);
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta[e / 2]);
    product_from_registers<T, Bc, D, S>(dq, dp, k_tile, lane);
    __syncthreads();
  }

  T* out = static_cast<T*>(p.dq) + b * p.dq_strides[0] + h * p.dq_strides[1];
  store_rows<T, D>(dq, out, p.dq_strides[2], warp_row0, f.len_q, p.scale, g, t);
}

// ---------------------------------------------------------------------------------------------
// Launches.

template <class Kernel>
void launch_kernel(Kernel kernel, dim3 grid, int smem, const BackwardParams& params) {
  MHA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem>>>(params);
  MHA_CUDA_CHECK(cudaGetLastError());
}

template <class T, int D, int Br, bool kDK, bool kDV>
void launch_key_blocks(const BackwardParams& params, int heads_kv, int batch) {
  using Tile = KeyTiling<D, Br>;
  const int smem = Tile::kElements * static_cast<int>(sizeof(T)) +
                   (Tile::kRowFloats + (params.f.num_masks > 0 ? Tile::kBiasFloats : 0)) * 4;
  const dim3 grid((params.f.len_k + kKeys - 1) / kKeys, heads_kv, batch);
  launch_kernel(key_block_kernel<T, D, Br, kDK, kDV>, grid, smem, params);
}

template <class T, int D, int Bc>
void launch_query_blocks(const BackwardParams& params, int batch) {
  using Tile = QueryTiling<D, Bc>;
  const int smem = Tile::kElements * static_cast<int>(sizeof(T)) + (params.f.num_masks > 0 ? Tile::kBiasFloats * 4 : 0);
  const dim3 grid((params.f.len_q + kRows - 1) / kRows, params.f.heads_q, batch);
  launch_kernel(query_block_kernel<T, D, Bc>, grid, smem, params);
}

// d = 64 and 128: both gradients in one launch, on tiles of 32 or 64.
template <class T, int D>
void launch_key_blocks(const BackwardParams& params, bool small_tiles, int heads_kv, int batch) {
  small_tiles ? launch_key_blocks<T, D, 32, true, true>(params, heads_kv, batch)
              : launch_key_blocks<T, D, 64, true, true>(params, heads_kv, batch);
}
template <class T, int D>
void launch_query_blocks(const BackwardParams& params, bool small_tiles, int batch) {
  small_tiles ? launch_query_blocks<T, D, 32>(params, batch) : launch_query_blocks<T, D, 64>(params, batch);
}

// The key blocks walk query tiles of 64 rows at d = 64 and 128 (32 at 256); the query blocks key
// tiles of 64 at d = 64, 32 at 128 and 256. That keeps a warp's accumulators (16 rows of dK and
// dV, or of dQ, plus two tiles of scores) in its registers, and each is the faster of 32 and 64
// as measured on an H200 (docs/CUDA.md): the query blocks at d = 128 run 17% faster on 32-key
// tiles (168 registers at 64), the key blocks 10-14% slower on 32-row tiles. At d = 256 dK and
// dV take a launch each. MHA_CUDA_BACKWARD_TILE=64 or 32 sets both tile sizes at d = 64 and 128
// (to compare).
template <class T>
void launch_for_dim(const BackwardParams& params, int dim, int heads_kv, int batch) {
  const char* env = std::getenv("MHA_CUDA_BACKWARD_TILE");
  const std::string tile = env ? env : "";
  gpu::require(tile.empty() || tile == "64" || tile == "32",
               "MHA_CUDA_BACKWARD_TILE: expected 64 or 32, got '" + tile + "'");
  const bool small_key_tiles = tile.empty() ? dim == 128 : tile == "32";  // the query blocks' key tiles
  const bool small_query_tiles = tile == "32";                             // the key blocks' query tiles
  const bool key_grads = params.dk || params.dv;
  switch (dim) {
    case 64:
      if (key_grads) launch_key_blocks<T, 64>(params, small_query_tiles, heads_kv, batch);
      if (params.dq) launch_query_blocks<T, 64>(params, small_key_tiles, batch);
      break;
    case 128:
      if (key_grads) launch_key_blocks<T, 128>(params, small_query_tiles, heads_kv, batch);
      if (params.dq) launch_query_blocks<T, 128>(params, small_key_tiles, batch);
      break;
    default:
      if (params.dk) launch_key_blocks<T, 256, 32, true, false>(params, heads_kv, batch);
      if (params.dv) launch_key_blocks<T, 256, 32, false, true>(params, heads_kv, batch);
      if (params.dq) launch_query_blocks<T, 256, 32>(params, batch);
      break;
  }
}

}  // namespace

void cuda_attention_backward(const AttentionProblem& p, const CudaBackwardViews& views) {
  gpu::check_supported(p);
  BackwardParams params{};
  params.f = gpu::kernel_params(p);
  params.f.out = const_cast<void*>(views.out4.data);
  params.f.lse = const_cast<float*>(views.lse);
  gpu::copy_strides(views.out4, "saved.output", params.f.out_strides);
  params.grad_out = views.grad_out4.data;
  gpu::copy_strides(views.grad_out4, "grad_output", params.grad_out_strides);
  if (views.dq) {
    params.dq = views.dq->data;
    gpu::copy_strides(*views.dq, "query gradient", params.dq_strides);
  }
  if (views.dk) {
    params.dk = views.dk->data;
    gpu::copy_strides(*views.dk, "key gradient", params.dk_strides);
  }
  if (views.dv) {
    params.dv = views.dv->data;
    gpu::copy_strides(*views.dv, "value gradient", params.dv_strides);
  }
  params.delta = views.delta;
  params.scale = static_cast<float>(p.scale);
  if (p.batch == 0 || p.heads_kv == 0 || (p.len_q == 0 && p.len_k == 0)) return;

  DeviceGuard guard(p.q.device.index);
  const int batch = static_cast<int>(p.batch), heads_kv = static_cast<int>(p.heads_kv);
  const int dim = static_cast<int>(p.dim_qk);
  const bool bf16 = p.q.dtype == DType::bf16;
  if (p.len_q > 0) {
    const dim3 grid((params.f.len_q + kWarps - 1) / kWarps, params.f.heads_q, batch);
    if (bf16) {
      row_delta_kernel<__nv_bfloat16><<<grid, kThreads>>>(params, dim);
    } else {
      row_delta_kernel<__half><<<grid, kThreads>>>(params, dim);
    }
    MHA_CUDA_CHECK(cudaGetLastError());
  }
  // Without rows the key blocks still write zeros, and without keys the query blocks do; an
  // empty side has no blocks.
  if (p.len_q == 0) params.dq = nullptr;
  if (p.len_k == 0) params.dk = params.dv = nullptr;
  if (!params.dq && !params.dk && !params.dv) return;
  if (bf16) {
    launch_for_dim<__nv_bfloat16>(params, dim, heads_kv, batch);
  } else {
    launch_for_dim<__half>(params, dim, heads_kv, batch);
  }
}

}  // namespace mha::detail
