// Fused attention forward on the GPU, flash-attention style, with mma.sync tensor-core
// instructions (m16n8k16, bf16/fp16 in, fp32 accumulate): runs on Ampere (sm_80) and Hopper
// (built for sm_90a as well; the wgmma/TMA kernel for Hopper is a later step).
//
// One block of 4 warps owns 64 query rows of one (batch, head); each warp owns 16 rows. The
// block walks the keys in tiles of Bc: K and V tiles are staged in shared memory, S = Q K^T is
// formed in registers, masked and scaled, folded into the running row max and sum (online
// softmax in base 2), and P V is accumulated into the output registers. The score matrix never
// reaches device memory. Key tiles beyond the causal diagonal are skipped, not masked.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4,
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, column):     b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8..2t+9, n = g)
//   C (16x8, fp32):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// so the C fragments of two adjacent 8-key tiles of S are exactly the A fragment of P for a
// 16-key step of P V: P never leaves registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_attention.hpp"
#include "cuda/cuda_check.hpp"

namespace mha::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = kWarps * 16;
constexpr int kPad = 8;  // elements of padding per shared-memory row: 16 bytes, so rows rotate banks
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
  static __device__ void mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct Pack<__half> {
  static __device__ uint32_t two(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ void mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// Two adjacent 16-bit elements as one 32-bit word (the pair is 4-byte aligned: even column).
template <class T> __device__ uint32_t load_pair(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }
template <class T> __device__ uint32_t load_two(const T* lo, const T* hi) {
  const uint16_t a = *reinterpret_cast<const uint16_t*>(lo), b = *reinterpret_cast<const uint16_t*>(hi);
  return static_cast<uint32_t>(a) | static_cast<uint32_t>(b) << 16;
}

// Copies `rows` rows of D elements (16-byte chunks; rows past `valid` are zero) into shared memory.
template <class T, int D>
__device__ void load_tile(T* tile, const T* src, long long row_stride, int rows, int valid) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < rows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = c % kChunks * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r < valid) value = *reinterpret_cast<const uint4*>(src + r * row_stride + col);
    *reinterpret_cast<uint4*>(tile + r * (D + kPad) + col) = value;
  }
}

// What the masks add (in base-2 units) to score (b, h, i, j): 0, -inf or the additive value.
__device__ float mask_bias(const Params& p, int b, int h, int i, int j) {
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

template <class T, int D, int Bc>
__global__ void __launch_bounds__(kThreads) flash_forward_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);
  T* k_tile = q_tile + kRowsPerBlock * (D + kPad);
  T* v_tile = k_tile + Bc * (D + kPad);

  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kRowsPerBlock;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + hk * p.k_strides[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + hk * p.v_strides[1];

  load_tile<T, D>(q_tile, q + q0 * p.q_strides[2], p.q_strides[2], kRowsPerBlock, min(kRowsPerBlock, p.len_q - q0));

  // This thread's two rows (g and g + 8 of its warp's 16) and their running statistics.
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  // Causality: keys at or past key_end are invisible to every row of this block.
  int key_end = p.len_k;
  if (p.causal) {
    const long long last = static_cast<long long>(q0) + kRowsPerBlock - 1 + p.causal_offset + 1;
    key_end = static_cast<int>(max(0LL, min(static_cast<long long>(p.len_k), last)));
  }

  const T* q_warp = q_tile + warp * 16 * (D + kPad);
  for (int k0 = 0; k0 < key_end; k0 += Bc) {
    __syncthreads();  // the previous tile is no longer read
    const int valid = min(Bc, p.len_k - k0);
    load_tile<T, D>(k_tile, k + k0 * p.k_strides[2], p.k_strides[2], Bc, valid);
    load_tile<T, D>(v_tile, v + k0 * p.v_strides[2], p.v_strides[2], Bc, valid);
    __syncthreads();

    // S = Q K^T for the warp's 16 rows and Bc keys.
    float s[Bc / 8][4];
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      const T* qa = q_warp + g * (D + kPad) + kk * 16 + 2 * t;
      a[0] = load_pair(qa);
      a[1] = load_pair(qa + 8 * (D + kPad));
      a[2] = load_pair(qa + 8);
      a[3] = load_pair(qa + 8 * (D + kPad) + 8);
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) {
        const T* kb = k_tile + (n * 8 + g) * (D + kPad) + kk * 16 + 2 * t;
        const uint32_t bf[2] = {load_pair(kb), load_pair(kb + 8)};
        Pack<T>::mma(s[n], a, bf);
      }
    }

    // Scale to base 2, mask, and fold into the running max and sum.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row[e / 2], j = k0 + n * 8 + 2 * t + e % 2;
        float x = s[n][e] * p.scale_log2;
        const bool visible = j < p.len_k && (!p.causal || j <= i + p.causal_offset);
        if (!visible) {
          x = -INFINITY;
        } else if (p.num_masks > 0 && i < p.len_q) {
          x += mask_bias(p, b, h, i, j);
        }
        s[n][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
    float scale_old[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The 4 threads of a quad hold one row between them.
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing visible yet stays at zero
      scale_old[r] = exp2f(row_max[r] - base[r]);
      row_max[r] = new_max;
      row_sum[r] *= scale_old[r];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= scale_old[0];
      o[n][1] *= scale_old[0];
      o[n][2] *= scale_old[1];
      o[n][3] *= scale_old[1];
    }
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }

    // O += P V, 16 keys at a time; P's A fragments are the C fragments of two 8-key tiles of S.
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      const uint32_t a[4] = {Pack<T>::two(s[2 * kk][0], s[2 * kk][1]), Pack<T>::two(s[2 * kk][2], s[2 * kk][3]),
                             Pack<T>::two(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             Pack<T>::two(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const T* vb = v_tile + (kk * 16 + 2 * t) * (D + kPad) + g;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const T* col = vb + n * 8;
        const uint32_t bf[2] = {load_two(col, col + (D + kPad)), load_two(col + 8 * (D + kPad), col + 9 * (D + kPad))};
        Pack<T>::mma(o[n], a, bf);
      }
    }
  }

  // Normalise and store. A row that saw no key has sum 0: its output is zero and its
  // log-sum-exp +inf, as on the CPU.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= p.len_q) continue;
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    T* dst = out + static_cast<long long>(row[r]) * p.out_strides[2] + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) = Pack<T>::two(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
    if (p.lse && t == 0) {
      const float lse = row_sum[r] > 0.0f ? (row_max[r] + log2f(row_sum[r])) * 0.6931471805599453f : INFINITY;
      p.lse[(static_cast<long long>(b) * gridDim.y + h) * p.len_q + row[r]] = lse;
    }
  }
}

template <class T, int D, int Bc>
void launch(const Params& params, int batch) {
  constexpr int smem = (kRowsPerBlock + 2 * Bc) * (D + kPad) * static_cast<int>(sizeof(T));
  auto kernel = flash_forward_kernel<T, D, Bc>;
  MHA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((params.len_q + kRowsPerBlock - 1) / kRowsPerBlock, params.heads_q, batch);
  kernel<<<grid, kThreads, smem>>>(params);
  MHA_CUDA_CHECK(cudaGetLastError());
}

// Bc: 64 keys per tile up to D = 128; 32 at D = 256 to keep S and O within the register file.
template <class T>
void launch_for_dim(const Params& params, int dim, int batch) {
  switch (dim) {
    case 64: launch<T, 64, 64>(params, batch); break;
    case 128: launch<T, 128, 64>(params, batch); break;
    default: launch<T, 256, 32>(params, batch); break;
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(message);
}

// The view's (b, h, l) strides, after checking that the GPU kernel can address it: unit stride
// along the head dim, 16-byte aligned rows (pointer and strides multiples of 8 elements).
void copy_strides(const TensorView& t, const char* name, long long* strides) {
  require(t.shape[3] <= 1 || t.strides[3] == 1,
          std::string(name) + ": the GPU kernel needs unit stride along the head dimension, got stride " +
              std::to_string(t.strides[3]));
  require(reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
          std::string(name) + ": the GPU kernel needs 16-byte aligned data");
  for (int d = 0; d < 3; ++d) {
    require(t.strides[d] % 8 == 0 || t.shape[d] == 1,
            std::string(name) + ": the GPU kernel needs strides that are multiples of 8 elements, got " +
                std::to_string(t.strides[d]) + " in dimension " + std::to_string(d));
    strides[d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
}

}  // namespace

void cuda_attention_forward(const AttentionProblem& p, const TensorView& out4, float* lse) {
  const DType dt = p.q.dtype;
  require(dt == DType::bf16 || dt == DType::f16,
          "query: the GPU kernel takes bfloat16 or float16, got " + std::string(dtype_name(dt)));
  require(p.dim_qk == p.dim_v, "value: the GPU kernel needs the value head dim equal to the query's (" +
                                   std::to_string(p.dim_qk) + "), got " + std::to_string(p.dim_v));
  require(p.dim_qk == 64 || p.dim_qk == 128 || p.dim_qk == 256,
          "query: the GPU kernel takes head dims 64, 128 or 256, got " + std::to_string(p.dim_qk));
  require(p.dropout_p == 0.0, "dropout_p: dropout is not implemented in the GPU kernel, got " +
                                  std::to_string(p.dropout_p));
  require(p.len_q < (int64_t{1} << 31) && p.len_k < (int64_t{1} << 31) && p.heads_q <= 65535 && p.batch <= 65535,
          "query: the GPU kernel takes sequence lengths below 2^31 and at most 65535 heads and batch entries, got "
          "shape [" + std::to_string(p.batch) + ", " + std::to_string(p.heads_q) + ", " + std::to_string(p.len_q) +
              ", " + std::to_string(p.dim_qk) + "]");
  if (p.batch == 0 || p.heads_q == 0 || p.len_q == 0) return;

  Params params{};
  params.q = p.q.data;
  params.k = p.k.data;
  params.v = p.v.data;
  params.out = out4.data;
  params.lse = lse;
  copy_strides(p.q, "query", params.q_strides);
  copy_strides(p.k, "key", params.k_strides);
  copy_strides(p.v, "value", params.v_strides);
  copy_strides(out4, "out", params.out_strides);
  params.heads_q = static_cast<int>(p.heads_q);
  params.group = static_cast<int>(p.group());
  params.len_q = static_cast<int>(p.len_q);
  params.len_k = static_cast<int>(p.len_k);
  params.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  params.causal = p.causal ? 1 : 0;
  params.causal_offset = p.causal_offset;
  params.num_masks = p.num_masks;
  for (int m = 0; m < p.num_masks; ++m) {
    params.masks[m].data = p.masks[m].data;
    params.masks[m].kind = p.masks[m].kind == MaskKind::additive       ? 0
                           : p.masks[m].kind == MaskKind::keep_if_true ? 1
                                                                        : 2;
    for (int d = 0; d < 4; ++d) params.masks[m].strides[d] = p.masks[m].strides[d];
  }

  DeviceGuard guard(p.q.device.index);
  if (dt == DType::bf16) {
    launch_for_dim<__nv_bfloat16>(params, static_cast<int>(p.dim_qk), static_cast<int>(p.batch));
  } else {
    launch_for_dim<__half>(params, static_cast<int>(p.dim_qk), static_cast<int>(p.batch));
  }
}

}  // namespace mha::detail
