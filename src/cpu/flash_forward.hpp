// The fused attention forward: tiled, online softmax, never the Lq x Lk matrix (flash-attention
// style). One body, written against a SIMD layer S (simd_avx512.hpp or simd_portable.hpp) and
// compiled once per ISA; every symbol here has internal linkage so ISA copies never mix.
//
// Layout trick: scores are computed transposed, S^T = K Q^T, with the 16 lanes of a vector running
// over *queries*. Then
//   - K and V are read in place (one broadcast per element), never transposed (float32 rows that
//     are not packed are copied packed once per head when enough query tasks share them);
//   - the softmax statistics of 16 queries live in one vector, so row max and row sum are
//     vertical operations, with no horizontal reductions;
//   - the output accumulates transposed too, O^T += V^T P^T, and is transposed once at the end.
// Work is split into tasks of (batch, head, 48 queries), handed out dynamically, or where the
// (batch, key/value head) groups balance over the threads, into whole groups (run_whole_groups).
// bfloat16 / float16 inputs (and float8 keys and values) are widened inside the kernel, exactly: Q
// when it is transposed; K and V one key block at a time into the task's scratch while a head has few query tasks, and for long
// sequences once per head, a chunk of heads at a time, into a buffer the chunk's tasks share. The
// arithmetic is then the float32 kernel's, and so are the bits. (On AVX512-BF16, bfloat16 problems
// take bfloat16 products instead: kPairs below.)
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/dropout.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/excluded_keys.hpp"
#include "cpu/few_queries.hpp"
#include "cpu/row_prefetch.hpp"
#include "cpu/softcap.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {

template <class S>
struct FlashForward {
  using F = typename S::F;
  using U = typename S::U;
  using M = typename S::M;

  using T = Tiles<S>;
  static constexpr int kLanes = S::kLanes;
  static constexpr int kVecs = T::kVecs;
  static constexpr int kBlockQ = T::kWidth;  // queries per task
  static constexpr int kKeysPerTile = T::kRowsPerTile;
  // Keys per softmax step (the S^T tile is kBlockK x 48): 64, rounded up to whole dot_rows calls.
  static constexpr int kBlockK = (64 + kKeysPerTile - 1) / kKeysPerTile * kKeysPerTile;
  // bfloat16 products (S::kBf16Pairs, bfloat16 q, k and v; dispatch.cpp's bf16_pairs_supports):
  // both products over pairs of bfloat16 values, vdpbf16ps, twice the FMA's products per
  // instruction. K is read in place, a pair of dims per 32-bit word; Q^T is copied as pairs of
  // dims per query, unscaled (the scale is applied to the sums); P^T is rounded to bfloat16 as
  // pairs of keys per query, and V copied as pairs of keys per column, a key block at a time.
  // The softmax, its statistics and the output accumulate in float32 as in the float32 kernel.
  static constexpr bool kPairs = requires { S::kBf16Pairs; };
  static_assert(kBlockK % 2 == 0 && kKeysPerTile % 2 == 0);

  const AttentionProblem& p;
  const ForwardOutputs& o;
  // Masks that vary along the queries, copied transposed for this call (transpose_masks): for
  // term t, null (read in place), or [slices][Lq / kBlockQ][Lk][kBlockQ] floats, log2(e) * value.
  struct MaskColumns {
    std::array<const float*, 3> data{};
    // With each copy, per (slice, query block, key block of kBlockK): 1 where the term excludes
    // every (query, key) pair of the block (-inf throughout: a causal or padding mask given as a
    // tensor), which the task then skips as it skips causal blocks.
    std::array<const uint8_t*, 3> excluded{};
    // For a term that does not vary along the queries (a key padding mask, read in place): per
    // (slice, key block), 1 where it excludes every key of the block (excluded_keys.hpp).
    std::array<const uint8_t*, 3> excluded_keys{};
    // A term whose copy fits the cap only a chunk of batch entries at a time (mask_batch_chunk):
    // the slice its copy and map start at, and the buffers each chunk's copy is written into.
    std::array<int64_t, 3> first_slice{};
    std::array<float*, 3> chunk_data{};
    std::array<uint8_t*, 3> chunk_excluded{};
    OrdinaryRows ordinary{};  // the rows for which swamped blocks (kSwamped in a map) are skipped too
    bool done = false;  // transpose_masks has run (it may have copied none)
  };
  MaskColumns mask_columns{};

  // Per-task scratch, O(D) floats (nothing here grows with the sequence length), in the thread's
  // reusable buffer: every field is initialised by the task before it is read.
  struct Scratch {
    float* qt;      // [Dk][kBlockQ]   Q^T of the task, pre-scaled by scale * log2(e)
    float* ot;      // [Dv][kBlockQ]   O^T accumulator
    float* st;      // [kBlockK][kBlockQ] S^T tile, then P^T
    float* m;       // [kBlockQ] running max (base 2)
    float* l;       // [kBlockQ] running sum
    float* alpha;   // [kBlockQ] the key block's rescaling of O^T, 2^(m_old - m_new); then the output rows' factors
    float* zero_row;  // stands in for keys past Lk in a partial tile
    uint32_t* lim;    // [kBlockQ] keys [lo, lim) visible to each query (causality, Lk; a sliding window)
    uint32_t* lo;     // [kBlockQ] (0 without a sliding window)
    uint32_t* key_lo; // [kBlockQ] dropout row keys
    uint32_t* key_hi;
    float* kconv;     // [kBlockK][Dk] the key block widened to float32 (bf16/fp16 inputs only)
    float* vconv;     // [kBlockK][Dv] the value block, likewise
    // Only when weights are wanted (they grow with Lk, as the weights themselves do):
    float* pt;        // [round_up(Lk, kBlockK)][kBlockQ] P^T of every key block, as the pass leaves it
    float* block_m;   // [blocks][kBlockQ] the running max each block's P was taken against
    float* wrow;      // [Lk] one row of weights, for the head average
    const float* kp[kBlockK];
    const float* vp[kBlockK];
    // bfloat16 products (kPairs) only:
    uint32_t* qtw;        // [Dk / 2][kBlockQ] Q^T as pairs of dims (in qt's memory)
    uint32_t* ptw;        // [kBlockK / 2][kBlockQ] P^T as pairs of keys
    uint32_t* vw_rows;    // [kBlockK / 2][round_up(Dv, kLanes)] V as pairs of keys per column
    const uint32_t* kw[kBlockK];      // the key rows as pairs of dims (in place)
    const uint32_t* vw[kBlockK / 2];  // vw_rows' rows
    float qk_scale;       // scale * log2(e), applied to the sums
    void* memory;  // the thread's scratch buffer (core/scratch.hpp)
    RowPrefetch ahead;  // the rows of the thread's likely next task, issued during the key pass
    bool skips_swamped = false;  // every row of the task has an ordinary key (excluded_keys.hpp)
  };

  static int64_t round_up(int64_t x, int64_t m) { return T::round_up(x, m); }

  // Where a task reads the rows of its key/value head: float32 rows (the inputs, or their widened
  // copy in a chunk buffer), or 16- or 8-bit rows (k_low, v_low) to widen a key block at a time.
  struct KeyValueRows {
    const float* k = nullptr;
    const float* v = nullptr;
    const void* k_low = nullptr;
    const void* v_low = nullptr;
    int64_t k_stride = 0, v_stride = 0;  // between rows, in elements
    // bfloat16 products: the head's values already as pairs of keys (value_pairs), or null.
    const uint32_t* v_pairs = nullptr;
    // bfloat16 products over a paged cache (AttentionProblem::key_pages): row j at k_rows[j]
    // (v_rows[j]) elements from the bases above (page_rows). Null: row j at j * stride.
    const int64_t* k_rows = nullptr;
    const int64_t* v_rows = nullptr;
    int64_t k_at(int64_t j) const { return k_rows ? k_rows[j] : j * k_stride; }
    int64_t v_at(int64_t j) const { return v_rows ? v_rows[j] : j * v_stride; }
  };

  // A paged cache's rows (bfloat16 products; reads_pages_in_place): where key (value) j lies
  // from page 0's row 0 of its head, pages[j / page_size] * strides[0] + j % page_size *
  // strides[2], tabled once per call rather than divided out per key by every query task.
  struct PageRows {
    const int64_t* k = nullptr;
    const int64_t* v = nullptr;
  };
  PageRows page_rows{};

  // The inputs' own rows of key/value head hk of batch b. Offsets are in elements: each base is
  // formed only in its own element type.
  KeyValueRows input_rows(int64_t b, int64_t hk) const {
    KeyValueRows kv;
    const int64_t k_offset = b * p.k.strides[0] + hk * p.k.strides[1], v_offset = b * p.v.strides[0] + hk * p.v.strides[1];
    if (widens()) {
      kv.k_low = element_address(p.k.data, p.k.dtype, k_offset);
      kv.v_low = element_address(p.v.data, p.v.dtype, v_offset);
    } else {
      kv.k = p.k.data_as<float>() + k_offset;
      kv.v = p.v.data_as<float>() + v_offset;
    }
    kv.k_stride = p.k.strides[2];
    kv.v_stride = p.v.strides[2];
    if (p.key_pages) {  // (one batch entry: strides[0] steps from page to page)
      if (!kPairs || page_rows.k == nullptr)
        throw Error("internal error: a paged cache reaches the tile kernel untabled or without bfloat16 products");
      kv.k_rows = page_rows.k, kv.v_rows = page_rows.v;
    }
    return kv;
  }

  // Row j of the low-precision keys (values) at kv to float32 (unit stride, as run_attention
  // guarantees).
  void widen_key(const KeyValueRows& kv, int64_t j, float* dst) const {
    T::widen(p.k.dtype, element_address(kv.k_low, p.k.dtype, j * kv.k_stride), dst, p.dim_qk);
  }
  void widen_value(const KeyValueRows& kv, int64_t j, float* dst) const {
    T::widen(p.v.dtype, element_address(kv.v_low, p.v.dtype, j * kv.v_stride), dst, p.dim_v);
  }

  // Keys and values are widened: bfloat16 / float16 calls (q too, then), and float8 keys and values
  // under any query dtype. A 16-bit query is widened whenever its keys are (they are its dtype or
  // float8), so the buffers the keys' widening allocates hold it too.
  bool widens() const { return p.k.dtype != DType::f32; }

  bool wants_weights() const { return o.weights != nullptr || o.average_weights != nullptr; }

  Scratch allocate() const {
    const int64_t conv = kPairs ? kBlockK / 2 * (kBlockQ + round_up(p.dim_v, kLanes)) : widens() ? kBlockK * (p.dim_qk + p.dim_v) : 0;
    const int64_t keys = round_up(p.len_k, kBlockK);
    const int64_t kept = wants_weights() ? (keys + keys / kBlockK) * kBlockQ + round_up(p.len_k, kLanes) : 0;
    const int64_t floats =
        (p.dim_qk + p.dim_v + kBlockK + 3) * kBlockQ + std::max(p.dim_qk, p.dim_v) + kLanes + conv + kept;
    const int64_t words = 4 * kBlockQ;
    void* mem = thread_scratch(static_cast<size_t>(round_up((floats + words) * 4, 64)));
    Scratch s;
    s.memory = mem;
    float* f = static_cast<float*>(mem);
    s.qt = f, f += p.dim_qk * kBlockQ;
    s.ot = f, f += p.dim_v * kBlockQ;
    s.st = f, f += kBlockK * kBlockQ;
    s.m = f, f += kBlockQ;
    s.l = f, f += kBlockQ;
    s.alpha = f, f += kBlockQ;
    s.zero_row = f, f += std::max(p.dim_qk, p.dim_v) + kLanes;
    if constexpr (kPairs) {
      s.kconv = s.vconv = nullptr;
      s.qtw = reinterpret_cast<uint32_t*>(s.qt);
      s.ptw = reinterpret_cast<uint32_t*>(f), f += kBlockK / 2 * kBlockQ;
      s.vw_rows = reinterpret_cast<uint32_t*>(f), f += kBlockK / 2 * round_up(p.dim_v, kLanes);
    } else {
      s.kconv = f, f += widens() ? kBlockK * p.dim_qk : 0;
      s.vconv = f, f += widens() ? kBlockK * p.dim_v : 0;
    }
    s.pt = s.block_m = s.wrow = nullptr;
    if (wants_weights()) {
      s.pt = f, f += keys * kBlockQ;
      s.block_m = f, f += keys / kBlockK * kBlockQ;
      s.wrow = f, f += round_up(p.len_k, kLanes);
    }
    std::memset(s.zero_row, 0, sizeof(float) * (std::max(p.dim_qk, p.dim_v) + kLanes));
    uint32_t* u = reinterpret_cast<uint32_t*>(f);
    s.lim = u, u += kBlockQ;
    s.lo = u, u += kBlockQ;
    s.key_lo = u, u += kBlockQ;
    s.key_hi = u;
    return s;
  }

  // The pass over the visible key blocks of a task: the online softmax, O rescaled as the max
  // grows. When weights are wanted, each block's P stays in s.pt with the max it was taken
  // against, for finish_weights to bring to the final max once the pass is over.
  void key_pass(Scratch& s, const KeyValueRows& kv, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t key_begin,
                int64_t key_end, int64_t clean_begin, int64_t clean_end) const {
    // Vectors of the panel that hold a query: the last task of a short sequence (L=128 is 2 2/3
    // panels) skips the empty ones where the register block is one vector wide.
    const int vecs = T::vecs_for(rows);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const bool widen = kv.k_low != nullptr;
    const bool dropout = p.dropout_p > 0;
    const U threshold = S::set1_u(dropout_threshold(p.dropout_p));
    const F keep_scale = S::set1(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    const Softcap<S> cap(p);
    bool fresh = true;  // O^T holds nothing yet (it is not zeroed before the pass)

    for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockK) {
      // A block a mask excludes entirely is skipped (its weights, when kept, need its P: zeros).
      if (!s.pt && block_excluded(b, h, i0, j0, s.skips_swamped)) continue;
      const int64_t nb = std::min<int64_t>(kBlockK, key_end - j0);
      const int64_t nbp = round_up(nb, kKeysPerTile);
      // This block's share of the next task's prefetches, spread over its tiles.
      const int64_t tiles = nbp / kKeysPerTile;
      const int64_t ahead_lines = (s.ahead.share((key_end - j0 + kBlockK - 1) / kBlockK) + tiles - 1) / tiles;
      if constexpr (kPairs) {
        pair_rows(s, kv, j0, nbp);
        for (int64_t jj = 0; jj < nbp; jj += kKeysPerTile) {
          T::dot_pairs(s.st + jj * kBlockQ, s.kw + jj, s.qtw, p.dim_qk / 2, vecs, S::set1(s.qk_scale));
          s.ahead.issue(ahead_lines);
        }
      } else {
        for (int64_t jj = 0; jj < nbp; ++jj) {
          const int64_t j = j0 + jj;
          if (j >= p.len_k) {
            s.kp[jj] = s.vp[jj] = s.zero_row;
          } else if (widen) {
            float* kc = s.kconv + jj * p.dim_qk;
            float* vc = s.vconv + jj * p.dim_v;
            widen_key(kv, j, kc);
            widen_value(kv, j, vc);
            s.kp[jj] = kc, s.vp[jj] = vc;
          } else {
            s.kp[jj] = kv.k + j * kv.k_stride;
            s.vp[jj] = kv.v + j * kv.v_stride;
          }
        }
        for (int64_t jj = 0; jj < nbp; jj += kKeysPerTile) {
          T::dot_rows_call(s.st + jj * kBlockQ, s.kp + jj, s.qt, p.dim_qk, vecs);
          s.ahead.issue(ahead_lines);
        }
      }
      if (cap.on) cap.rows(s.st, nbp, kBlockQ, vecs);  // before the masks, as they add to the capped score

      for (int t = 0; t < p.num_masks; ++t) {
        if (const float* cols = mask_columns.data[t]) {  // the transposed copy: a vector of queries per key
          const int64_t slice = mask_slice(p.masks[t], p.heads_q, b, h) - mask_columns.first_slice[t];
          cols += slice * mask_slice_floats() + (i0 / kBlockQ * p.len_k + j0) * kBlockQ;
          for (int64_t jj = 0; jj < nb; ++jj)
            for (int c = 0; c < vecs; ++c) {
              float* row = s.st + jj * kBlockQ + c * kLanes;
              S::store(row, S::add(S::load(row), S::load(cols + jj * kBlockQ + c * kLanes)));
            }
        } else {
          T::add_mask(p.masks[t], s.st, 1, kBlockQ, b, h, i0, rows, j0, nb);
        }
      }
      // Some (query, key) pairs are past causality or Lk, or before a sliding window's first key.
      const bool before = j0 < clean_begin;
      if (j0 + nbp > clean_end || before) {
        const F minus_inf = S::set1(neg_inf);
        for (int64_t jj = 0; jj < nbp; ++jj) {
          const U jv = S::set1_u(static_cast<uint32_t>(j0 + jj));
          for (int c = 0; c < vecs; ++c) {
            float* row = s.st + jj * kBlockQ + c * kLanes;
            F x = S::select(S::lt_i(jv, S::load_u(s.lim + c * kLanes)), S::load(row), minus_inf);
            if (before) x = S::select(S::lt_i(jv, S::load_u(s.lo + c * kLanes)), minus_inf, x);
            S::store(row, x);
          }
        }
      }

      float* const tile = s.pt ? s.pt + j0 * kBlockQ : s.st;  // where P goes: kept, or in place
      bool rescale = false;  // some query's max grew: O^T is scaled by alpha = 2^(m_old - m_new)
      for (int c = 0; c < vecs; ++c) {
        const F m_old = S::load(s.m + c * kLanes);
        // Four chains of maxima, not one: a chain of 64 waits on the maximum's latency at every
        // step (4 cycles), 4% of the L=2048 forward. (The maximum is exact in any order.)
        F m_part[4] = {m_old, m_old, m_old, m_old};
        int64_t jj = 0;
        for (; jj + 4 <= nbp; jj += 4)
          for (int q = 0; q < 4; ++q) m_part[q] = S::max(m_part[q], S::load(s.st + (jj + q) * kBlockQ + c * kLanes));
        for (; jj < nbp; ++jj) m_part[0] = S::max(m_part[0], S::load(s.st + jj * kBlockQ + c * kLanes));
        const F m_new = S::max(S::max(m_part[0], m_part[1]), S::max(m_part[2], m_part[3]));
        // A query that has seen only -inf keeps m = -inf; subtracting 0 instead makes its p 0, not NaN.
        const F m_use = S::select(S::eq(m_new, S::set1(neg_inf)), S::zero(), m_new);
        U key_lo = S::set1_u(0), key_hi = S::set1_u(0);
        if (dropout) {
          key_lo = S::load_u(s.key_lo + c * kLanes);
          key_hi = S::load_u(s.key_hi + c * kLanes);
        }
        // The loop below in one copy per (weights kept, dropout), its pointers in locals: with
        // both tested per key and the scratch's pointers reloaded after every store (which may
        // alias them), the bf16 pass spent a fifth of its time on them.
        const float* const scores = s.st + c * kLanes;  // rows kBlockQ apart
        float* const p_out = tile + c * kLanes;
        uint32_t* const p_pairs = kPairs ? s.ptw + c * kLanes : nullptr;  // (ptw is set only with pair products)
        auto probabilities = [&](auto keep, auto drop) {
          constexpr bool kKeep = decltype(keep)::value, kDrop = decltype(drop)::value;
          auto probability = [&](int64_t jj, F& total) {
            // (With bfloat16 products, P is rounded to bfloat16: 2^x sized for it, exp2_bf16, unless
            // the weights are wanted, which are float32 values.)
            const F x = S::sub(S::load(scores + jj * kBlockQ), m_use);
            F pr;
            if constexpr (kPairs) {  // (nested: S has exp2_for_bf16 only where kPairs, and kKeep is the lambda's)
              if constexpr (!kKeep) pr = S::exp2_for_bf16(x);
              else pr = S::exp2(x);
            } else {
              pr = S::exp2(x);
            }
            total = S::add(total, pr);
            if constexpr (kDrop) {
              const U jv = S::set1_u(static_cast<uint32_t>(j0 + jj));
              const U bits = T::dropout_bits(jv, key_lo, key_hi);
              pr = S::select(S::ge_u(bits, threshold), S::mul(pr, keep_scale), S::zero());
            }
            return pr;
          };
          F sum = S::zero();
          if constexpr (kPairs) {
            // Two keys at a time, rounded straight into P^T's pairs (float32 P kept only for the
            // weights); two sums, so that no add waits on the one before.
            F other = S::zero();
            for (int64_t jj = 0; jj < nbp; jj += 2) {
              const F p0 = probability(jj, sum), p1 = probability(jj + 1, other);
              if constexpr (kKeep) S::store(p_out + jj * kBlockQ, p0), S::store(p_out + (jj + 1) * kBlockQ, p1);
              S::store_w(p_pairs + jj / 2 * kBlockQ, S::pairs_of(p0, p1));
            }
            sum = S::add(sum, other);
          } else {
            for (int64_t jj = 0; jj < nbp; ++jj) S::store(p_out + jj * kBlockQ, probability(jj, sum));
          }
          return sum;
        };
        using Yes = std::true_type;
        using No = std::false_type;
        const F sum = s.pt ? (dropout ? probabilities(Yes{}, Yes{}) : probabilities(Yes{}, No{}))
                           : (dropout ? probabilities(No{}, Yes{}) : probabilities(No{}, No{}));
        const F alpha = S::exp2(S::sub(m_old, m_use));
        S::store(s.l + c * kLanes, S::fmadd(S::load(s.l + c * kLanes), alpha, sum));
        S::store(s.m + c * kLanes, m_new);
        if (s.pt) S::store(s.block_m + j0 / kBlockK * kBlockQ + c * kLanes, m_new);
        S::store(s.alpha + c * kLanes, alpha);
        rescale = rescale || !S::all(S::eq(alpha, S::set1(1.0f)));
      }
      // O^T = O^T diag(alpha) + V^T P^T, the rescaling as the accumulators are loaded; the first
      // block's O^T starts at zero.
      const float* const alpha = rescale ? s.alpha : nullptr;
      if constexpr (kPairs) {
        T::accumulate(s.ot, s.vw, s.ptw, nbp / 2, p.dim_v, vecs, alpha, fresh);
      } else {
        T::accumulate(s.ot, s.vp, tile, nbp, p.dim_v, vecs, alpha, fresh);
      }
      fresh = false;
    }
    if (fresh) std::memset(s.ot, 0, sizeof(float) * p.dim_v * kBlockQ);  // (no key block: O = 0)
  }

  // bfloat16 products: the key rows [j0, j0 + nbp) in place as pairs of dims (keys past Lk read a
  // zero row), and the value rows as pairs of keys per column, into s.vw_rows (zeros past Lk).
  void pair_rows(Scratch& s, const KeyValueRows& kv, int64_t j0, int64_t nbp) const {
    const auto* zero = reinterpret_cast<const uint32_t*>(s.zero_row);
    const auto* keys = static_cast<const uint16_t*>(kv.k_low);
    for (int64_t jj = 0; jj < nbp; ++jj) {
      const int64_t j = j0 + jj;
      s.kw[jj] = j < p.len_k ? reinterpret_cast<const uint32_t*>(keys + kv.k_at(j)) : zero;
    }
    const int64_t width = round_up(p.dim_v, kLanes);
    const uint32_t* rows = kv.v_pairs ? kv.v_pairs + j0 / 2 * width : s.vw_rows;
    if (!kv.v_pairs) copy_value_pairs(kv, j0 / 2, (j0 + nbp) / 2, s.vw_rows);
    for (int64_t jj = 0; jj < nbp; jj += 2) s.vw[jj / 2] = rows + jj / 2 * width;
  }

  // Pairs of kv's value rows [r0, r1) (pair r: keys 2r and 2r + 1, zeros past Lk) as pairs of keys
  // per column, pair r0 at dst, rows round_up(Dv, kLanes) words apart (zeros past Dv).
  void copy_value_pairs(const KeyValueRows& kv, int64_t r0, int64_t r1, uint32_t* dst) const {
    const int64_t width = round_up(p.dim_v, kLanes);
    const auto* values = static_cast<const uint16_t*>(kv.v_low);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* a = 2 * r < p.len_k ? values + kv.v_at(2 * r) : nullptr;
      const uint16_t* b = 2 * r + 1 < p.len_k ? values + kv.v_at(2 * r + 1) : nullptr;
      for (int64_t d = 0; d < width; d += kLanes) S::store_w(dst + (r - r0) * width + d, S::interleave_rows(a, b, d, p.dim_v));
    }
  }

  // The kept P of every visible block brought to the final statistics, 2^(s - m_block) *
  // 2^(m_block - m) / l (s.l holds 1/l here), then stored: as the head's weights, or added,
  // scaled by 1 / Hq, to the head average (every head of the rows, in order, runs in one task,
  // or the average is summed from the weights afterwards with the same operations and order).
  void finish_weights(const Scratch& s, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t key_end) const {
    const int vecs = T::vecs_for(rows);
    const F neg_inf = S::set1(-std::numeric_limits<float>::infinity());
    for (int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
      const int64_t nbp = round_up(std::min<int64_t>(kBlockK, key_end - j0), kKeysPerTile);
      for (int c = 0; c < vecs; ++c) {
        const F m = S::load(s.m + c * kLanes);
        const F m_use = S::select(S::eq(m, neg_inf), S::zero(), m);
        const F m_block = S::load(s.block_m + j0 / kBlockK * kBlockQ + c * kLanes);
        // m_block <= m, so the factor is at most 1/l; 2^-inf is 0 for a block seen before any finite score.
        const F factor = S::mul(S::exp2(S::sub(m_block, m_use)), S::load(s.l + c * kLanes));
        for (int64_t jj = 0; jj < nbp; ++jj) {
          float* row = s.pt + (j0 + jj) * kBlockQ + c * kLanes;
          S::store(row, S::mul(S::load(row), factor));
        }
      }
    }
    if (o.weights != nullptr) {
      float* w = o.weights + b * o.weights_strides[0] + h * o.weights_strides[1] + i0 * o.weights_strides[2];
      const int64_t sr = o.weights_strides[2], sc = o.weights_strides[3];
      for (int64_t ii = 0; ii < rows; ++ii) {
        for (int64_t j = 0; j < key_end; ++j) w[ii * sr + j * sc] = s.pt[j * kBlockQ + ii];
        for (int64_t j = key_end; j < p.len_k; ++j) w[ii * sr + j * sc] = 0.0f;  // keys no row of the task sees
      }
    } else {
      float* avg = o.average_weights + (b * p.len_q + i0) * p.len_k;
      for (int64_t ii = 0; ii < rows; ++ii) {
        for (int64_t j = 0; j < key_end; ++j) s.wrow[j] = s.pt[j * kBlockQ + ii];
        add_head_share(avg + ii * p.len_k, s.wrow, key_end);
      }
    }
  }

  // avg[j] += w[j] * (1 / Hq), j < n, a multiply and an add in SIMD operations (never fused into
  // one, whatever the compiler's contraction rules): one head's share of the average, the same
  // operations in both schedules.
  void add_head_share(float* avg, const float* w, int64_t n) const {
    const float inv_h = 1.0f / static_cast<float>(p.heads_q);
    const F scale = S::set1(inv_h);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) S::store(avg + j, S::add(S::load(avg + j), S::mul(S::load(w + j), scale)));
    if (j == n) return;
    alignas(64) float a[kLanes] = {}, x[kLanes] = {};  // the last partial vector, through copies
    std::memcpy(a, avg + j, sizeof(float) * (n - j));
    std::memcpy(x, w + j, sizeof(float) * (n - j));
    S::store(a, S::add(S::load(a), S::mul(S::load(x), scale)));
    std::memcpy(avg + j, a, sizeof(float) * (n - j));
  }

  // The natural log-sum-exp of each row from the base-2 statistics: (m + log2 l) ln 2.
  void write_lse(const Scratch& s, int64_t b, int64_t h, int64_t i0, int64_t rows) const {
    if (o.lse == nullptr) return;
    float* lse = o.lse + (b * p.heads_q + h) * p.len_q + i0;
    for (int64_t ii = 0; ii < rows; ++ii) {
      lse[ii] = s.l[ii] > 0 ? (s.m[ii] + std::log2(s.l[ii])) * kLn2 : std::numeric_limits<float>::infinity();
    }
  }

  void task(Scratch& s, const KeyValueRows& kv, int64_t b, int64_t h, int64_t i0) const {
    const int64_t rows = std::min<int64_t>(kBlockQ, p.len_q - i0);
    const float qscale = static_cast<float>(p.scale) * p.key_descale(b, h / p.group()) * kLog2e;

    // Q^T, pre-scaled; lanes past the last query stay zero.
    const int64_t q_offset = b * p.q.strides[0] + h * p.q.strides[1] + i0 * p.q.strides[2];
    if constexpr (kPairs) {
      s.qk_scale = qscale;
      const auto* q = p.q.data_as<const uint16_t>() + q_offset;
      S::transpose_pairs(q, p.q.strides[2], rows, p.dim_qk / 2, s.qtw, kBlockQ);
    } else {
      // Transposed in 8 x 8 blocks (a scalar store per element was 3% of a BERT-sized call; 8
      // rows at a time, where a column-wise read of all 48 rows missed L1 on every element when
      // the rows lie a multiple of 4 KiB apart and share their L1 sets), then scaled in place
      // (the same one rounding), the lanes past the last query zeroed. Low-precision rows are
      // widened first, into the key block's buffer (free until the first key block; element by
      // element into the transpose, float16 queries took 12% of a BERT-sized call).
      const float* qb = p.q.dtype == DType::f32 ? p.q.data_as<float>() + q_offset : s.kconv;
      int64_t q_stride = p.q.strides[2];
      if (p.q.dtype != DType::f32) {
        for (int64_t ii = 0; ii < rows; ++ii)
          T::widen(p.q.dtype, element_address(p.q.data, p.q.dtype, q_offset + ii * p.q.strides[2]), s.kconv + ii * p.dim_qk,
                   p.dim_qk);
        q_stride = p.dim_qk;
      }
      T::transpose_rect(qb, q_stride, s.qt, kBlockQ, rows, p.dim_qk);
      const F scale = S::set1(qscale);
      for (int64_t d = 0; d < p.dim_qk; ++d) {
        float* col = s.qt + d * kBlockQ;
        for (int c = 0; c < kVecs; ++c) S::store(col + c * kLanes, S::mul(S::load(col + c * kLanes), scale));
        std::fill(col + rows, col + kBlockQ, 0.0f);
      }
    }
    for (int64_t ii = 0; ii < kBlockQ; ++ii) {
      const int64_t i = i0 + ii;
      int64_t lim = p.len_k;
      if (p.causal) lim = std::clamp<int64_t>(i + p.causal_offset + 1, 0, p.len_k);
      s.lim[ii] = static_cast<uint32_t>(lim);
      s.lo[ii] = static_cast<uint32_t>(std::min(p.window_begin(i), lim));
      s.m[ii] = -std::numeric_limits<float>::infinity();
      s.l[ii] = 0.0f;
      if (p.dropout_p > 0) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
        s.key_lo[ii] = key.lo;
        s.key_hi[ii] = key.hi;
      }
    }
    // Limits grow with the query index, so the first row bounds the blocks that need no mask and
    // the last row bounds the blocks that are visited at all: causal blocks are skipped, not masked.
    // A sliding window's left ends grow too: blocks before the first row's are skipped (but where
    // weights are kept, which holds every block from the first), and those before the last row's
    // are masked.
    const int64_t key_end = s.lim[rows - 1];
    const int64_t clean_end = s.lim[0];
    const int64_t key_begin = s.pt ? 0 : s.lo[0] / kBlockK * kBlockK;
    const int64_t clean_begin = s.lo[rows - 1];

    s.skips_swamped = mask_columns.ordinary.all(b, h, i0, i0 + rows);
    key_pass(s, kv, b, h, i0, rows, key_begin, key_end, clean_begin, clean_end);
    s.ahead.issue(s.ahead.lines_left());  // (what skipped blocks left)
    write_lse(s, b, h, i0, rows);
    for (int64_t ii = 0; ii < kBlockQ; ++ii) s.l[ii] = s.l[ii] > 0 ? 1.0f / s.l[ii] : 0.0f;
    if (s.pt) finish_weights(s, b, h, i0, rows, key_end);
    store_output(s, b, h, i0, rows);
  }

  // O = O^T / l for the task's rows, in the output's dtype: bfloat16 and float16 are rounded here,
  // once, as a float32 output copied into them afterwards would be. O^T is scaled in place (each
  // query's 1/l times descale, one vector of queries at a time), then transposed in 8 x 8 blocks:
  // straight into a float32 output with unit stride, else through s.st (free once the key pass is
  // over) as many rows at a time as it holds: reading a row soon after its transpose wrote it
  // waited on the stores (two 32-byte stores do not forward to one 64-byte load; with 8 rows at a
  // time, bf16 BERT-sized calls ran 4% slower). (A scalar store per element was 4% of such a call.)
  void store_output(Scratch& s, int64_t b, int64_t h, int64_t i0, int64_t rows) const {
    const int64_t offset = b * o.out_strides[0] + h * o.out_strides[1] + i0 * o.out_strides[2];
    const F descale = S::set1(p.value_descale(b, h / p.group()));  // (1 but for float8 values with v_descale)
    float* const ot = s.ot;  // (in locals: the stores below may alias the scratch's fields, and p's)
    const int64_t dim_v = p.dim_v;
    if constexpr (requires { S::store_16bit_rows; }) {
      // bfloat16 and float16 rows with unit stride: rounded from O^T as pairs of dims, the words
      // transposed (the same product and rounding as below, without the float32 row buffer).
      if ((o.out_dtype == DType::bf16 || o.out_dtype == DType::f16) && o.out_strides[3] == 1) {
        for (int c = 0; c < kVecs; ++c) S::store(s.alpha + c * kLanes, S::mul(S::load(s.l + c * kLanes), descale));
        S::store_16bit_rows(o.out_dtype, ot, kBlockQ, s.alpha, dim_v, rows, static_cast<uint16_t*>(o.out) + offset,
                            o.out_strides[2]);
        return;
      }
    }
    for (int c = 0; c < T::vecs_for(rows); ++c) {  // (the vectors the key pass wrote)
      const F factor = S::mul(S::load(s.l + c * kLanes), descale);
      for (int64_t d = 0; d < dim_v; ++d) {
        float* at = ot + d * kBlockQ + c * kLanes;
        S::store(at, S::mul(S::load(at), factor));
      }
    }
    if (o.out_dtype == DType::f32 && o.out_strides[3] == 1) {
      T::transpose_rect(s.ot, kBlockQ, static_cast<float*>(o.out) + offset, o.out_strides[2], p.dim_v, rows);
      return;
    }
    if (p.dim_v > kBlockK * kBlockQ) {  // (a row longer than s.st: element by element)
      with_output_elements(o.out, o.out_dtype, offset, [&](auto* out, auto round) {
        for (int64_t ii = 0; ii < rows; ++ii)
          for (int64_t d = 0; d < p.dim_v; ++d) out[ii * o.out_strides[2] + d * o.out_strides[3]] = round(s.ot[d * kBlockQ + ii]);
      });
      return;
    }
    const int64_t chunk = kBlockK * kBlockQ / std::max<int64_t>(p.dim_v, 1);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      T::transpose_rect(s.ot + r0, kBlockQ, s.st, p.dim_v, p.dim_v, n);
      with_output_elements(o.out, o.out_dtype, offset + r0 * o.out_strides[2], [&](auto* out, auto round) {
        for (int64_t ii = 0; ii < n; ++ii)
          for (int64_t d = 0; d < p.dim_v; ++d) out[ii * o.out_strides[2] + d * o.out_strides[3]] = round(s.st[ii * p.dim_v + d]);
      });
    }
  }

  // The query tasks of key/value head groups [g0, g1) (a group: one batch, one key/value head, the
  // query heads that share it), each reading its group's rows from rows_of(group). With the head
  // average summed in the tasks (g0 and g1 then whole batch entries), a task takes every head of
  // its query rows, in order.
  template <class RowsOf>
  void run_groups(int64_t g0, int64_t g1, int threads, const RowsOf& rows_of) const {
    const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ;
    const int64_t group = p.heads_q / p.heads_kv;
    if (o.average_weights != nullptr) {
      parallel_for((g1 - g0) / p.heads_kv * q_blocks, threads, [&](int64_t t, int) {
        const int64_t i0 = (q_blocks - 1 - t % q_blocks) * kBlockQ;
        const int64_t b = g0 / p.heads_kv + t / q_blocks;
        const int64_t rows = std::min<int64_t>(kBlockQ, p.len_q - i0);
        std::fill_n(o.average_weights + (b * p.len_q + i0) * p.len_k, rows * p.len_k, 0.0f);
        Scratch s = allocate();
        for (int64_t h = 0; h < p.heads_q; ++h) task(s, rows_of(b * p.heads_kv + h / group), b, h, i0);
      });
      return;
    }
    const int64_t tasks = (g1 - g0) * group * q_blocks;
    const bool prefetch = call_bytes() >= kMinBytesToPrefetch;
    parallel_for(tasks, threads, [&](int64_t t, int) {
      const QueryTask now = query_task(t, g0);
      Scratch s = allocate();
      // With every thread taking the next index in turn, this thread's next task is likely t + threads.
      if (prefetch && t + threads < tasks) queue_rows(s.ahead, query_task(t + threads, g0), now.g, rows_of);
      task(s, rows_of(now.g), now.b, now.h, now.i0);
    });
  }

  // Task t of run_groups from group g0: last query blocks first (under a top-left causal mask they
  // are the longest), then the group's query heads, then the groups.
  struct QueryTask {
    int64_t g, b, h, i0;
  };
  QueryTask query_task(int64_t t, int64_t g0) const {
    const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ, group = p.heads_q / p.heads_kv;
    const int64_t g = g0 + t / q_blocks / group;
    return {g, g / p.heads_kv, g % p.heads_kv * group + t / q_blocks % group, (q_blocks - 1 - t % q_blocks) * kBlockQ};
  }

  // The bytes of the call's rows: q, k, v and the output.
  int64_t call_bytes() const {
    const int64_t queries = p.batch * p.heads_q * p.len_q, keys = p.batch * p.heads_kv * p.len_k;
    return queries * (p.dim_qk * dtype_size(p.q.dtype) + p.dim_v * dtype_size(o.out_dtype)) +
           keys * (p.dim_qk * dtype_size(p.k.dtype) + p.dim_v * dtype_size(p.v.dtype));
  }

  // Keys and values of a new group prefetched for a task: its first rows, as many as fit the L2
  // with room to spare (a task of a long head reads its keys in blocks, which the hardware
  // prefetchers follow).
  static constexpr int64_t kMaxPrefetchedKeyValueBytes = 256 << 10;

  // Queues the rows task `next` reads and writes: its query rows, its output rows and, when its
  // group is not `current_group` (whose rows this thread is reading now), its keys and values.
  template <class RowsOf>
  void queue_rows(RowPrefetch& ahead, const QueryTask& next, int64_t current_group, const RowsOf& rows_of) const {
    const int64_t rows = std::min<int64_t>(kBlockQ, p.len_q - next.i0);
    const int64_t q_size = dtype_size(p.q.dtype), out_size = dtype_size(o.out_dtype);
    // (Rows whose elements are not adjacent, a transposed view's, are left to the hardware.)
    const int64_t q_at = next.b * p.q.strides[0] + next.h * p.q.strides[1] + next.i0 * p.q.strides[2];
    const int64_t out_at = next.b * o.out_strides[0] + next.h * o.out_strides[1] + next.i0 * o.out_strides[2];
    if (p.q.strides[3] == 1)
      ahead.add(element_address(p.q.data, p.q.dtype, q_at), rows, p.dim_qk * q_size, p.q.strides[2] * q_size, false);
    if (o.out_strides[3] == 1)
      ahead.add(element_address(o.out, o.out_dtype, out_at), rows, p.dim_v * out_size, o.out_strides[2] * out_size, true);
    if (next.g == current_group) return;
    const KeyValueRows kv = rows_of(next.g);
    const int64_t k_size = kv.k ? 4 : dtype_size(p.k.dtype), v_size = kv.v ? 4 : dtype_size(p.v.dtype);
    int64_t keys =
        std::min<int64_t>(p.len_k, kMaxPrefetchedKeyValueBytes / std::max<int64_t>(1, p.dim_qk * k_size + p.dim_v * v_size));
    if (p.key_pages) keys = std::min(keys, p.page_size);  // (the first page's rows)
    ahead.add(kv.k ? static_cast<const void*>(kv.k) : element_address(kv.k_low, p.k.dtype, kv.k_at(0)), keys,
              p.dim_qk * k_size, kv.k_stride * k_size, false);
    if (kv.v_pairs) {  // (pairs of keys, round_up(Dv, kLanes) words a pair)
      const int64_t bytes = round_up(p.dim_v, kLanes) * 4;
      ahead.add(kv.v_pairs, (keys + 1) / 2, bytes, bytes, false);
    } else {
      ahead.add(kv.v ? static_cast<const void*>(kv.v) : element_address(kv.v_low, p.v.dtype, kv.v_at(0)), keys,
                p.dim_v * v_size, kv.v_stride * v_size, false);
    }
  }

  // The head average of the weights (the module's default, PyTorch's average_attn_weights) is
  // summed inside tasks that take every head of their query rows, so the [B, Hq, Lq, Lk] weights
  // are never stored: at E=1024 H=16 B=4 L=512 they are 64 MiB, written and read back. Such
  // tasks are Hq times fewer; with fewer than this many per thread the last ones would leave
  // threads idle, and the heads run as their own tasks into a weights buffer instead, averaged
  // afterwards with the same operations in the same order (the same bits).
  static constexpr int64_t kMinAverageTasksPerThread = 4;

  bool averages_in_tasks(int threads) const {
    const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ;
    return p.batch * q_blocks >= kMinAverageTasksPerThread * threads;
  }

  void run_then_average(int threads) const {
    const Tensor weights = Tensor::empty({p.batch, p.heads_q, p.len_q, p.len_k});
    ForwardOutputs per_head = o;
    per_head.average_weights = nullptr;
    per_head.weights = weights.data<float>();
    const int64_t strides[4] = {p.heads_q * p.len_q * p.len_k, p.len_q * p.len_k, p.len_k, 1};
    std::copy_n(strides, 4, per_head.weights_strides);
    FlashForward{p, per_head}.run();
    constexpr int64_t kRowsPerTask = 16;
    const int64_t row_blocks = (p.len_q + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(p.batch * row_blocks, threads, [&](int64_t t, int) {
      const int64_t b = t / row_blocks, i0 = t % row_blocks * kRowsPerTask;
      const int64_t rows = std::min(p.len_q, i0 + kRowsPerTask) - i0;
      float* avg = o.average_weights + (b * p.len_q + i0) * p.len_k;
      std::fill_n(avg, rows * p.len_k, 0.0f);
      for (int64_t h = 0; h < p.heads_q; ++h)
        for (int64_t ii = 0; ii < rows; ++ii)
          add_head_share(avg + ii * p.len_k, per_head.weights + (b * p.heads_q + h) * strides[1] + (i0 + ii) * p.len_k,
                         p.len_k);
    });
  }

  // Widening per key block costs each of a head's query tasks a pass over all its keys: cheap for
  // a few tasks, 5% of the call at 2048 queries (43 tasks per head; measured on AVX2, d=64 and 128).
  static constexpr int64_t kMaxQueriesWidenedPerTask = 512;

  // float32 keys and values whose rows are not packed (the heads of a [B, L, H, D] tensor, or of a
  // packed QKV projection) lie a row stride apart that is often a multiple of 4 KiB. Every row of
  // a key block then maps to the same few L1 sets, and the tile products read them from L2 and
  // beyond: B=4 H=16 d=64 with the 12 KiB rows of a [B, L, 3E] projection ran 1.14x slower than
  // with its rows copied packed at L=512, 1.31x at L=2048. Such rows are copied packed, once per
  // head, when the head has this many query tasks to share the copy (the two were level at about
  // 250 queries, d=64 and 128; shorter heads fit in L2 and read their rows in place).
  static constexpr int64_t kMinTasksToPack = 6;

  bool packs_float32_rows() const {
    if (widens()) return false;
    const bool packed = p.k.strides[2] == p.dim_qk && p.v.strides[2] == p.dim_v;
    const int64_t tasks_per_group = (p.len_q + kBlockQ - 1) / kBlockQ * (p.heads_q / p.heads_kv);
    return !packed && tasks_per_group >= kMinTasksToPack;
  }

  // A mask term that varies along the queries (an [Lq, Lk] attn_mask, say) is read in the S^T
  // tile's columns: a square at a time, transposed in registers, took 15% of a forward at d=64
  // L=1024 (add_mask). Each (batch, head) slice of such a mask is therefore copied once per call,
  // transposed, scaled and laid out as the tasks read it: per block of kBlockQ queries, one row of
  // kBlockQ floats per key, zero past the last query, so a task adds one vector of queries per key
  // from consecutive memory. The values are mask_square's, so the bits are add_mask's. Up to
  // transposed_mask_floats() floats per term (8 Mi; an [Lq, Lk] mask of 2048 x 2048 is 4 Mi).
  int64_t mask_slice_floats() const { return round_up(p.len_q, kBlockQ) * p.len_k; }
  int64_t key_blocks() const { return (p.len_k + kBlockK - 1) / kBlockK; }

  // Whether a copied mask term excludes every pair of the key block at j0 for the task's queries
  // (then the block adds nothing: p = 0 for each of its keys, and the running max is unchanged).
  // A swamped block is skipped too where `swamped` (the task's rows all have an ordinary key).
  bool block_excluded(int64_t b, int64_t h, int64_t i0, int64_t j0, bool swamped) const {
    for (int t = 0; t < p.num_masks; ++t) {
      const int64_t slice = mask_slice(p.masks[t], p.heads_q, b, h);
      uint8_t what = kKept;
      if (const uint8_t* excluded = mask_columns.excluded[t]) {
        const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ, copied = slice - mask_columns.first_slice[t];
        what = excluded[(copied * q_blocks + i0 / kBlockQ) * key_blocks() + j0 / kBlockK];
      } else if (const uint8_t* keys = mask_columns.excluded_keys[t]) {
        what = keys[slice * key_blocks() + j0 / kBlockK];
      }
      if (what == kExcluded || (what == kSwamped && swamped)) return true;
    }
    return false;
  }

  // How a mask term is read: a term that does not vary along the queries in place, with a map of
  // the key blocks it excludes; others from a transposed copy, of every slice at once where that
  // fits the cap, else of a chunk of batch entries at a time where the term varies along the batch
  // and one entry's slices fit (an HF mask [B, 1, L, S] at B=4 L=2048 is 16 Mi floats; read in
  // place, a forward took 1.25x the time), else in place (counts that overflow, as a view's
  // aliasing strides may make, read in place too).
  enum class MaskRead { by_key, copied, copied_per_chunk, in_place };
  int64_t slices_per_entry(const MaskTerm& m) const { return m.strides[1] != 0 ? p.heads_q : 1; }
  MaskRead mask_read(const MaskTerm& m) const {
    if (m.strides[2] == 0) return MaskRead::by_key;
    if (m.by_distance()) return MaskRead::in_place;  // (read as fast as a copy: add_mask's one load per key)
    const int64_t cap = transposed_mask_floats().load();
    int64_t slices = 0, floats = 0;
    if (!mask_slice_count(m, p.batch, p.heads_q, &slices)) return MaskRead::in_place;
    if (!__builtin_mul_overflow(slices, mask_slice_floats(), &floats) && floats <= cap) return MaskRead::copied;
    if (m.strides[0] != 0 && !__builtin_mul_overflow(slices_per_entry(m), mask_slice_floats(), &floats) && floats <= cap)
      return MaskRead::copied_per_chunk;
    return MaskRead::in_place;
  }
  // Batch entries per chunk: as many as each term copied per chunk fits in the cap; every entry
  // where no term is.
  int64_t mask_batch_chunk() const {
    int64_t chunk = p.batch;
    for (int t = 0; t < p.num_masks; ++t)
      if (mask_read(p.masks[t]) == MaskRead::copied_per_chunk)
        chunk = std::min(chunk, transposed_mask_floats().load() / (slices_per_entry(p.masks[t]) * mask_slice_floats()));
    return std::max<int64_t>(chunk, 1);
  }

  // Slices [slice_begin, slice_end) of term m transposed, scaled and laid out as the tasks read
  // them (slice_begin's at dst), with their maps of excluded blocks [slice][query block][key block].
  void copy_mask_slices(const MaskTerm& m, int64_t slice_begin, int64_t slice_end, float* dst, uint8_t* excluded,
                        int threads) const {
    const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ, k_blocks = key_blocks();
    parallel_for((slice_end - slice_begin) * q_blocks, threads, [&](int64_t task, int) {
      const int64_t slice = slice_begin + task / q_blocks, i0 = task % q_blocks * kBlockQ;
      int64_t b = 0, h = 0;
      mask_slice_origin(m, p.heads_q, slice, &b, &h);
      float* out = dst + (slice - slice_begin) * mask_slice_floats() + i0 * p.len_k;
      alignas(64) float square[kLanes * kLanes], turned[kLanes * kLanes];
      for (int64_t j0 = 0; j0 < p.len_k; j0 += kLanes) {
        const int nc = static_cast<int>(std::min<int64_t>(kLanes, p.len_k - j0));
        for (int64_t ii0 = 0; ii0 < kBlockQ; ii0 += kLanes) {
          const int nr = static_cast<int>(std::clamp<int64_t>(p.len_q - i0 - ii0, 0, kLanes));
          T::mask_square(m, b, h, i0 + ii0, nr, j0, nc, square);
          T::transpose_square(square, turned);
          for (int c = 0; c < nc; ++c) S::store(out + (j0 + c) * kBlockQ + ii0, S::load(turned + c * kLanes));
        }
      }
      const int64_t rows = std::min<int64_t>(kBlockQ, p.len_q - i0);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t end = std::min<int64_t>((kb + 1) * kBlockK, p.len_k) * kBlockQ;
        bool all = true, all_swamped = true;
        for (int64_t at = kb * kBlockK * kBlockQ; at < end && (all || all_swamped); at += kBlockQ)
          for (int64_t ii = 0; ii < rows; ++ii) {
            all = all && out[at + ii] == -std::numeric_limits<float>::infinity();
            all_swamped = all_swamped && out[at + ii] <= kSwampedBelow;
          }
        excluded[task * k_blocks + kb] = block_class(all, all_swamped, true);
      }
    });
  }

  // The transposed copies of the masks that take one, in `storage` (of the first `chunk` batch
  // entries for a term copied per chunk); the problem's other masks stay null and are read in
  // place, with their maps.
  MaskColumns transpose_masks(int threads, std::vector<Tensor>& storage, int64_t chunk) const {
    MaskColumns cols;
    cols.done = true;
    const int64_t q_blocks = (p.len_q + kBlockQ - 1) / kBlockQ;
    for (int t = 0; t < p.num_masks; ++t) {
      const MaskTerm& m = p.masks[t];
      const MaskRead read = mask_read(m);
      if (read == MaskRead::by_key) {
        cols.excluded_keys[t] = excluded_key_blocks<S>(p, m, kBlockK, threads, storage, true);
        continue;
      }
      if (read == MaskRead::in_place) {
        cols.excluded[t] = excluded_tiles<S>(p, m, kBlockQ, kBlockK, threads, storage, true);
        continue;
      }
      int64_t slices = 0;
      mask_slice_count(m, p.batch, p.heads_q, &slices);
      if (read == MaskRead::copied_per_chunk) slices = chunk * slices_per_entry(m);
      storage.push_back(Tensor::empty({slices * mask_slice_floats()}));
      float* dst = storage.back().data<float>();
      storage.push_back(Tensor::empty({slices * q_blocks * key_blocks()}, DType::boolean));
      uint8_t* excluded = storage.back().data<uint8_t>();
      copy_mask_slices(m, 0, slices, dst, excluded, threads);
      cols.data[t] = dst;
      if (skips_excluded_blocks().load()) cols.excluded[t] = excluded;
      if (read == MaskRead::copied_per_chunk) cols.chunk_data[t] = dst, cols.chunk_excluded[t] = excluded;
    }
    cols.ordinary = ordinary_rows(p, threads, storage);
    return cols;
  }

  // The copies of the terms copied per chunk, for batch entries [b0, b1), into their buffers.
  void copy_chunk(MaskColumns& cols, int64_t b0, int64_t b1, int threads) const {
    for (int t = 0; t < p.num_masks; ++t) {
      if (cols.chunk_data[t] == nullptr) continue;
      const int64_t per_entry = slices_per_entry(p.masks[t]);
      cols.first_slice[t] = b0 * per_entry;
      copy_mask_slices(p.masks[t], b0 * per_entry, b1 * per_entry, cols.chunk_data[t], cols.chunk_excluded[t], threads);
    }
  }

  void run() const {
    const int threads = resolve_threads(p.num_threads);
    // Decoding; the head average from its per-head weights. (With bfloat16 products, the
    // few-query shapes bf16_pairs_take_few_queries sends here: no weights returned.)
    if (FewQueries<S>::applies(p, o) && (!kPairs || FewQueries<S>::pair_products(p))) {
      if (o.average_weights != nullptr) return run_then_average(threads);
      if (!p.windowed) return FewQueries<S>{p, o}.run();
      const AttentionProblem masked = with_window_as_mask(p);  // (its own key blocks skip by masks)
      return FewQueries<S>{masked, o}.run();
    }
    if (o.average_weights != nullptr && !averages_in_tasks(threads)) return run_then_average(threads);
    if (p.key_pages && page_rows.k == nullptr) {
      std::vector<int64_t> k_rows(static_cast<size_t>(p.len_k)), v_rows(static_cast<size_t>(p.len_k));
      for (int64_t j = 0; j < p.len_k; ++j) {
        const int64_t page = p.key_pages[j / p.page_size], row = j % p.page_size;
        k_rows[static_cast<size_t>(j)] = page * p.k.strides[0] + row * p.k.strides[2];
        v_rows[static_cast<size_t>(j)] = page * p.v.strides[0] + row * p.v.strides[2];
      }
      FlashForward tabled = *this;
      tabled.page_rows = {k_rows.data(), v_rows.data()};
      return tabled.run();
    }
    if (!mask_columns.done) {
      std::vector<Tensor> storage;
      const int64_t chunk = mask_batch_chunk();
      MaskColumns cols = transpose_masks(threads, storage, chunk);
      for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
        const int64_t b1 = std::min(p.batch, b0 + chunk);
        if (b0 > 0) copy_chunk(cols, b0, b1, threads);
        FlashForward{p, o, cols, page_rows}.run_groups_of(b0 * p.heads_kv, b1 * p.heads_kv, threads);
      }
      return;
    }
    run_groups_of(0, p.batch * p.heads_kv, threads);
  }

  // bfloat16 products in query tasks (groups that do not balance as whole-group tasks): a task
  // copies each key block's values as pairs of keys, which every query task of the head repeats.
  // With more queries than this per key/value head, the values of a chunk of groups are copied
  // once, into a buffer the chunk's tasks share.
  static constexpr int64_t kMinQueriesToPairValues = 256;

  void run_groups_with_value_pairs(int64_t g_begin, int64_t g_end, int threads) const {
    const int64_t width = round_up(p.dim_v, kLanes), pairs = round_up(p.len_k, kBlockK) / 2;
    const int64_t per_group = std::max<int64_t>(pairs * width, 1);  // words (at least one: Dv may be 0)
    int64_t chunk = std::clamp<int64_t>(widened_chunk_floats().load() / per_group, 1, g_end - g_begin);
    if (o.average_weights != nullptr) chunk = std::max<int64_t>(chunk / p.heads_kv, 1) * p.heads_kv;  // whole batch entries
    const Tensor buffer = Tensor::empty({chunk * per_group});
    auto* packed = reinterpret_cast<uint32_t*>(buffer.data<float>());
    constexpr int64_t kPairsPerCopyTask = 128;
    const int64_t row_tasks = (pairs + kPairsPerCopyTask - 1) / kPairsPerCopyTask;
    for (int64_t g0 = g_begin; g0 < g_end; g0 += chunk) {
      const int64_t g1 = std::min(g_end, g0 + chunk);
      parallel_for((g1 - g0) * row_tasks, threads, [&](int64_t t, int) {
        const int64_t g = g0 + t / row_tasks, r0 = t % row_tasks * kPairsPerCopyTask;
        const int64_t r1 = std::min(pairs, r0 + kPairsPerCopyTask);
        const KeyValueRows in = input_rows(g / p.heads_kv, g % p.heads_kv);
        copy_value_pairs(in, r0, r1, packed + (g - g0) * per_group + r0 * width);
      });
      run_groups(g0, g1, threads, [&](int64_t g) {
        KeyValueRows kv = input_rows(g / p.heads_kv, g % p.heads_kv);
        kv.v_pairs = packed + (g - g0) * per_group;
        return kv;
      });
    }
  }

  // A task is a whole group where the groups balance over the threads: its query tasks in turn
  // on one thread, whose L2 then holds the group's keys and values (read by that thread alone),
  // and with bfloat16 products its values copied as pairs of keys once, into the thread's own
  // buffer. (Copied for a chunk of groups at a time into a buffer too large for L2, the copy was
  // a phase of its own, 5% of a B=4 H=16 L=512 forward.) Against query tasks handed out one by
  // one: fp32 BERT-sized (B=32 H=12 L=128) +8%, L=512 +4%, L=2048 +3%; bf16 +8%, +4.5%, +2%.
  // Groups are equal work (the same rows and mask shape), so the largest multiple of the thread
  // count runs as whole groups and the rest, fewer than the threads, as query tasks that every
  // thread shares. The pair buffers are bounded as the chunk's.
  //
  // With bfloat16 products, keys whose rows are not packed (the heads of a [B, L, H, D] tensor, as
  // the module's projections write them) are copied packed into that buffer too: their rows a
  // head-row stride apart (2 KiB at E = 1024) share a few L1 sets, and a key block's 64 rows
  // evicted each other during the score product (B=4 H=16 L=512 d=64 from such views: 5.93 to
  // 5.84 ms, packed tensors 5.55; the copy is about 1/1000 of a group's time).
  int64_t value_pair_words() const { return std::max<int64_t>(round_up(p.len_k, kBlockK) / 2 * round_up(p.dim_v, kLanes), 1); }
  bool packs_key_rows() const { return kPairs && (p.k.strides[2] != p.dim_qk || p.key_pages); }
  int64_t group_buffer_words() const {
    return value_pair_words() + (packs_key_rows() ? (p.len_k * p.dim_qk + 1) / 2 : 0);
  }

  int64_t whole_groups(int64_t groups, int threads) const {
    if (o.average_weights != nullptr) return 0;  // (its tasks take every head of their rows)
    if (kPairs && threads * group_buffer_words() > widened_chunk_floats().load()) return 0;
    return groups - groups % threads;
  }

  void run_whole_groups(int64_t g_begin, int64_t g_end, int threads) const {
    const int64_t per_group = kPairs ? group_buffer_words() : 0, pairs = round_up(p.len_k, kBlockK) / 2;
    const Tensor buffers = Tensor::empty({threads * per_group});
    const int64_t tasks = (p.len_q + kBlockQ - 1) / kBlockQ * (p.heads_q / p.heads_kv);
    const bool prefetch = call_bytes() >= kMinBytesToPrefetch;
    const auto input = [&](int64_t g) { return input_rows(g / p.heads_kv, g % p.heads_kv); };
    parallel_for(g_end - g_begin, threads, [&](int64_t i, int worker) {
      const int64_t g = g_begin + i;
      KeyValueRows kv = input(g);
      if constexpr (kPairs) {
        auto* pairs_of_group = reinterpret_cast<uint32_t*>(buffers.data<float>()) + worker * per_group;
        copy_value_pairs(kv, 0, pairs, pairs_of_group);
        kv.v_pairs = pairs_of_group;
        if (packs_key_rows()) {
          auto* keys = reinterpret_cast<uint16_t*>(pairs_of_group + value_pair_words());
          const auto* rows = static_cast<const uint16_t*>(kv.k_low);
          for (int64_t j = 0; j < p.len_k; ++j) std::memcpy(keys + j * p.dim_qk, rows + kv.k_at(j), 2 * p.dim_qk);
          kv.k_low = keys, kv.k_stride = p.dim_qk, kv.k_rows = nullptr;
        }
      }
      for (int64_t t = 0; t < tasks; ++t) {
        const QueryTask now = query_task(t, g);
        Scratch s = allocate();
        // The next task's rows: the group's next query rows, or after its last, the first of the
        // group this thread likely takes next (with its raw values, which the copy reads).
        if (prefetch && t + 1 < tasks) queue_rows(s.ahead, query_task(t + 1, g), g, input);
        else if (prefetch && g + threads < g_end) queue_rows(s.ahead, query_task(0, g + threads), g, input);
        task(s, kv, now.b, now.h, now.i0);
      }
    });
  }

  // Groups (batch entry, key/value head) [g_begin, g_end), whole batch entries.
  void run_groups_of(int64_t g_begin, int64_t g_end, int threads) const {
    if (kPairs || (widens() ? p.len_q <= kMaxQueriesWidenedPerTask : !packs_float32_rows())) {  // rows read in place
      if (const int64_t whole = whole_groups(g_end - g_begin, threads); whole > 0) {
        run_whole_groups(g_begin, g_begin + whole, threads);
        if ((g_begin += whole) == g_end) return;
      }
      if constexpr (kPairs) {
        if (p.len_q * (p.heads_q / p.heads_kv) > kMinQueriesToPairValues) return run_groups_with_value_pairs(g_begin, g_end, threads);
      }
      run_groups(g_begin, g_end, threads, [&](int64_t g) { return input_rows(g / p.heads_kv, g % p.heads_kv); });
      return;
    }
    // A chunk of groups at a time, copy their keys and values once into a shared buffer of packed
    // float32 rows (widened from long low-precision sequences, or float32 rows that were not
    // packed), the work split by rows so that one long head still uses every thread; then run the
    // chunk's tasks on it.
    const int64_t per_group = p.len_k * (p.dim_qk + p.dim_v);  // floats
    int64_t chunk =
        std::clamp<int64_t>(widened_chunk_floats().load() / std::max<int64_t>(per_group, 1), 1, g_end - g_begin);
    if (o.average_weights != nullptr) chunk = std::max<int64_t>(chunk / p.heads_kv, 1) * p.heads_kv;  // whole batch entries
    const Tensor buffer = Tensor::empty({chunk * per_group});
    float* packed = buffer.data<float>();
    constexpr int64_t kRowsPerCopyTask = 256;
    const int64_t row_tasks = (p.len_k + kRowsPerCopyTask - 1) / kRowsPerCopyTask;
    for (int64_t g0 = g_begin; g0 < g_end; g0 += chunk) {
      const int64_t g1 = std::min(g_end, g0 + chunk);
      parallel_for((g1 - g0) * row_tasks, threads, [&](int64_t t, int) {
        const int64_t g = g0 + t / row_tasks, j0 = t % row_tasks * kRowsPerCopyTask;
        const int64_t j1 = std::min(p.len_k, j0 + kRowsPerCopyTask);
        const KeyValueRows in = input_rows(g / p.heads_kv, g % p.heads_kv);
        float* k = packed + (g - g0) * per_group;
        float* v = k + p.len_k * p.dim_qk;
        for (int64_t j = j0; j < j1; ++j) {
          if (widens()) {
            widen_key(in, j, k + j * p.dim_qk);
            widen_value(in, j, v + j * p.dim_v);
          } else {
            std::memcpy(k + j * p.dim_qk, in.k + j * in.k_stride, sizeof(float) * p.dim_qk);
            std::memcpy(v + j * p.dim_v, in.v + j * in.v_stride, sizeof(float) * p.dim_v);
          }
        }
      });
      run_groups(g0, g1, threads, [&](int64_t g) {
        KeyValueRows kv;
        kv.k = packed + (g - g0) * per_group;
        kv.v = kv.k + p.len_k * p.dim_qk;
        kv.k_stride = p.dim_qk;
        kv.v_stride = p.dim_v;
        return kv;
      });
    }
  }
};

}  // namespace
}  // namespace mha::detail
