// The bfloat16 forward on AMX: Q K^T and P V on the tile unit (bf16 products, fp32 accumulation),
// the online softmax on AVX-512 in fp32. Compiled with -mamx-* (see CMakeLists.txt) and entered
// only when CPUID reports AMX-BF16 and the kernel has the tile permission.
//
// Layout: a task owns 32 queries (two 16-row A tiles); each step takes 32 keys. K and V are
// packed once per (batch, key/value head) into the tile unit's pair-interleaved ("VNNI") B layout:
//   Kp[d/2][key][2]   so that S = Q K^T is A = Q rows, B = Kp           (tiles 16 x 32 bf16)
//   Vp[key/2][d][2]   so that O += P V is A = P rows (bf16), B = Vp
// Tiles: tmm0-3 accumulate 2 x 2 blocks of 16 x 16 fp32, tmm4-5 hold A, tmm6-7 hold B.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "core/dropout.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/simd_avx512.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {

using T = Tiles<simd::Avx512>;
constexpr int kQ = 32;  // queries per task
constexpr int kK = 32;  // keys per step

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

float* aligned_floats(int64_t n) {
  void* p = std::aligned_alloc(64, static_cast<size_t>((n * 4 + 63) / 64 * 64));
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<float*>(p);
}

struct Packed {
  uint16_t* k;  // [B][Hkv][Dk/2][Lk32][2]
  uint16_t* v;  // [B][Hkv][Lk32/2][Dv][2]
  int64_t len;  // Lk rounded up to 32
};

// float32 to bfloat16 bits, rounding to nearest even (local: this file is compiled for AMX, and
// its copy of a shared inline helper must not stand in for the portable one).
uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

uint16_t bits_at(const TensorView& t, int64_t b, int64_t h, int64_t l, int64_t d) {
  return t.data_as<const uint16_t>()[b * t.strides[0] + h * t.strides[1] + l * t.strides[2] + d * t.strides[3]];
}

struct AmxForward {
  const AttentionProblem& p;
  const AmxOutputs& o;
  Packed packed{};

  int64_t kv_index(int64_t b, int64_t hk) const { return b * p.heads_kv + hk; }
  const uint16_t* k_panel(int64_t b, int64_t hk) const { return packed.k + kv_index(b, hk) * p.dim_qk * packed.len; }
  const uint16_t* v_panel(int64_t b, int64_t hk) const { return packed.v + kv_index(b, hk) * packed.len * p.dim_v; }

  // K as pairs of dims (one 32-bit word per key and pair) transposed; V as pairs of keys
  // interleaved per value column. Rows have unit stride (amx_bf16_supports checks it).
  void pack(int threads) {
    const int64_t L = packed.len, dk = p.dim_qk, dv = p.dim_v;
    parallel_for(p.batch * p.heads_kv, threads, [&](int64_t t, int) {
      const int64_t b = t / p.heads_kv, hk = t % p.heads_kv;
      uint32_t* kp = reinterpret_cast<uint32_t*>(packed.k + t * dk * L);
      uint16_t* vp = packed.v + t * L * dv;
      const uint16_t* k0 = p.k.data_as<const uint16_t>() + b * p.k.strides[0] + hk * p.k.strides[1];
      const uint16_t* v0 = p.v.data_as<const uint16_t>() + b * p.v.strides[0] + hk * p.v.strides[1];
      for (int64_t j = 0; j < L; ++j) {
        if (j < p.len_k) {
          const uint16_t* row = k0 + j * p.k.strides[2];
          for (int64_t d2 = 0; d2 < dk / 2; ++d2) {
            uint32_t pair;
            std::memcpy(&pair, row + 2 * d2, 4);
            kp[d2 * L + j] = pair;
          }
        } else {
          for (int64_t d2 = 0; d2 < dk / 2; ++d2) kp[d2 * L + j] = 0;
        }
      }
      for (int64_t j = 0; j < L; j += 2) {
        const uint16_t* r0 = j < p.len_k ? v0 + j * p.v.strides[2] : nullptr;
        const uint16_t* r1 = j + 1 < p.len_k ? v0 + (j + 1) * p.v.strides[2] : nullptr;
        uint16_t* dst = vp + (j / 2) * dv * 2;
        for (int64_t d = 0; d < dv; ++d) {
          dst[2 * d] = r0 ? r0[d] : 0;
          dst[2 * d + 1] = r1 ? r1[d] : 0;
        }
      }
    });
  }

  void task(int64_t b, int64_t h, int64_t i0, uint16_t* q_rows, float* s, uint16_t* p_rows, float* out_acc) const {
    const int64_t dk = p.dim_qk, dv = p.dim_v, L = packed.len;
    const int64_t hk = h / (p.heads_q / p.heads_kv);
    const int64_t rows = std::min<int64_t>(kQ, p.len_q - i0);
    const float qk_scale = static_cast<float>(p.scale) * kLog2e;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t ii = 0; ii < kQ; ++ii)
      for (int64_t d = 0; d < dk; ++d) q_rows[ii * dk + d] = ii < rows ? bits_at(p.q, b, h, i0 + ii, d) : 0;
    std::memset(out_acc, 0, sizeof(float) * kQ * dv);
    alignas(64) float m[kQ], l[kQ];
    int64_t limit[kQ];
    DropoutRowKey keys[kQ];
    for (int64_t ii = 0; ii < kQ; ++ii) {
      m[ii] = neg_inf, l[ii] = 0;
      const int64_t i = i0 + ii;
      limit[ii] = p.causal ? std::clamp<int64_t>(i + p.causal_offset + 1, 0, p.len_k) : p.len_k;
      if (p.dropout_p > 0) keys[ii] = dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
    }
    const int64_t key_end = limit[rows - 1];
    const uint16_t* kp = k_panel(b, hk);
    const uint16_t* vp = v_panel(b, hk);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i threshold = _mm512_set1_epi32(static_cast<int>(dropout_threshold(p.dropout_p)));
    const __m512 keep_scale = _mm512_set1_ps(static_cast<float>(1.0 / (1.0 - p.dropout_p)));

    for (int64_t j0 = 0; j0 < key_end; j0 += kK) {
      // S = Q K^T for 32 queries x 32 keys.
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d0 = 0; d0 < dk; d0 += 32) {
        _tile_loadd(4, q_rows + d0, static_cast<long>(dk * 2));
        _tile_loadd(5, q_rows + 16 * dk + d0, static_cast<long>(dk * 2));
        _tile_loadd(6, kp + ((d0 / 2) * L + j0) * 2, static_cast<long>(L * 4));
        _tile_loadd(7, kp + ((d0 / 2) * L + j0 + 16) * 2, static_cast<long>(L * 4));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, s, kK * 4);
      _tile_stored(1, s + 16, kK * 4);
      _tile_stored(2, s + 16 * kK, kK * 4);
      _tile_stored(3, s + 16 * kK + 16, kK * 4);
      const int64_t nk = std::min<int64_t>(kK, p.len_k - j0);
      // Scores in base 2: the scale is applied here (or before the masks, which add base-2 values).
      float load_scale = qk_scale;
      if (p.num_masks > 0) {
        for (int64_t e = 0; e < kQ * kK; e += 16) _mm512_storeu_ps(s + e, _mm512_mul_ps(_mm512_loadu_ps(s + e), _mm512_set1_ps(qk_scale)));
        for (int t = 0; t < p.num_masks; ++t) T::add_mask(p.masks[t], s, kK, 1, b, h, i0, rows, j0, nk);
        load_scale = 1.0f;
      }
      // Every query of the task sees every key of the block: no causal or length mask to apply.
      const bool clean = j0 + kK <= limit[0];
      alignas(64) float block_max[kQ], m_use[kQ], alpha[kQ], sums[kQ];
      for (int64_t ii = 0; ii < kQ; ++ii) {
        float* row = s + ii * kK;
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(load_scale));
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(row + 16), _mm512_set1_ps(load_scale));
        if (!clean) {
          const __m512i lim = _mm512_set1_epi32(static_cast<int>(limit[ii]));
          const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j0)));
          x0 = _mm512_mask_blend_ps(_mm512_cmp_epi32_mask(j, lim, _MM_CMPINT_LT), _mm512_set1_ps(neg_inf), x0);
          x1 = _mm512_mask_blend_ps(_mm512_cmp_epi32_mask(_mm512_add_epi32(j, _mm512_set1_epi32(16)), lim, _MM_CMPINT_LT),
                                    _mm512_set1_ps(neg_inf), x1);
        }
        _mm512_storeu_ps(row, x0);
        _mm512_storeu_ps(row + 16, x1);
        block_max[ii] = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
      }
      // The statistics of 16 rows at a time: new max, the base to subtract, the rescale factor.
      for (int64_t r = 0; r < kQ; r += 16) {
        const __m512 m_old = _mm512_loadu_ps(m + r);
        const __m512 m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(block_max + r));
        const __m512 base = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(neg_inf), _CMP_EQ_OQ), m_new,
                                                 _mm512_setzero_ps());
        _mm512_storeu_ps(m + r, m_new);
        _mm512_storeu_ps(m_use + r, base);
        _mm512_storeu_ps(alpha + r, simd::Avx512::exp2(_mm512_sub_ps(m_old, base)));
      }
      for (int64_t ii = 0; ii < kQ; ++ii) {
        const float* row = s + ii * kK;
        const __m512 base = _mm512_set1_ps(m_use[ii]);
        __m512 pr[2];
        for (int c = 0; c < 2; ++c) pr[c] = simd::Avx512::exp2(_mm512_sub_ps(_mm512_loadu_ps(row + c * 16), base));
        sums[ii] = _mm512_reduce_add_ps(_mm512_add_ps(pr[0], pr[1]));
        if (p.dropout_p > 0) {
          for (int c = 0; c < 2; ++c) {
            const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j0 + c * 16)));
            const __m512i bits = T::dropout_bits(j, _mm512_set1_epi32(static_cast<int>(keys[ii].lo)),
                                                 _mm512_set1_epi32(static_cast<int>(keys[ii].hi)));
            const __mmask16 keep = _mm512_cmp_epu32_mask(bits, threshold, _MM_CMPINT_NLT);
            pr[c] = _mm512_maskz_mul_ps(keep, pr[c], keep_scale);
          }
        }
        _mm512_storeu_si512(p_rows + ii * kK, (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
        if (alpha[ii] != 1.0f) {
          float* acc = out_acc + ii * dv;
          const __m512 a = _mm512_set1_ps(alpha[ii]);
          for (int64_t d = 0; d < dv; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), a));
        }
      }
      for (int64_t r = 0; r < kQ; r += 16) {
        _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), _mm512_loadu_ps(alpha + r), _mm512_loadu_ps(sums + r)));
      }

      // O += P V, 32 value columns at a time.
      _tile_loadd(4, p_rows, kK * 2);
      _tile_loadd(5, p_rows + 16 * kK, kK * 2);
      for (int64_t d0 = 0; d0 < dv; d0 += 32) {
        _tile_loadd(0, out_acc + d0, static_cast<long>(dv * 4));
        _tile_loadd(1, out_acc + d0 + 16, static_cast<long>(dv * 4));
        _tile_loadd(2, out_acc + 16 * dv + d0, static_cast<long>(dv * 4));
        _tile_loadd(3, out_acc + 16 * dv + d0 + 16, static_cast<long>(dv * 4));
        _tile_loadd(6, vp + ((j0 / 2) * dv + d0) * 2, static_cast<long>(dv * 4));
        _tile_loadd(7, vp + ((j0 / 2) * dv + d0 + 16) * 2, static_cast<long>(dv * 4));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_stored(0, out_acc + d0, static_cast<long>(dv * 4));
        _tile_stored(1, out_acc + d0 + 16, static_cast<long>(dv * 4));
        _tile_stored(2, out_acc + 16 * dv + d0, static_cast<long>(dv * 4));
        _tile_stored(3, out_acc + 16 * dv + d0 + 16, static_cast<long>(dv * 4));
      }
    }
    for (int64_t ii = 0; ii < rows; ++ii) {
      const float inv = l[ii] > 0 ? 1.0f / l[ii] : 0.0f;
      uint16_t* dst = o.out + b * o.out_strides[0] + h * o.out_strides[1] + (i0 + ii) * o.out_strides[2];
      for (int64_t d = 0; d < dv; ++d) dst[d * o.out_strides[3]] = to_bf16_bits(out_acc[ii * dv + d] * inv);
    }
  }

  void run() {
    const int threads = resolve_threads(p.num_threads);
    packed.len = (p.len_k + kK - 1) / kK * kK;
    const int64_t kv = p.batch * p.heads_kv;
    struct Free {
      void* a;
      void* b;
      ~Free() { std::free(a), std::free(b); }
    } free_packed{nullptr, nullptr};
    packed.k = reinterpret_cast<uint16_t*>(aligned_floats((kv * p.dim_qk * packed.len + 1) / 2));
    free_packed.a = packed.k;
    packed.v = reinterpret_cast<uint16_t*>(aligned_floats((kv * packed.len * p.dim_v + 1) / 2));
    free_packed.b = packed.v;
    pack(threads);
    const int64_t q_blocks = (p.len_q + kQ - 1) / kQ;
    parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t t, int) {
      configure_tiles();
      const int64_t qb = q_blocks - 1 - t % q_blocks, bh = t / q_blocks;
      float* scratch = static_cast<float*>(
          thread_scratch(sizeof(float) * static_cast<size_t>(kQ * p.dim_qk / 2 + kQ * kK + kQ * kK / 2 + kQ * p.dim_v + 64)));
      struct Release {
        ~Release() { _tile_release(); }
      } release;
      uint16_t* q_rows = reinterpret_cast<uint16_t*>(scratch);
      float* s = scratch + kQ * p.dim_qk / 2;
      uint16_t* p_rows = reinterpret_cast<uint16_t*>(s + kQ * kK);
      float* out_acc = s + kQ * kK + kQ * kK / 2;
      task(bh / p.heads_q, bh % p.heads_q, qb * kQ, q_rows, s, p_rows, out_acc);
    });
  }
};

}  // namespace

void amx_bf16_forward(const AttentionProblem& p, const AmxOutputs& o) { AmxForward{p, o}.run(); }

}  // namespace mha::detail
