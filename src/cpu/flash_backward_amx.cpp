// The bfloat16 backward on AMX: the five products of the attention backward on the tile unit
// (bf16 operands, fp32 accumulation), the probabilities and dS on AVX-512 in fp32. With
// S = scale Q K^T + mask, P = 2^(log2(e) S - lse2) * p_scale (backward_rows.hpp), the dropout mask
// Z (regenerated from the seed), Pd = P Z / (1 - p) and D = rowsum(dO O):
//   dV = Pd^T dO      dP = (dO V^T) Z / (1 - p)      dS = P (dP - D)      dK = scale dS^T Q      dQ = scale dS K
//
// Everything is computed transposed, keys as rows and queries along the lanes, so that each
// query's lse2, p_scale and D are a vector loaded once per block rather than a broadcast per row:
//   S^T = K Q^T      dP^T = V dO^T      dV += P^T dO      dK += dS^T Q      dQ^T += K^T dS^T
// One task per (batch, key/value head) runs every query head of its group over blocks of 32 keys
// x 32 queries; it owns its dK, dV rows (fp32, the whole key length) and a head's dQ^T (fp32, the
// whole query length), each summed in one fixed order, so the bits do not depend on the thread
// count. With fewer than 8 groups, each group's keys are split into chunks fixed by the shape, a
// task each, whose dQ^T partial sums are added in chunk order afterwards. P and dS are rounded to
// bfloat16 for the tile unit, as FlashAttention rounds them to its inputs' dtype.
//
// Operands, bf16, packed per task (K, V) and per head (Q, dO), zero past the lengths and dims:
//   Kn[key][dk], Vn[key][dv]              natural rows: A of S^T and dP^T
//   Kt[dk][key]                           K transposed: A of dQ^T
//   Qp[dk/2][q][2], dOp[dv/2][q][2]       pairs of dims: B of S^T and dP^T
//   Qv[q/2][dk][2], dOv[q/2][dv][2]       pairs of queries: B of dK and dV
// Tiles: tmm0-3 accumulate 2 x 2 blocks of 16 x 16 fp32, tmm4-5 hold A, tmm6-7 hold B.
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AMX)
#include "cpu/amx_tiles.hpp"
#include "cpu/simd_avx512.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {

using namespace amx;
using T = Tiles<simd::Avx512>;
constexpr int kB = 32;  // keys per block and queries per block

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// A task's buffers, 64-byte aligned, from one block of the host cache.
struct TaskBuffers {
  std::shared_ptr<std::byte> block;
  uint16_t *kn, *kt, *vn, *qp, *qv, *dop, *dov;
  float *dk_acc, *dv_acc, *dqt, *lse2, *p_scale, *delta;
  uint32_t *drop_lo, *drop_hi;  // each query's dropout row key (dropout_row_key)
};

struct AmxBackward {
  const AttentionProblem& p;
  const BackwardInputs& in;
  const BackwardOutputs& out;
  const int64_t dkp = padded(p.dim_qk), dvp = padded(p.dim_v);
  const int64_t lk = round_up(p.len_k, kB), lq = round_up(p.len_q, kB);
  // Where a head's packed queries (Qp, Qv, dOp, dOv) and its dQ^T outgrow half of a 2 MiB L2
  // (1.5 MiB: d=64 L=2048 and up, d=128 L=1024 and up), key blocks come in spans of 256 that meet
  // each query block in turn, so that those stream through the cache once per span rather than
  // once per 32 keys: B=4 H=16 d=128 L=2048 went from 750-770 to 955-970 GFLOP/s, d=64 B=1
  // L=8192 from 725-805 to 1025-1075. Below that, 32 keys a span (each key block meeting every
  // query block in turn) measured 7-8% faster (d=64 L=1024 and 2048). The order in which each
  // gradient element sums its blocks is the same either way (keys ascending for dQ, queries for
  // dK and dV), and so are the bits.
  const bool spans = lq * (2 * dkp + 2 * dvp) * 2 + dkp * lq * 4 > amx_backward_span_bytes().load(std::memory_order_relaxed);
  // Row pitches: of Qp and dOp (words) and dQ^T (floats), qpitch; of Kt (bf16 values), kpitch. With
  // spans, a query block's tiles are read again by the next key block, and rows a multiple of
  // 4 KiB apart would evict each other from L1 (pitch_of): d=128 L=2048 980-1020 to 1090-1120
  // GFLOP/s. Without spans each block reads new rows, and the padding measured 6-12% slower
  // (d=64 L=2048).
  const int64_t qpitch = spans ? pitch_of(lq) : lq, kpitch = spans ? 2 * pitch_of(lk / 2) : lk;
  // Whether scores are scaled before mask terms are added to them (block()).
  const bool prescale = [this] {
    bool additive = false;
    for (int m = 0; m < p.num_masks; ++m) additive |= p.masks[m].kind == MaskKind::additive;
    return p.num_masks > 0 && (additive || !(static_cast<float>(p.scale) * kLog2e > 0));
  }();

  TaskBuffers buffers() const {
    // (bf16 counts first, then fp32 counts; each rounded to 64 bytes)
    const int64_t bf16[] = {lk * dkp, dkp * kpitch, lk * dvp, dkp * qpitch, lq * dkp, dvp * qpitch, lq * dvp};
    const int64_t f32[] = {lk * dkp, lk * dvp, dkp * qpitch, lq, lq, lq, lq, lq};
    int64_t bytes = 0;
    for (int64_t n : bf16) bytes += round_up(n * 2, 64);
    for (int64_t n : f32) bytes += round_up(n * 4, 64);
    TaskBuffers t;
    t.block = host_allocate(static_cast<size_t>(bytes) + 64);
    if (t.block == nullptr) throw std::bad_alloc();
    std::byte* at = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(t.block.get()) + 63) & ~uintptr_t{63});
    uint16_t** halves[] = {&t.kn, &t.kt, &t.vn, &t.qp, &t.qv, &t.dop, &t.dov};
    for (int i = 0; i < 7; ++i) *halves[i] = reinterpret_cast<uint16_t*>(at), at += round_up(bf16[i] * 2, 64);
    float** floats[] = {&t.dk_acc, &t.dv_acc, &t.dqt, &t.lse2, &t.p_scale, &t.delta};
    for (int i = 0; i < 6; ++i) *floats[i] = reinterpret_cast<float*>(at), at += round_up(f32[i] * 4, 64);
    t.drop_lo = reinterpret_cast<uint32_t*>(at), at += round_up(lq * 4, 64);
    t.drop_hi = reinterpret_cast<uint32_t*>(at);
    return t;
  }

  // Rows [0, rows) of `dim` values as rows of dim_padded, zeros past both: dst[len_padded][dim_padded].
  static void copy_rows(const uint16_t* src, int64_t row_stride, int64_t rows, int64_t dim, int64_t len_padded,
                        int64_t dim_padded, uint16_t* dst) {
    for (int64_t r = 0; r < len_padded; ++r) {
      for (int64_t d = 0; d < dim_padded; d += 32) {
        const __m512i x = r < rows ? _mm512_maskz_loadu_epi16(first_lanes(dim - d), src + r * row_stride + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + r * dim_padded + d, x);
      }
    }
  }

  // K transposed, Kt[dim_padded][pitch] (len_padded keys a row), from its pairs of dims (packed
  // into `pairs` first): the even 16-bit lanes of a pair row are one dim's keys, the odd ones the
  // next dim's.
  static void transpose_rows(const uint16_t* src, int64_t row_stride, int64_t rows, int64_t dim, int64_t len_padded,
                             int64_t dim_padded, int64_t pitch, uint16_t* pairs, uint16_t* dst) {
    pack_pairs_of_dims(src, row_stride, rows, dim, len_padded, dim_padded, pairs);
    alignas(64) uint16_t index[32];
    for (int i = 0; i < 32; ++i) index[i] = static_cast<uint16_t>(2 * i);
    const __m512i even = _mm512_load_si512(index), odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int64_t d2 = 0; d2 < dim_padded / 2; ++d2) {
      const uint16_t* row = pairs + d2 * len_padded * 2;
      for (int64_t j = 0; j < len_padded; j += 32) {
        const __m512i a = _mm512_loadu_si512(row + 2 * j), b = _mm512_loadu_si512(row + 2 * j + 32);
        _mm512_storeu_si512(dst + (2 * d2) * pitch + j, _mm512_permutex2var_epi16(a, even, b));
        _mm512_storeu_si512(dst + (2 * d2 + 1) * pitch + j, _mm512_permutex2var_epi16(a, odd, b));
      }
    }
  }

  // Row `n` floats times `scale` to dst (bfloat16 bits or float32, element stride `stride`).
  void store_row(const float* src, int64_t n, float scale, void* base, int64_t offset, int64_t stride) const {
    if (out.grad_dtype == DType::f32) {
      float* dst = static_cast<float*>(base) + offset;
      for (int64_t d = 0; d < n; ++d) dst[d * stride] = src[d] * scale;
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(base) + offset;
    if (stride == 1) {
      for (int64_t d = 0; d < n; d += 16) {
        const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(scale)));
        _mm256_mask_storeu_epi16(dst + d, static_cast<__mmask16>(first_lanes(n - d)), y);
      }
      return;
    }
    for (int64_t d = 0; d < n; ++d) dst[d * stride] = to_bf16_bits(src[d] * scale);
  }

  // One block: keys [j0, j0 + 32) of the task's group, queries [i0, i0 + 32) of head (b, h);
  // `clean` where every query sees every key of the block (the mask terms aside).
  void block(const TaskBuffers& t, float* dqt, int64_t b, int64_t h, int64_t i0, int64_t j0, bool clean) const {
    alignas(64) float st[kB * kB], dpt[kB * kB];
    alignas(64) uint16_t pt[kB * kB], dst[kB * kB], dsv[kB * kB];
    // S^T = K Q^T and dP^T = V dO^T, 32 keys x 32 queries each.
    auto product = [&](const uint16_t* a, int64_t depth, const uint16_t* bp, float* result) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d0 = 0; d0 < depth; d0 += 32) {
        tile_products(a + j0 * depth + d0, a + (j0 + 16) * depth + d0, depth * 2, bp + ((d0 / 2) * qpitch + i0) * 2,
                      bp + ((d0 / 2) * qpitch + i0 + 16) * 2, qpitch * 4);
      }
      store_accumulators(result, kB);
    };
    product(t.kn, dkp, t.qp, st);
    product(t.vn, dvp, t.dop, dpt);

    // Mask terms add base-2 values to the scaled scores (add_mask, on the transposed block: row
    // step 1, column step 32), so the scores are scaled first where one is additive or the scale
    // is not positive; bool terms add 0 or -inf, the same to raw scores, which keeps the rounding
    // of P = 2^(scale log2(e) s - lse2) of a call without masks (a bool band mask and a sliding
    // window give the same bits).
    const float qk = static_cast<float>(p.scale) * kLog2e;
    if (p.num_masks > 0) {
      if (prescale) {
        for (int e = 0; e < kB * kB; e += 16) _mm512_store_ps(st + e, _mm512_mul_ps(_mm512_load_ps(st + e), _mm512_set1_ps(qk)));
      }
      const int64_t rows = std::min<int64_t>(kB, p.len_q - i0), cols = std::min<int64_t>(kB, p.len_k - j0);
      for (int m = 0; m < p.num_masks; ++m) T::add_mask(p.masks[m], st, 1, kB, b, h, i0, rows, j0, cols);
    }
    const __m512 qk_scale = _mm512_set1_ps(prescale ? 1.0f : qk);

    // P^T and dS^T, each key row's 32 queries in two vectors.
    __m512 lse2[2], p_scale[2], delta[2];
    __m512i begin[2], end[2], drop_lo[2], drop_hi[2];
    for (int c = 0; c < 2; ++c) {
      lse2[c] = _mm512_load_ps(t.lse2 + i0 + 16 * c);
      p_scale[c] = _mm512_load_ps(t.p_scale + i0 + 16 * c);
      delta[c] = _mm512_load_ps(t.delta + i0 + 16 * c);
      if (p.dropout_p > 0) {
        drop_lo[c] = _mm512_load_si512(t.drop_lo + i0 + 16 * c);
        drop_hi[c] = _mm512_load_si512(t.drop_hi + i0 + 16 * c);
      }
      if (!clean) {
        alignas(64) int32_t first[16], past[16];
        for (int k = 0; k < 16; ++k) {
          const int64_t i = std::min(i0 + 16 * c + k, p.len_q - 1);  // (rows past Lq have P = 0 anyway)
          first[k] = static_cast<int32_t>(p.window_begin(i)), past[k] = static_cast<int32_t>(p.causal_end(i));
        }
        begin[c] = _mm512_load_si512(first), end[c] = _mm512_load_si512(past);
      }
    }
    const __m512i threshold = _mm512_set1_epi32(static_cast<int32_t>(dropout_threshold(p.dropout_p)));
    const __m512 keep_scale = _mm512_set1_ps(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    for (int r = 0; r < kB; ++r) {
      __m512 pr[2], pd[2], ds[2];
      const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(j0 + r));
      for (int c = 0; c < 2; ++c) {
        const __m512 s = _mm512_load_ps(st + r * kB + 16 * c);
        const __m512 x = prescale ? _mm512_sub_ps(s, lse2[c]) : _mm512_fmsub_ps(s, qk_scale, lse2[c]);
        pr[c] = _mm512_mul_ps(exp2_bf16(x), p_scale[c]);
        if (!clean) {
          const __mmask16 seen = _mm512_cmp_epi32_mask(j, end[c], _MM_CMPINT_LT) & _mm512_cmp_epi32_mask(j, begin[c], _MM_CMPINT_NLT);
          pr[c] = _mm512_maskz_mov_ps(seen, pr[c]);
        }
        __m512 dp = _mm512_load_ps(dpt + r * kB + 16 * c);
        pd[c] = pr[c];
        if (p.dropout_p > 0) {  // Pd = P Z / (1 - p) into dV; dP = (dO V^T) Z / (1 - p)
          const __mmask16 keep = _mm512_cmp_epu32_mask(T::dropout_bits(j, drop_lo[c], drop_hi[c]), threshold, _MM_CMPINT_NLT);
          pd[c] = _mm512_maskz_mul_ps(keep, pr[c], keep_scale);
          dp = _mm512_maskz_mul_ps(keep, dp, keep_scale);
        }
        ds[c] = _mm512_mul_ps(pr[c], _mm512_sub_ps(dp, delta[c]));
      }
      _mm512_store_si512(pt + r * kB, (__m512i)_mm512_cvtne2ps_pbh(pd[1], pd[0]));
      const __m512i ds_row = (__m512i)_mm512_cvtne2ps_pbh(ds[1], ds[0]);
      _mm512_store_si512(dst + r * kB, ds_row);
      if (r % 2 == 1) {  // dS^T as pairs of keys: B of dQ^T
        const __m512i prev = _mm512_load_si512(dst + (r - 1) * kB);
        store_interleaved(prev, ds_row, dsv + (r / 2) * 2 * kB);
      }
    }

    // dV += P^T dO and dK += dS^T Q: 32 keys x 32 columns at a time, depth 32 queries.
    // (The A tiles stay loaded across the column groups.)
    auto accumulate = [&](const uint16_t* a, const uint16_t* bv, int64_t width, float* acc) {
      _tile_loadd(4, a, kB * 2);
      _tile_loadd(5, a + 16 * kB, kB * 2);
      for (int64_t d0 = 0; d0 < width; d0 += 32)
        accumulate_2x2(acc + j0 * width + d0, width, NewOperand::b, bv + ((i0 / 2) * width + d0) * 2,
                       bv + ((i0 / 2) * width + d0 + 16) * 2, width * 4);
    };
    if (out.dv) accumulate(pt, t.dov, dvp, t.dv_acc);
    if (out.dk) accumulate(dst, t.qv, dkp, t.dk_acc);

    // dQ^T += K^T dS^T: 32 dims x 32 queries at a time, depth 32 keys (dS^T's tiles stay loaded).
    if (out.dq) {
      _tile_loadd(6, dsv, 2 * kB * 2);
      _tile_loadd(7, dsv + 32, 2 * kB * 2);
      for (int64_t d0 = 0; d0 < dkp; d0 += 32)
        accumulate_2x2(dqt + d0 * qpitch + i0, qpitch, NewOperand::a, t.kt + d0 * kpitch + j0,
                       t.kt + (d0 + 16) * kpitch + j0, kpitch * 2);
    }
  }

  // Head (b, h): its packed rows, every block it has with the group's keys, and its dQ.
  void head(const TaskBuffers& t, int64_t b, int64_t h, int64_t key_begin, int64_t key_end, float* dqt) const {
    const uint16_t* q = p.q.data_as<const uint16_t>() + b * p.q.strides[0] + h * p.q.strides[1];
    const uint16_t* g = static_cast<const uint16_t*>(in.grad_out) + b * in.grad_out_strides[0] + h * in.grad_out_strides[1];
    pack_pairs_of_dims(q, p.q.strides[2], p.len_q, p.dim_qk, lq, dkp, t.qp, qpitch);
    pack_pairs_of_dims(g, in.grad_out_strides[2], p.len_q, p.dim_v, lq, dvp, t.dop, qpitch);
    if (out.dk) pack_pairs_of_rows(q, p.q.strides[2], p.len_q, p.dim_qk, lq, dkp, t.qv);
    if (out.dv) pack_pairs_of_rows(g, in.grad_out_strides[2], p.len_q, p.dim_v, lq, dvp, t.dov);
    // Past the last query: lse2 = +inf and p_scale = 0, so that P = 0 there.
    const int64_t row0 = (b * p.heads_q + h) * p.len_q;
    std::copy_n(in.lse2 + row0, p.len_q, t.lse2);
    std::copy_n(in.p_scale + row0, p.len_q, t.p_scale);
    std::copy_n(in.delta + row0, p.len_q, t.delta);
    std::fill(t.lse2 + p.len_q, t.lse2 + lq, std::numeric_limits<float>::infinity());
    std::fill(t.p_scale + p.len_q, t.p_scale + lq, 0.0f);
    std::fill(t.delta + p.len_q, t.delta + lq, 0.0f);
    if (out.dq) std::memset(dqt, 0, sizeof(float) * dkp * qpitch);
    if (p.dropout_p > 0) {
      for (int64_t i = 0; i < lq; ++i) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>(row0 + std::min(i, p.len_q - 1)));
        t.drop_lo[i] = key.lo, t.drop_hi[i] = key.hi;
      }
    }

    const int64_t span_keys = spans ? 256 : kB;
    for (int64_t span = key_begin; span < key_end; span += span_keys) {
      for (int64_t i0 = 0; i0 < p.len_q; i0 += kB) {
        const int64_t last = std::min(p.len_q, i0 + kB) - 1;
        for (int64_t j0 = span; j0 < std::min(key_end, span + span_keys); j0 += kB) {
          const int64_t j1 = j0 + kB;
          // Causal and window blocks no query sees are skipped (begin and end grow with the query).
          if (p.causal_end(last) <= j0) break;
          if (p.window_begin(i0) >= j1) continue;
          const bool clean = j1 <= p.len_k && p.causal_end(i0) >= j1 && p.window_begin(last) <= j0 && last == i0 + kB - 1;
          block(t, dqt, b, h, i0, j0, clean);
        }
      }
    }

    if (out.dq && chunks == 1) store_dq(dqt, b, h);
  }

  // dQ of head (b, h) = scale (dQ^T)^T, 16 x 16 floats transposed at a time.
  void store_dq(const float* dqt, int64_t b, int64_t h) const {
    alignas(64) float rows[16 * 16];
    const float scale = static_cast<float>(p.scale);
    for (int64_t i0 = 0; i0 < p.len_q; i0 += 16) {
      for (int64_t d0 = 0; d0 < dkp; d0 += 16) {
        __m512i r[16];
        for (int k = 0; k < 16; ++k) r[k] = _mm512_load_si512(dqt + (d0 + k) * qpitch + i0);
        transpose16x16(r);
        for (int k = 0; k < 16; ++k) _mm512_store_si512(rows + 16 * k, r[k]);
        for (int k = 0; k < 16 && i0 + k < p.len_q; ++k) {
          const int64_t n = std::min<int64_t>(16, p.dim_qk - d0);
          if (n <= 0) break;
          const int64_t at = b * out.dq_strides[0] + h * out.dq_strides[1] + (i0 + k) * out.dq_strides[2] + d0 * out.dq_strides[3];
          store_row(rows + 16 * k, n, scale, out.dq, at, out.dq_strides[3]);
        }
      }
    }
  }

  // Keys [c * chunk_keys, (c + 1) * chunk_keys) of group (b, hk): their dK and dV whole, and
  // each head's dQ^T from them (the whole dQ where there is one chunk).
  void task(int64_t b, int64_t hk, int64_t c, float* partials) const {
    const TaskBuffers t = buffers();
    const uint16_t* k = p.k.data_as<const uint16_t>() + b * p.k.strides[0] + hk * p.k.strides[1];
    const uint16_t* v = p.v.data_as<const uint16_t>() + b * p.v.strides[0] + hk * p.v.strides[1];
    copy_rows(k, p.k.strides[2], p.len_k, p.dim_qk, lk, dkp, t.kn);
    copy_rows(v, p.v.strides[2], p.len_k, p.dim_v, lk, dvp, t.vn);
    // (dk_acc, lk x dkp floats, holds K's pairs of dims on the way)
    if (out.dq) transpose_rows(k, p.k.strides[2], p.len_k, p.dim_qk, lk, dkp, kpitch, reinterpret_cast<uint16_t*>(t.dk_acc), t.kt);
    std::memset(t.dk_acc, 0, sizeof(float) * lk * dkp);
    std::memset(t.dv_acc, 0, sizeof(float) * lk * dvp);
    const int64_t group = p.heads_q / p.heads_kv;
    const int64_t key_begin = c * chunk_keys, key_end = std::min(p.len_k, key_begin + chunk_keys);
    for (int64_t hh = 0; hh < group; ++hh) {
      float* dqt = partials == nullptr ? t.dqt : partials + (((b * p.heads_kv + hk) * group + hh) * chunks + c) * dkp * qpitch;
      head(t, b, hk * group + hh, key_begin, key_end, dqt);
    }
    const float scale = static_cast<float>(p.scale);
    for (int64_t j = key_begin; j < key_end; ++j) {
      if (out.dk) {
        const int64_t at = b * out.dk_strides[0] + hk * out.dk_strides[1] + j * out.dk_strides[2];
        store_row(t.dk_acc + j * dkp, p.dim_qk, scale, out.dk, at, out.dk_strides[3]);
      }
      if (out.dv) {
        const int64_t at = b * out.dv_strides[0] + hk * out.dv_strides[1] + j * out.dv_strides[2];
        store_row(t.dv_acc + j * dvp, p.dim_v, 1.0f, out.dv, at, out.dv_strides[3]);
      }
    }
  }

  void run() const {
    const int threads = resolve_threads(p.num_threads);
    const int64_t tasks = p.batch * p.heads_kv * chunks;
    std::shared_ptr<std::byte> partial_block;
    float* partials = nullptr;
    if (chunks > 1 && out.dq) {
      partial_block = host_allocate(static_cast<size_t>(p.batch * p.heads_q * chunks * dkp * qpitch) * 4 + 64);
      if (partial_block == nullptr) throw std::bad_alloc();
      partials = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(partial_block.get()) + 63) & ~uintptr_t{63});
    }
    parallel_for(tasks, threads, [&](int64_t t, int) {
      configure_tiles();
      struct Release {
        ~Release() { _tile_release(); }
      } release;
      const int64_t c = t % chunks, g = t / chunks;
      task(g / p.heads_kv, g % p.heads_kv, c, partials);
    });
    if (partials == nullptr) return;
    // dQ: each head's chunks summed in order, chunk 0 first.
    parallel_for(p.batch * p.heads_q, threads, [&](int64_t bh, int) {
      float* sum = partials + bh * chunks * dkp * qpitch;  // (chunk 0's slot)
      for (int64_t c = 1; c < chunks; ++c) {
        const float* more = sum + c * dkp * qpitch;
        for (int64_t e = 0; e < dkp * qpitch; e += 16) _mm512_store_ps(sum + e, _mm512_add_ps(_mm512_load_ps(sum + e), _mm512_load_ps(more + e)));
      }
      store_dq(sum, bh / p.heads_q, bh % p.heads_q);
    });
  }

  // Few (batch, key/value head) groups split their keys into chunks, each a task with a dQ of its
  // own summed afterwards, so that at least kTasks tasks share the threads; the count follows the
  // shape alone (and so do the bits), at least 256 keys a chunk, and the partial dQs at most
  // 256 MiB.
  static constexpr int64_t kTasks = 8;
  const int64_t chunks = [this] {
    const int64_t groups = p.batch * p.heads_kv;
    int64_t n = std::min((kTasks + groups - 1) / groups, (p.len_k + 255) / 256);
    const int64_t per_chunk = p.batch * p.heads_q * dkp * qpitch * 4;
    while (n > 1 && n * per_chunk > (int64_t{256} << 20)) --n;
    return std::max<int64_t>(n, 1);
  }();
  const int64_t chunk_keys = round_up((p.len_k + chunks - 1) / chunks, 256);
};

}  // namespace

void amx_bf16_backward(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  AmxBackward{p, in, out}.run();
}

}  // namespace mha::detail
MHA_ISA_END
