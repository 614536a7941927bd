// The bfloat16 forward on AMX: Q K^T and P V on the tile unit (bf16 products, fp32 accumulation),
// the online softmax on AVX-512 in fp32. Compiled for AMX in its region (cpu/isa_region.hpp) and entered
// only when CPUID reports AMX-BF16 and the kernel has the tile permission.
//
// Layout: a task owns 32 queries (two 16-row A tiles); each step takes 64 keys, in tile products
// of 32. Head dims are padded with zeros to a multiple of 32 (the tile's depth). K and V are
// packed once per (batch, key/value head) into the tile unit's pair-interleaved ("VNNI") B layout:
//   Kp[d/2][key][2]   so that S = Q K^T is A = Q rows, B = Kp           (tiles 16 x 32 bf16)
//   Vp[key/2][d][2]   so that O += P V is A = P rows (bf16), B = Vp
// Tiles: tmm0-3 accumulate 2 x 2 blocks of 16 x 16 fp32, tmm4-5 hold A, tmm6-7 hold B.
//
// The tile products take a fraction of the time; the softmax between them, a few vector
// instructions per score, is what costs. So: row maxima of 16 rows at once by a transposing
// reduction (no horizontal reduction per row), row sums kept as 16 lanes until the end, the base
// of each row's exponentials raised only when a block's maximum passes it by 2^8 (most blocks
// rescale nothing), and 2^x by a polynomial sized for bfloat16 probabilities (exp2_bf16).
// (Issuing the next step's tile products before this step's softmax, to overlap the two, measured
// level: the tile unit and the vector units do not work through their queues side by side here.)
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AMX)
#include "cpu/amx_tiles.hpp"
#include "cpu/exp2_polynomial.hpp"
#include "cpu/simd_avx512.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {

using T = Tiles<simd::Avx512>;
using namespace amx;
constexpr int kQ = 32;  // queries per task
constexpr int kK = 64;  // keys per step (two halves of 32, the tiles' width)

struct Packed {
  uint16_t* k;  // [B][Hkv][Dk/2][pitch][2], Lk32 words of each row written
  uint16_t* v;  // [B][Hkv][Lk32/2][Dv][2]
  int64_t len;    // Lk rounded up to 64
  int64_t pitch;  // pitch_of(len)
};

// Terms 2^(s - base) stay below 2^kLazyRescale (256): exact in bfloat16's and float's range.
constexpr float kLazyRescale = 8.0f;

// Lane k of the result: the maximum of v[k]'s 16 lanes. A transposing tree (halves, quarters,
// pairs, lanes of two vectors at a time: 45 shuffles and maxima for 16 rows, against 8 per row
// for one horizontal reduction each), then one permutation back to row order.
inline __m512 max_of_each(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: [v0 lo|v0 hi] -> v0 in blocks 0-1, v1 in 2-3
    a[k] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
  for (int k = 0; k < 4; ++k)  // 128-bit blocks: block j holds row 4k + j
    b[k] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88), _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k)  // pairs of lanes within each block
    c[k] = _mm512_max_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xee));
  // Lane 4j + t now holds row 4t + j.
  const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xdd));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}

// A thread's working rows, each 64-byte aligned (every size is a multiple of 16 floats).
struct Scratch {
  uint16_t* q_rows;  // [kQ][Dk] bfloat16 bits
  float* s;          // [kQ][kK] scores
  uint16_t* p_rows;  // [kQ][kK] bfloat16 bits
  float* out_acc;    // [kQ][Dv]
  float* sums;       // [kQ][16] each row's sum of P, by key modulo 16
  static int64_t floats(const AttentionProblem& p) {
    return kQ * padded(p.dim_qk) / 2 + kQ * kK + kQ * kK / 2 + kQ * padded(p.dim_v) + kQ * 16;
  }
  static Scratch at(float* base, const AttentionProblem& p) {
    float* f = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t{63});
    Scratch w;
    w.q_rows = reinterpret_cast<uint16_t*>(f);
    w.s = f + kQ * padded(p.dim_qk) / 2;
    w.p_rows = reinterpret_cast<uint16_t*>(w.s + kQ * kK);
    w.out_acc = w.s + kQ * kK + kQ * kK / 2;
    w.sums = w.out_acc + kQ * padded(p.dim_v);
    return w;
  }
};

struct AmxForward {
  const AttentionProblem& p;
  const AmxOutputs& o;
  Packed packed{};
  const int64_t dkp = padded(p.dim_qk), dvp = padded(p.dim_v);  // the panels' row widths

  int64_t kv_index(int64_t b, int64_t hk) const { return b * p.heads_kv + hk; }
  const uint16_t* k_panel(int64_t b, int64_t hk) const { return packed.k + kv_index(b, hk) * dkp * packed.pitch; }
  // Up to this many keys, each task packs its own head's panels (run()).
  static constexpr int64_t kOwnPanels = 512;
  const uint16_t* v_panel(int64_t b, int64_t hk) const { return packed.v + kv_index(b, hk) * packed.len * dvp; }

  // K as pairs of dims (one 32-bit word per key and pair) transposed, 16 keys x 16 pairs at a
  // time; V as pairs of keys interleaved per value column, 32 columns at a time. Rows have unit
  // stride (amx_bf16_supports checks it); keys past len_k are zeros.
  void pack_head(int64_t b, int64_t hk, uint16_t* kp, uint16_t* vp) const {
    const uint16_t* k0 = p.k.data_as<const uint16_t>() + b * p.k.strides[0] + hk * p.k.strides[1];
    const uint16_t* v0 = p.v.data_as<const uint16_t>() + b * p.v.strides[0] + hk * p.v.strides[1];
    pack_pairs_of_dims(k0, p.k.strides[2], p.len_k, p.dim_qk, packed.len, dkp, kp, packed.pitch);
    pack_pairs_of_rows(v0, p.v.strides[2], p.len_k, p.dim_v, packed.len, dvp, vp);
  }

  // The base-2 scaled scores of 32 queries x 64 keys (s, row stride kK), with the keys outside each
  // query's [begin, end) set to -inf where the block is not clean.
  void mask_outside(float* s, const int64_t* begin, const int64_t* end, int64_t j0) const {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t ii = 0; ii < kQ; ++ii) {
      const __m512i lo = _mm512_set1_epi32(static_cast<int>(begin[ii])), hi = _mm512_set1_epi32(static_cast<int>(end[ii]));
      for (int c = 0; c < kK; c += 16) {
        const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j0 + c)));
        const __mmask16 seen = _mm512_cmp_epi32_mask(j, hi, _MM_CMPINT_LT) & _mm512_cmp_epi32_mask(j, lo, _MM_CMPINT_NLT);
        float* at = s + ii * kK + c;
        _mm512_storeu_ps(at, _mm512_mask_blend_ps(seen, neg_inf, _mm512_loadu_ps(at)));
      }
    }
  }

  // (w by value: its pointers stay in registers, as no store through them can change them.)
  // Queries [i0, i0 + 32) of head (b, h) against the packed panels kp, vp of its key/value head.
  void task(int64_t b, int64_t h, int64_t i0, const Scratch w, const uint16_t* kp, const uint16_t* vp) const {
    const int64_t dk = dkp, dv = dvp, K = packed.pitch;
    const int64_t rows = std::min<int64_t>(kQ, p.len_q - i0);
    const float qk_scale = static_cast<float>(p.scale) * kLog2e;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const uint16_t* q0 = p.q.data_as<const uint16_t>() + b * p.q.strides[0] + h * p.q.strides[1];
    // The A tiles of Q read the query rows where they lie when all 32 are there and need no
    // padding, whatever their stride (a module's rows, 1.5-2 KiB apart, measured 2-4% faster read
    // in place than copied); otherwise from zero-padded copies. (B=32 H=12 L=128 d=64: 2.36 to 1.95 ms with the first
    // block's accumulators zeroed in their tiles below.)
    const bool q_in_place = rows == kQ && p.dim_qk == dk;
    const uint16_t* qa = q_in_place ? q0 + i0 * p.q.strides[2] : w.q_rows;
    const int64_t q_ld = q_in_place ? p.q.strides[2] : dk;  // bfloat16 values between rows
    if (!q_in_place) {
      for (int64_t ii = 0; ii < kQ; ++ii) {
        uint16_t* dst = w.q_rows + ii * dk;
        const int64_t given = ii < rows ? p.dim_qk : 0;
        if (given > 0) std::memcpy(dst, q0 + (i0 + ii) * p.q.strides[2], static_cast<size_t>(given) * 2);
        std::memset(dst + given, 0, static_cast<size_t>(dk - given) * 2);
      }
    }
    std::memset(w.sums, 0, sizeof(float) * kQ * 16);
    // m: the base each row's scores are taken from (base 2, scaled), raised only when a block's
    // maximum passes it by more than kLazyRescale, so that most blocks rescale nothing; every
    // term 2^(s - m) is then at most 2^kLazyRescale. base: m, or 0 while m is -inf.
    alignas(64) float m[kQ], base[kQ];
    int64_t begin[kQ], end[kQ];
    DropoutRowKey keys[kQ];
    for (int64_t ii = 0; ii < kQ; ++ii) {
      m[ii] = neg_inf, base[ii] = 0;
      const int64_t i = i0 + ii;
      begin[ii] = p.window_begin(i), end[ii] = p.causal_end(i);
      if (p.dropout_p > 0) keys[ii] = dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
    }
    // Causal and window blocks no query of the task sees are skipped, not masked.
    const int64_t key_begin = begin[0] / kK * kK, key_end = end[rows - 1];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i threshold = _mm512_set1_epi32(static_cast<int>(dropout_threshold(p.dropout_p)));
    const __m512 keep_scale = _mm512_set1_ps(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    // Scores are scaled after the maximum is taken (as they enter the exponential) unless an
    // additive mask adds base-2 values to scaled scores, or the scale is not positive (the
    // maximum would not commute). Bool masks add 0 or -inf, the same to raw scores.
    bool additive = false;
    for (int t = 0; t < p.num_masks; ++t) additive |= p.masks[t].kind == MaskKind::additive;
    const bool prescale = additive || !(qk_scale > 0);
    const __m512 load_scale = _mm512_set1_ps(prescale ? 1.0f : qk_scale);
    float* s = w.s;
    if (key_begin >= key_end) std::memset(w.out_acc, 0, sizeof(float) * kQ * dv);  // (no block writes it)

    for (int64_t j0 = key_begin; j0 < key_end; j0 += kK) {
      // S = Q K^T for 32 queries x 64 keys, 32 keys at a time; the second half only where a
      // query sees a key in it (past them mask_outside fills -inf, as the block is not clean).
      const int halves = key_end - j0 > 32 ? 2 : 1;
      for (int half = 0; half < halves; ++half) {
        const int64_t j = j0 + 32 * half;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d0 = 0; d0 < dk; d0 += 32) {
          tile_products(qa + d0, qa + 16 * q_ld + d0, q_ld * 2, kp + ((d0 / 2) * K + j) * 2,
                        kp + ((d0 / 2) * K + j + 16) * 2, K * 4);
        }
        float* at = s + 32 * half;
        store_accumulators(at, kK);
      }
      if (prescale) {
        for (int64_t e = 0; e < kQ * kK; e += 16) _mm512_storeu_ps(s + e, _mm512_mul_ps(_mm512_loadu_ps(s + e), _mm512_set1_ps(qk_scale)));
      }
      if (p.num_masks > 0) {
        const int64_t nk = std::min<int64_t>(kK, p.len_k - j0);
        for (int t = 0; t < p.num_masks; ++t) T::add_mask(p.masks[t], s, kK, 1, b, h, i0, rows, j0, nk);
      }
      // Every query of the task sees every key of the block: nothing to mask.
      const bool clean = j0 + kK <= end[0] && j0 >= begin[rows - 1];
      if (!clean) mask_outside(s, begin, end, j0);

      // The statistics of 16 rows at a time: block maxima, and a new base where one passes the
      // old by more than kLazyRescale (then the row's sum and output so far are rescaled).
      for (int64_t r = 0; r < kQ; r += 16) {
        __m512 row_max[16];
        for (int k = 0; k < 16; ++k) {
          const float* row = s + (r + k) * kK;
          row_max[k] = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16)),
                                     _mm512_max_ps(_mm512_loadu_ps(row + 32), _mm512_loadu_ps(row + 48)));
        }
        const __m512 block_max = _mm512_mul_ps(max_of_each(row_max), load_scale);
        const __m512 m_old = _mm512_load_ps(m + r);
        const __mmask16 raise = _mm512_cmp_ps_mask(block_max, _mm512_add_ps(m_old, _mm512_set1_ps(kLazyRescale)), _CMP_GT_OQ);
        if (raise == 0) continue;
        const __m512 m_new = _mm512_mask_blend_ps(raise, m_old, block_max);
        _mm512_store_ps(m + r, m_new);
        _mm512_store_ps(base + r, _mm512_mask_blend_ps(raise, _mm512_load_ps(base + r), m_new));  // finite where raised
        alignas(64) float alpha[16];
        _mm512_store_ps(alpha, exp2_bf16(_mm512_sub_ps(m_old, m_new)));
        // Rows whose base was -inf have nothing to rescale yet.
        for (uint32_t bits = raise & _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ); bits != 0; bits &= bits - 1) {
          const int k = __builtin_ctz(bits);
          const __m512 a = _mm512_set1_ps(alpha[k]);
          float* acc = w.out_acc + (r + k) * dv;
          for (int64_t d = 0; d < dv; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), a));
          float* sum = w.sums + (r + k) * 16;
          _mm512_store_ps(sum, _mm512_mul_ps(_mm512_load_ps(sum), a));
        }
      }
      // P = 2^(s - base), summed per row (before dropout, which the normaliser does not see) and
      // rounded to bfloat16 for the tile unit.
      for (int64_t ii = 0; ii < kQ; ++ii) {
        const float* row = s + ii * kK;
        const __m512 bb = _mm512_set1_ps(base[ii]);
        __m512 pr[4];
        for (int c = 0; c < 4; ++c) pr[c] = exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + c * 16), load_scale, bb));
        float* sum = w.sums + ii * 16;
        _mm512_store_ps(sum, _mm512_add_ps(_mm512_load_ps(sum), _mm512_add_ps(_mm512_add_ps(pr[0], pr[1]), _mm512_add_ps(pr[2], pr[3]))));
        if (p.dropout_p > 0) {
          for (int c = 0; c < 4; ++c) {
            const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j0 + c * 16)));
            const __m512i bits = T::dropout_bits(j, _mm512_set1_epi32(static_cast<int>(keys[ii].lo)),
                                                 _mm512_set1_epi32(static_cast<int>(keys[ii].hi)));
            const __mmask16 keep = _mm512_cmp_epu32_mask(bits, threshold, _MM_CMPINT_NLT);
            pr[c] = _mm512_maskz_mul_ps(keep, pr[c], keep_scale);
          }
        }
        _mm512_storeu_si512(w.p_rows + ii * kK, (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
        _mm512_storeu_si512(w.p_rows + ii * kK + 32, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
      }

      // O += P V, 32 value columns at a time, the accumulators loaded and stored once per
      // 64 keys (zeroed at the first block: no cleared buffer to read).
      for (int64_t d0 = 0; d0 < dv; d0 += 32) {
        if (j0 == key_begin) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          load_accumulators(w.out_acc + d0, dv);
        }
        for (int half = 0; half < halves; ++half) {
          const int64_t j = j0 + 32 * half;
          tile_products(w.p_rows + 32 * half, w.p_rows + 16 * kK + 32 * half, kK * 2, vp + ((j / 2) * dv + d0) * 2,
                        vp + ((j / 2) * dv + d0 + 16) * 2, dv * 4);
        }
        store_accumulators(w.out_acc + d0, dv);
      }
    }
    float* lse = o.lse ? o.lse + (b * p.heads_q + h) * p.len_q + i0 : nullptr;
    for (int64_t ii = 0; ii < rows; ++ii) {
      const float l = _mm512_reduce_add_ps(_mm512_load_ps(w.sums + ii * 16));
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      if (lse) lse[ii] = l > 0 ? (m[ii] + std::log2(l)) * kLn2 : std::numeric_limits<float>::infinity();
      const int64_t at = b * o.out_strides[0] + h * o.out_strides[1] + (i0 + ii) * o.out_strides[2];
      const float* acc = w.out_acc + ii * dv;
      const __m512 scale = _mm512_set1_ps(inv);
      const int64_t width = p.dim_v;
      if (o.out_f32) {  // rows the caller scales further before it rounds them (attention sinks)
        float* dst = static_cast<float*>(o.out) + at;
        for (int64_t d = 0; d < width; ++d) dst[d * o.out_strides[3]] = acc[d] * inv;
      } else if (o.out_strides[3] == 1) {
        uint16_t* dst = static_cast<uint16_t*>(o.out) + at;
        for (int64_t d = 0; d < width; d += 16) {
          const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), scale));
          _mm256_mask_storeu_epi16(dst + d, static_cast<__mmask16>(first_lanes(width - d)), y);
        }
      } else {
        uint16_t* dst = static_cast<uint16_t*>(o.out) + at;
        for (int64_t d = 0; d < width; ++d) dst[d * o.out_strides[3]] = to_bf16_bits(acc[d] * inv);
      }
    }
  }

  void run() {
    const int threads = resolve_threads(p.num_threads);
    packed.len = (p.len_k + kK - 1) / kK * kK;
    packed.pitch = pitch_of(packed.len);
    const int64_t q_blocks = (p.len_q + kQ - 1) / kQ;
    const int64_t k_panel_size = dkp * packed.pitch, v_panel_size = packed.len * dvp;  // bf16 values
    struct Release {
      ~Release() { _tile_release(); }
    };
    if (packed.len <= kOwnPanels) {
      // Short keys: a task per head packs its own panels into its thread's scratch and runs
      // every query block on them while they are in L1 and L2 (packed for all heads up front,
      // they had left the cache by the time a task read them: at L=128 d=128 a fifth of the call
      // went to the packing).
      const size_t panel_bytes = static_cast<size_t>(k_panel_size + v_panel_size) * 2;
      parallel_for(p.batch * p.heads_q, threads, [&](int64_t bh, int) {
        const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
        std::byte* base = static_cast<std::byte*>(thread_scratch(panel_bytes + sizeof(float) * static_cast<size_t>(Scratch::floats(p) + 16)));
        uint16_t* kp = reinterpret_cast<uint16_t*>(base);
        uint16_t* vp = kp + k_panel_size;
        pack_head(b, hk, kp, vp);
        configure_tiles();
        Release release;
        const Scratch w = Scratch::at(reinterpret_cast<float*>(base + panel_bytes), p);
        for (int64_t qb = q_blocks - 1; qb >= 0; --qb) task(b, h, qb * kQ, w, kp, vp);
      });
      return;
    }
    const int64_t kv = p.batch * p.heads_kv;
    const std::shared_ptr<std::byte> k_storage = bf16_buffer(kv * k_panel_size);
    const std::shared_ptr<std::byte> v_storage = bf16_buffer(kv * v_panel_size);
    packed.k = reinterpret_cast<uint16_t*>(k_storage.get());
    packed.v = reinterpret_cast<uint16_t*>(v_storage.get());
    parallel_for(kv, threads, [&](int64_t t, int) {
      pack_head(t / p.heads_kv, t % p.heads_kv, packed.k + t * k_panel_size, packed.v + t * v_panel_size);
    });
    parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t t, int) {
      configure_tiles();
      const int64_t qb = q_blocks - 1 - t % q_blocks, bh = t / q_blocks;
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
      float* scratch = static_cast<float*>(thread_scratch(sizeof(float) * static_cast<size_t>(Scratch::floats(p) + 16)));
      Release release;
      task(b, h, qb * kQ, Scratch::at(scratch, p), k_panel(b, hk), v_panel(b, hk));
    });
  }
};

}  // namespace

void amx_bf16_forward(const AttentionProblem& p, const AmxOutputs& o) { AmxForward{p, o}.run(); }

}  // namespace mha::detail
MHA_ISA_END
