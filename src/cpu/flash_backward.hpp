// The fused attention backward, flash style: the probabilities are recomputed tile by tile from
// the saved row log-sum-exp, never stored. With S = scale q k^T + mask, P = softmax(S), the
// dropout mask Z (regenerated from the seed) and Pd = P Z / (1 - p):
//   dV = Pd^T dO      dP = (dO V^T) Z / (1 - p)      dS = P (dP - D),  D = rowsum(dO O)
//   dQ = scale dS K   dK = scale dS^T Q               (an additive mask receives dS)
// Deterministic without atomics, in one of two schedules: with many (batch, key/value head) groups,
// one task per group does everything in one pass (group_task); with few, two passes split the
// sequence: pass A owns a block of 48 keys (lanes over keys) and sums dK, dV over every query of
// every head of its group; pass B owns a block of 48 queries (lanes over queries, as in the
// forward) and sums dQ over every key. All use the panel kernels of tile_kernels.hpp with packed
// float32 rows read in place. Either way each gradient element is summed by one task in a fixed
// order, and the schedule is chosen from the shape alone, so the bits do not depend on the
// thread count.
// bfloat16 / float16 q, k, v and output gradient are widened to float32 as rows are read: a
// block of rows at a time into the task's slots in the two passes, once per group (keys) and per
// head (queries) in the group task; float32 rows that are not packed are copied the same way.
// The arithmetic is then the float32 kernel's, and so are the bits. (On AVX512-BF16, bfloat16
// problems take bfloat16 products instead, in both schedules: kPairs below.)
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/dropout.hpp"
#include "core/host_memory.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/excluded_keys.hpp"
#include "cpu/few_queries_backward.hpp"
#include "cpu/row_prefetch.hpp"
#include "cpu/softcap.hpp"
#include "cpu/tile_kernels.hpp"

namespace mha::detail {
namespace {

template <class S>
struct FlashBackward {
  using F = typename S::F;
  using U = typename S::U;
  using M = typename S::M;
  using T = Tiles<S>;
  static constexpr int kLanes = S::kLanes;
  static constexpr int kVecs = T::kVecs;
  static constexpr int kPanel = T::kWidth;  // keys per pass-A task, queries per pass-B task
  static constexpr int kRows = T::kRowsPerTile;
  // Rows (queries in A, keys in B) per step: 64, rounded up to whole dot_rows calls.
  static constexpr int kBlock = (64 + kRows - 1) / kRows * kRows;
  static_assert(kPanel % kRows == 0, "the group task runs dot_rows over whole 48-row panels");
  // bfloat16 products (S::kBf16Pairs; bf16_pairs_backward_takes): the five products over pairs of
  // bfloat16 values (vdpbf16ps), in both schedules. Q, K, V and dO are exact in them: the rows a
  // product broadcasts are read in place as pairs of dims, the panels it multiplies them by hold
  // pairs of dims per row, and for the accumulations Q, dO and K are copied as pairs of rows
  // (queries, keys) per column: in the group task once per head (Q, dO) or group (K), in the two
  // passes per block. Pd, dS and dS^T are rounded to bfloat16 as pairs of rows per lane for them:
  // the gradients are within bfloat16 rounding of the float32 path's (as the AMX backward's).
  // Scores, probabilities and dS are float32 as in the float32 kernel.
  static constexpr bool kPairs = requires { S::kBf16Pairs; };

  const AttentionProblem& p;
  const BackwardInputs& in;
  const BackwardOutputs& out;
  // Masks that vary along the queries, copied for the one-pass schedule in the order of its tiles
  // (tile_masks): for term t, null (read in place), or [slices][key panels][query panels][48][48]
  // floats of log2(e) * value, zero past the last query and key. The maps of what a term excludes
  // entirely (-inf or false for every pair: a causal mask given as a tensor, padding), which the
  // tasks skip as they skip causal tiles (excluded_keys.hpp):
  struct MaskTiles {
    std::array<const float*, 3> data{};
    // one pass: [slices][query panels][key panels]
    std::array<const uint8_t*, 3> excluded{};
    // a term constant along the queries (a key padding mask): [slices][key panels], and for the
    // two-pass query tasks [slices][key blocks of kBlock]
    std::array<const uint8_t*, 3> excluded_keys{};
    std::array<const uint8_t*, 3> excluded_key_blocks{};
    // a term varying along the queries, two passes: [slices][query blocks of kBlock][key panels]
    // for the key tasks, [slices][query panels][key blocks of kBlock] for the query tasks
    std::array<const uint8_t*, 3> keys_pass{};
    std::array<const uint8_t*, 3> queries_pass{};
    OrdinaryRows ordinary{};  // the rows for which swamped tiles are skipped too
  };
  MaskTiles mask_tiles{};

  // Whether a map's entry skips a tile of rows [i0, i1) of head (b, h): excluded, or swamped where
  // every row sees an ordinary key (its log-sum-exp is then far above the tile's scores: P = 0).
  bool skips(uint8_t what, int64_t b, int64_t h, int64_t i0, int64_t i1) const {
    return what == kExcluded || (what == kSwamped && mask_tiles.ordinary.all(b, h, i0, i1));
  }

  // Two passes, query task: whether a mask excludes every pair of queries [i0, i0 + 48) and the
  // block of kBlock keys from j0.
  bool key_block_excluded(int64_t b, int64_t h, int64_t i0, int64_t j0) const {
    const int64_t blocks = (p.len_k + kBlock - 1) / kBlock, panels = (p.len_q + kPanel - 1) / kPanel;
    for (int t = 0; t < p.num_masks; ++t) {
      const int64_t slice = mask_slice(p.masks[t], p.heads_q, b, h);
      const int64_t i1 = std::min(p.len_q, i0 + kPanel);
      if (const uint8_t* keys = mask_tiles.excluded_key_blocks[t]) {
        if (skips(keys[slice * blocks + j0 / kBlock], b, h, i0, i1)) return true;
      } else if (const uint8_t* tiles = mask_tiles.queries_pass[t]) {
        if (skips(tiles[(slice * panels + i0 / kPanel) * blocks + j0 / kBlock], b, h, i0, i1)) return true;
      }
    }
    return false;
  }

  // Two passes, key task: whether a mask excludes every pair of queries [i0, i0 + ni) (any start:
  // causality moves it) and the key panel from j0; the map's query blocks of kBlock covering them
  // must all be excluded.
  bool query_rows_excluded(int64_t b, int64_t h, int64_t i0, int64_t ni, int64_t j0) const {
    const int64_t panels = (p.len_k + kPanel - 1) / kPanel, blocks = (p.len_q + kBlock - 1) / kBlock;
    for (int t = 0; t < p.num_masks; ++t) {
      const uint8_t* tiles = mask_tiles.keys_pass[t];
      if (tiles == nullptr) continue;
      const int64_t slice = mask_slice(p.masks[t], p.heads_q, b, h);
      bool all = true;
      for (int64_t qb = i0 / kBlock; qb <= (i0 + ni - 1) / kBlock && all; ++qb)
        all = skips(tiles[(slice * blocks + qb) * panels + j0 / kPanel], b, h, i0, i0 + ni);
      if (all) return true;
    }
    return false;
  }

  // One pass: whether a mask excludes the tile of key panel kb and query panel qb, for its rows
  // [i0, i1) (with a padding map, any rows: qb unread).
  bool tile_excluded(int64_t b, int64_t h, int64_t kb, int64_t qb, int64_t i0, int64_t i1) const {
    const int64_t nkb = (p.len_k + kPanel - 1) / kPanel, nqb = (p.len_q + kPanel - 1) / kPanel;
    for (int t = 0; t < p.num_masks; ++t) {
      const int64_t slice = mask_slice(p.masks[t], p.heads_q, b, h);
      if (const uint8_t* excluded = mask_tiles.excluded[t]) {
        if (skips(excluded[(slice * nqb + qb) * nkb + kb], b, h, i0, i1)) return true;
      } else if (const uint8_t* keys = mask_tiles.excluded_keys[t]) {
        if (skips(keys[slice * nkb + kb], b, h, i0, i1)) return true;
      }
    }
    return false;
  }

  // One allocation per task holding `floats` floats, 64-byte aligned, zeroed; given back on scope
  // exit. From the host block cache (core/host_memory.hpp): a group task's buffer is tens of MiB
  // at long sequences, and freed straight to malloc, blocks of that size were kept by glibc's
  // arenas instead of reused (an fp32 backward at B=1 H=16 L=16384 added 474 MiB to the peak
  // where its gradients are 192).
  struct Buffer {
    std::shared_ptr<std::byte> block;
    float* data;
    explicit Buffer(int64_t floats, bool zeroed = true) {
      const size_t bytes = static_cast<size_t>(T::round_up(floats * 4, 64));
      block = host_allocate(bytes);
      if (block == nullptr) throw std::bad_alloc();
      data = reinterpret_cast<float*>(block.get());
      if (zeroed) std::memset(data, 0, bytes);
    }
  };

  int64_t causal_limit(int64_t i) const {  // keys [0, limit) are visible to query i
    if (!p.causal) return p.len_k;
    return std::clamp<int64_t>(i + p.causal_offset + 1, 0, p.len_k);
  }
  // An operand the kernel reads by rows (q, k, v or the output's gradient): float32, bfloat16 or
  // float16, rows of unit stride.
  struct Operand {
    const void* data;
    DType dtype;
    const int64_t* strides;
    int64_t width;  // elements per row
  };
  Operand q_rows() const { return {p.q.data, p.q.dtype, p.q.strides.data(), p.dim_qk}; }
  Operand k_rows() const { return {p.k.data, p.k.dtype, p.k.strides.data(), p.dim_qk}; }
  Operand v_rows() const { return {p.v.data, p.v.dtype, p.v.strides.data(), p.dim_v}; }
  Operand grad_out_rows() const { return {in.grad_out, in.grad_out_dtype, in.grad_out_strides, p.dim_v}; }
  bool widens() const { return p.q.dtype != DType::f32; }  // q, k, v and dO share a dtype

  // float32 rows that are not packed (the heads of [B, L, H, D] storage, or of a packed QKV
  // projection) lie a row stride apart that is often a multiple of 4 KiB, so that a block of them
  // shares a few L1 sets and the products read it from L2 and beyond. Such rows are copied packed
  // as they are read, as low-precision rows are widened: B=4 H=16 d=64 with the 12 KiB rows of a
  // [B, L, 3E] projection ran 1.12-1.22x slower in place than on packed inputs at L=128 to 2048,
  // and 1.01-1.03x with the copies (only rows 3 KiB apart at B=1 H=4 L=128 lost 6%, of 0.5 ms).
  bool copies(const Operand& t) const { return t.dtype != DType::f32 || t.strides[2] != t.width; }
  bool copies_any() const { return copies(q_rows()) || copies(k_rows()) || copies(v_rows()) || copies(grad_out_rows()); }

  // Row l of head (b, h) of t in float32: the row itself, or its packed or widened copy in `slot`
  // (t.width floats).
  const float* row(const Operand& t, int64_t b, int64_t h, int64_t l, float* slot) const {
    const int64_t offset = b * t.strides[0] + h * t.strides[1] + l * t.strides[2];
    if (t.dtype != DType::f32) {
      T::widen(t.dtype, static_cast<const uint16_t*>(t.data) + offset, slot, t.width);
      return slot;
    }
    const float* r = static_cast<const float*>(t.data) + offset;
    if (!copies(t)) return r;
    std::memcpy(slot, r, sizeof(float) * t.width);
    return slot;
  }

  // Rows [0, count) of head (b, h) of t in float32, row l at base + l * stride: in place, or
  // widened into `buffer` (count x t.width floats).
  struct Rows {
    const float* base;
    int64_t stride;
    const float* at(int64_t l) const { return base + l * stride; }
  };
  Rows all_rows(const Operand& t, int64_t b, int64_t h, int64_t count, float* buffer) const {
    if (!copies(t)) return {static_cast<const float*>(t.data) + b * t.strides[0] + h * t.strides[1], t.strides[2]};
    for (int64_t l = 0; l < count; ++l) row(t, b, h, l, buffer + l * t.width);
    return {buffer, t.width};
  }
  int64_t row_index(int64_t b, int64_t h, int64_t i) const { return (b * p.heads_q + h) * p.len_q + i; }

  // One row of a gradient: dst[d * strides[3]] = scale * src[d * kPanel] for d < n, where dst is
  // row (b, h, l) of `base`, in the gradients' dtype (bfloat16 and float16 are rounded here, once).
  void store_grad_row(void* base, const int64_t* strides, int64_t b, int64_t h, int64_t l, const float* src,
                      int64_t n, float scale) const {
    const int64_t offset = b * strides[0] + h * strides[1] + l * strides[2], step = strides[3];
    with_output_elements(base, out.grad_dtype, offset, [&](auto* dst, auto round) {
      for (int64_t d = 0; d < n; ++d) dst[d * step] = round(src[d * kPanel] * scale);
    });
  }

  // Rows [l0, l0 + n) of a gradient (batch b, head h) from their transposed accumulator `acc`
  // ([width][48], row l0 + r in column r; scaled in place), times `scale`. float32 rows of unit
  // stride go through 8 x 8 register transposes: element by element, with reads 192 bytes apart,
  // the stores took 29% of a backward of one query per head (B=32 H=8 Lk=197 d=64). The same
  // products, so the same bits.
  void store_grad_rows(void* base, const int64_t* strides, int64_t b, int64_t h, int64_t l0, int64_t n, float* acc,
                       int64_t width, float scale) const {
    if constexpr (requires { S::store_16bit_rows; }) {
      // bfloat16 and float16 rows of unit stride: rounded as pairs of dims and transposed as 32-bit
      // words (the same product and rounding; element by element, the stores took 11% of a bf16
      // backward at L=128, B=32 H=12 d=64).
      if ((out.grad_dtype == DType::bf16 || out.grad_dtype == DType::f16) && strides[3] == 1) {
        alignas(64) float scales[kPanel];
        std::fill_n(scales, kPanel, scale);
        const int64_t offset = b * strides[0] + h * strides[1] + l0 * strides[2];
        S::store_16bit_rows(out.grad_dtype, acc, kPanel, scales, width, n, static_cast<uint16_t*>(base) + offset, strides[2]);
        return;
      }
    }
    if (out.grad_dtype != DType::f32 || strides[3] != 1) {
      for (int64_t r = 0; r < n; ++r) store_grad_row(base, strides, b, h, l0 + r, acc + r, width, scale);
      return;
    }
    if (scale != 1.0f) scale_panel(acc, width, n, scale);
    float* dst = static_cast<float*>(base) + b * strides[0] + h * strides[1] + l0 * strides[2];
    T::transpose_rect(acc, kPanel, dst, strides[2], width, n);
  }

  // panel[d * 48 + r] = scale * element d of row l0 + r of head (b, h) of t, for r < n: 8 x 8
  // register transposes where the rows are read in place, else row by row through `slot` (t.width
  // floats) as they are copied or widened. The same products either way.
  void transposed_panel(const Operand& t, int64_t b, int64_t h, int64_t l0, int64_t n, float* panel, float scale,
                        float* slot) const {
    if (!copies(t)) {
      const Rows rows = all_rows(t, b, h, 0, nullptr);
      T::transpose_rect(rows.at(l0), rows.stride, panel, kPanel, n, t.width);
      if (scale != 1.0f) scale_panel(panel, t.width, n, scale);
      return;
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* x = row(t, b, h, l0 + r, slot);
      for (int64_t d = 0; d < t.width; ++d) panel[d * kPanel + r] = x[d] * scale;
    }
  }

  // bfloat16 products (kPairs): row l of head (b, h) of t (bfloat16, unit stride, an even width) in
  // place, as pairs of dims.
  const uint32_t* in_place_pairs(const Operand& t, int64_t b, int64_t h, int64_t l) const {
    return reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(t.data) + b * t.strides[0] + h * t.strides[1] +
                                             l * t.strides[2]);
  }
  // Rows [l0, l0 + count) of head (b, h) of t as `pairs` pairs of rows: dst[r][d] = (row l0 + 2r,
  // row l0 + 2r + 1) at column d, rows `stride` words apart (t.width rounded up to whole vectors;
  // zeros past the width and past count).
  void pair_rows_of(const Operand& t, int64_t b, int64_t h, int64_t l0, int64_t count, int64_t pairs, uint32_t* dst,
                    int64_t stride) const {
    const auto* base = static_cast<const uint16_t*>(t.data) + b * t.strides[0] + h * t.strides[1] + l0 * t.strides[2];
    for (int64_t r = 0; r < pairs; ++r) {
      const uint16_t* x = 2 * r < count ? base + 2 * r * t.strides[2] : nullptr;
      const uint16_t* y = 2 * r + 1 < count ? base + (2 * r + 1) * t.strides[2] : nullptr;
      for (int64_t d = 0; d < stride; d += kLanes) S::store_w(dst + r * stride + d, S::interleave_rows(x, y, d, t.width));
    }
  }
  // Rows [l0, l0 + n) of head (b, h) of t as a [width / 2][48] panel of pairs of dims (row l0 + r
  // in column r; zero columns from n).
  void pairs_panel(const Operand& t, int64_t b, int64_t h, int64_t l0, int64_t n, uint32_t* panel) const {
    const auto* rows = static_cast<const uint16_t*>(t.data) + b * t.strides[0] + h * t.strides[1] + l0 * t.strides[2];
    S::transpose_pairs(rows, t.strides[2], n, t.width / 2, panel, kPanel);
  }
  // Rows [0, rows) (an even count) of a [rows][48] tile, over `vecs` vectors, rounded to bfloat16
  // as pairs of rows: dst[r / 2][lane] = (tile[r][lane], tile[r + 1][lane]).
  static void round_row_pairs(const float* tile, int64_t rows, int vecs, uint32_t* dst) {
    for (int64_t r = 0; r < rows; r += 2)
      for (int c = 0; c < vecs; ++c) {
        const float* x = tile + r * kPanel + c * kLanes;
        S::store_w(dst + r / 2 * kPanel + c * kLanes, S::pairs_of(S::load(x), S::load(x + kPanel)));
      }
  }

  // The first n columns (rounded up to whole vectors) of `rows` rows of a [rows][48] panel, times scale.
  static void scale_panel(float* panel, int64_t rows, int64_t n, float scale) {
    const F factor = S::set1(scale);
    const int vecs = T::vecs_for(n);
    for (int64_t d = 0; d < rows; ++d)
      for (int c = 0; c < vecs; ++c) S::store(panel + d * kPanel + c * kLanes, S::mul(S::load(panel + d * kPanel + c * kLanes), factor));
  }

  // The key index of every lane of a 48-key panel starting at j0.
  static void key_lanes(int64_t j0, U* jv) {
    for (int c = 0; c < kVecs; ++c) jv[c] = T::lane_indices(j0 + c * kLanes);
  }

  // Rows of queries i0.. against a 48-key panel starting at j0 (lanes jv), with base-2 scores in pt and
  // dPd = dO V^T in gt: pt becomes Pd = P Z / (1 - p) and gt becomes dS = P (dP - D), with
  // P = 2^(s - lse) where the key is visible and 0 elsewhere. Rows from `ni` to `rows` (padding)
  // become zero. Only the first `vecs` vectors of each row are read and written (a partly filled
  // key panel computes no more).
  void probabilities_and_score_gradients(float* pt, float* gt, int64_t rows, int64_t ni, int64_t b, int64_t h,
                                         int64_t i0, int64_t j0, const U* jv, int vecs) const {
    // A full panel (the usual case) runs with the vector count a constant, its loops unrolled.
    if (vecs == kVecs) probabilities_and_score_gradients_of<kVecs>(pt, gt, rows, ni, b, h, i0, j0, jv, kVecs);
    else probabilities_and_score_gradients_of<0>(pt, gt, rows, ni, b, h, i0, j0, jv, vecs);
  }
  template <int kFixedVecs>
  void probabilities_and_score_gradients_of(float* pt, float* gt, int64_t rows, int64_t ni, int64_t b, int64_t h,
                                            int64_t i0, int64_t j0, const U* jv, int vecs_at_run_time) const {
    const int vecs = kFixedVecs > 0 ? kFixedVecs : vecs_at_run_time;
    const bool dropout = p.dropout_p > 0;
    const U threshold = S::set1_u(dropout_threshold(p.dropout_p));
    const F keep_scale = S::set1(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    const F zero = S::zero();
    for (int64_t ii = 0; ii < rows; ++ii) {
      float* prow = pt + ii * kPanel;
      float* grow = gt + ii * kPanel;
      if (ii >= ni) {
        for (int c = 0; c < vecs; ++c) S::store(prow + c * kLanes, zero), S::store(grow + c * kLanes, zero);
        continue;
      }
      const int64_t i = i0 + ii;
      const int64_t r = row_index(b, h, i);
      const F lse2 = S::set1(in.lse2[r]);
      const F delta = S::set1(in.delta[r]);
      const float p_scale = in.p_scale[r];  // 1 but in rows of mask values alone (backward_rows.hpp)
      const int64_t row_limit = causal_limit(i);
      const int64_t row_begin = std::min(p.window_begin(i), row_limit);  // (a sliding window's first key)
      const U limit = S::set1_u(static_cast<uint32_t>(row_limit));
      const U begin = S::set1_u(static_cast<uint32_t>(row_begin));
      const bool all_visible = row_limit >= j0 + kPanel && row_begin <= j0;  // the usual case: no lane to zero
      U key_lo = S::set1_u(0), key_hi = S::set1_u(0);
      if (dropout) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>(r));
        key_lo = S::set1_u(key.lo);
        key_hi = S::set1_u(key.hi);
      }
      for (int c = 0; c < vecs; ++c) {
        F pr = S::exp2(S::sub(S::load(prow + c * kLanes), lse2));
        if (p_scale != 1.0f) pr = S::mul(pr, S::set1(p_scale));
        if (!all_visible) {
          pr = S::select(S::lt_i(jv[c], limit), pr, zero);  // causality, keys past Lk
          if (row_begin > j0) pr = S::select(S::lt_i(jv[c], begin), zero, pr);  // before the window
        }
        F dp = S::load(grow + c * kLanes);
        F pd = pr;
        if (dropout) {
          const M keep = S::ge_u(T::dropout_bits(jv[c], key_lo, key_hi), threshold);
          pd = S::select(keep, S::mul(pr, keep_scale), zero);
          dp = S::select(keep, S::mul(dp, keep_scale), zero);
        }
        S::store(prow + c * kLanes, pd);
        S::store(grow + c * kLanes, S::mul(pr, S::sub(dp, delta)));
      }
    }
  }

  // Pass A: dK and dV of keys [j0, j0 + 48) of key/value head hk.
  void keys_task(int64_t b, int64_t hk, int64_t j0) const {
    const int64_t nk = std::min<int64_t>(kPanel, p.len_k - j0);
    const int64_t dk = p.dim_qk, dv = p.dim_v;
    const float qk_scale = static_cast<float>(p.scale) * kLog2e;
    const int64_t slots = copies_any() ? kBlock * (dk + dv) : 0;
    const Softcap<S> cap(p);
    // bfloat16 products: Q and dO of a query block as pairs of rows, Pd and dS as pairs of rows.
    const int64_t dk16 = T::round_up(dk, kLanes), dv16 = T::round_up(dv, kLanes);
    const int64_t pair_words = kPairs ? kBlock / 2 * (dk16 + dv16 + 2 * kPanel) : 0;
    Buffer buf((2 * dk + 2 * dv + 2 * kBlock) * kPanel + std::max(dk, dv) + kLanes + slots + (cap.on ? kBlock * kPanel : 0) +
               pair_words);
    float* kt = buf.data;           // [Dk][48] K^T, scaled by scale * log2(e)
    float* vt = kt + dk * kPanel;   // [Dv][48] V^T
    float* dkt = vt + dv * kPanel;  // [Dk][48] dK^T accumulator
    float* dvt = dkt + dk * kPanel; // [Dv][48] dV^T accumulator
    float* pt = dvt + dv * kPanel;  // [kBlock][48] P, then Pd
    float* gt = pt + kBlock * kPanel;  // [kBlock][48] dPd, then dS
    const float* zero_row = gt + kBlock * kPanel;
    float* q_slots = gt + kBlock * kPanel + std::max(dk, dv) + kLanes;  // [kBlock][Dk] widened rows
    float* g_slots = q_slots + kBlock * dk;                             // [kBlock][Dv]
    float* slopes = q_slots + slots;  // [kBlock][48] the soft-cap's derivatives
    auto* q_pairs = reinterpret_cast<uint32_t*>(slopes + (cap.on ? kBlock * kPanel : 0));  // [32][dk16]
    uint32_t* g_pairs = q_pairs + kBlock / 2 * dk16;  // [32][dv16]
    uint32_t* pd_w = g_pairs + kBlock / 2 * dv16;     // [32][48]
    uint32_t* ds_w = pd_w + kBlock / 2 * kPanel;      // [32][48]
    const uint32_t* qw[kBlock];
    const uint32_t* gw[kBlock];
    const uint32_t* q_pair_rows[kBlock / 2];
    const uint32_t* g_pair_rows[kBlock / 2];
    if constexpr (kPairs) {  // K^T and V^T as pairs of dims, unscaled
      pairs_panel(k_rows(), b, hk, j0, nk, reinterpret_cast<uint32_t*>(kt));
      pairs_panel(v_rows(), b, hk, j0, nk, reinterpret_cast<uint32_t*>(vt));
      for (int64_t r = 0; r < kBlock / 2; ++r) q_pair_rows[r] = q_pairs + r * dk16, g_pair_rows[r] = g_pairs + r * dv16;
    } else {
      transposed_panel(k_rows(), b, hk, j0, nk, kt, qk_scale, q_slots);  // (the slots are free until the query loop)
      transposed_panel(v_rows(), b, hk, j0, nk, vt, 1.0f, g_slots);
    }
    U jv[kVecs];
    key_lanes(j0, jv);
    const int vecs = T::vecs_for(nk);  // the last block of a short sequence skips its empty vectors
    const float* qrows[kBlock];
    const float* grows[kBlock];

    // The first query that sees any key of the block, and the first past those whose sliding
    // windows reach it; the others are skipped, not masked.
    int64_t i_start = 0, i_end = p.len_q;
    if (p.causal) i_start = std::clamp<int64_t>(j0 - p.causal_offset, 0, p.len_q);
    if (p.windowed) i_end = std::clamp<int64_t>(j0 + nk - p.window_offset, 0, p.len_q);
    // bfloat16 products sum the queries in pairs (2r, 2r + 1) whatever the first one seen: a
    // window's right edge (a moved diagonal) and the same band as a mask give the same bits.
    if constexpr (kPairs) i_start -= i_start % 2;
    const int64_t group = p.heads_q / p.heads_kv;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      if (tile_excluded(b, h, j0 / kPanel, 0, 0, p.len_q)) continue;  // a padding mask excludes every key of the panel
      for (int64_t i0 = i_start; i0 < i_end; i0 += kBlock) {
        const int64_t ni = std::min<int64_t>(kBlock, i_end - i0);
        if (query_rows_excluded(b, h, i0, ni, j0)) continue;  // P = 0, dS = 0: it adds nothing
        const int64_t nip = T::round_up(ni, kRows);
        if constexpr (kPairs) {
          const auto* zero = reinterpret_cast<const uint32_t*>(zero_row);
          for (int64_t ii = 0; ii < nip; ++ii) {
            qw[ii] = ii < ni ? in_place_pairs(q_rows(), b, h, i0 + ii) : zero;
            gw[ii] = ii < ni ? in_place_pairs(grad_out_rows(), b, h, i0 + ii) : zero;
          }
          for (int64_t ii = 0; ii < nip; ii += kRows) {
            T::dot_pairs(pt + ii * kPanel, qw + ii, reinterpret_cast<const uint32_t*>(kt), dk / 2, vecs, S::set1(qk_scale));
            T::dot_pairs(gt + ii * kPanel, gw + ii, reinterpret_cast<const uint32_t*>(vt), dv / 2, vecs, S::set1(1.0f));
          }
        } else {
          for (int64_t ii = 0; ii < nip; ++ii) {
            qrows[ii] = ii < ni ? row(q_rows(), b, h, i0 + ii, q_slots + ii * dk) : zero_row;
            grows[ii] = ii < ni ? row(grad_out_rows(), b, h, i0 + ii, g_slots + ii * dv) : zero_row;
          }
          for (int64_t ii = 0; ii < nip; ii += kRows) {
            T::dot_rows_call(pt + ii * kPanel, qrows + ii, kt, dk, vecs);  // scores, base 2
            T::dot_rows_call(gt + ii * kPanel, grows + ii, vt, dv, vecs);  // dPd = dO V^T
          }
        }
        if (cap.on) cap.rows(pt, ni, kPanel, vecs, slopes);
        for (int t = 0; t < p.num_masks; ++t) T::add_mask(p.masks[t], pt, kPanel, 1, b, h, i0, ni, j0, nk);
        probabilities_and_score_gradients(pt, gt, nip, ni, b, h, i0, j0, jv, vecs);
        if (cap.on) Softcap<S>::chain(gt, slopes, ni, kPanel, vecs);
        if constexpr (kPairs) {  // the block's rows as pairs; rows past ni are zero in Pd and dS
          if (out.dv) {
            pair_rows_of(grad_out_rows(), b, h, i0, ni, nip / 2, g_pairs, dv16);
            round_row_pairs(pt, nip, vecs, pd_w);
            T::accumulate(dvt, g_pair_rows, pd_w, nip / 2, dv, vecs);  // dV^T += dO^T Pd
          }
          if (out.dk) {
            pair_rows_of(q_rows(), b, h, i0, ni, nip / 2, q_pairs, dk16);
            round_row_pairs(gt, nip, vecs, ds_w);
            T::accumulate(dkt, q_pair_rows, ds_w, nip / 2, dk, vecs);  // dK^T += Q^T dS
          }
          continue;
        }
        if (out.dv) T::accumulate_call(dvt, grows, pt, ni, dv, vecs);  // dV^T += dO^T Pd
        if (out.dk) T::accumulate_call(dkt, qrows, gt, ni, dk, vecs);  // dK^T += Q^T dS
      }
    }
    if (out.dk) store_grad_rows(out.dk, out.dk_strides, b, hk, j0, nk, dkt, dk, static_cast<float>(p.scale));
    if (out.dv) store_grad_rows(out.dv, out.dv_strides, b, hk, j0, nk, dvt, dv, 1.0f);
  }

  // Pass B: dQ (and dS, when asked) of queries [i0, i0 + 48) of query head h.
  void queries_task(int64_t b, int64_t h, int64_t i0) const {
    const int64_t ni = std::min<int64_t>(kPanel, p.len_q - i0);
    const int64_t dk = p.dim_qk, dv = p.dim_v;
    const int64_t hk = h / (p.heads_q / p.heads_kv);
    const float qk_scale = static_cast<float>(p.scale) * kLog2e;
    const int64_t slots = copies_any() ? kBlock * (dk + dv) : 0;
    const Softcap<S> cap(p);
    // bfloat16 products: K of a key block as pairs of rows, dS^T as pairs of rows.
    const int64_t dk16 = T::round_up(dk, kLanes);
    const int64_t pair_words = kPairs ? kBlock / 2 * (dk16 + kPanel) : 0;
    Buffer buf((2 * dk + dv + 2 * kBlock + 7) * kPanel + std::max(dk, dv) + kLanes + slots + (cap.on ? kBlock * kPanel : 0) +
               pair_words);
    float* qt = buf.data;            // [Dk][48] Q^T, scaled
    float* got = qt + dk * kPanel;   // [Dv][48] dO^T
    float* dqt = got + dv * kPanel;  // [Dk][48] dQ^T accumulator
    float* st = dqt + dk * kPanel;   // [kBlock][48] scores, then dS
    float* gt = st + kBlock * kPanel;  // [kBlock][48] dPd
    float* lse2 = gt + kBlock * kPanel;
    float* p_scale = lse2 + kPanel;
    float* delta = p_scale + kPanel;
    uint32_t* limit = reinterpret_cast<uint32_t*>(delta + kPanel);
    uint32_t* key_lo = limit + kPanel;
    uint32_t* key_hi = key_lo + kPanel;
    uint32_t* begin = key_hi + kPanel;  // a sliding window's first key
    const float* zero_row = reinterpret_cast<const float*>(begin + kPanel);
    float* k_slots = reinterpret_cast<float*>(begin + kPanel) + std::max(dk, dv) + kLanes;  // [kBlock][Dk]
    float* v_slots = k_slots + kBlock * dk;                                                  // [kBlock][Dv]
    float* slopes = k_slots + slots;  // [kBlock][48] the soft-cap's derivatives
    auto* k_pairs = reinterpret_cast<uint32_t*>(slopes + (cap.on ? kBlock * kPanel : 0));  // [32][dk16]
    uint32_t* dst_w = k_pairs + kBlock / 2 * dk16;  // [32][48]
    const uint32_t* kw[kBlock];
    const uint32_t* vw[kBlock];
    const uint32_t* k_pair_rows[kBlock / 2];
    if constexpr (kPairs) {  // Q^T and dO^T as pairs of dims, unscaled
      pairs_panel(q_rows(), b, h, i0, ni, reinterpret_cast<uint32_t*>(qt));
      pairs_panel(grad_out_rows(), b, h, i0, ni, reinterpret_cast<uint32_t*>(got));
      for (int64_t r = 0; r < kBlock / 2; ++r) k_pair_rows[r] = k_pairs + r * dk16;
    } else {
      transposed_panel(q_rows(), b, h, i0, ni, qt, qk_scale, k_slots);  // (the slots are free until the key loop)
      transposed_panel(grad_out_rows(), b, h, i0, ni, got, 1.0f, v_slots);
    }
    bool rescaled = false;  // a row of mask values alone (backward_rows.hpp)
    for (int64_t ii = 0; ii < kPanel; ++ii) {
      const int64_t i = i0 + ii;
      const bool real = ii < ni;
      const int64_t r = row_index(b, h, real ? i : i0);
      lse2[ii] = real ? in.lse2[r] : std::numeric_limits<float>::infinity();
      p_scale[ii] = real ? in.p_scale[r] : 1.0f;
      rescaled = rescaled || p_scale[ii] != 1.0f;
      delta[ii] = real ? in.delta[r] : 0.0f;
      limit[ii] = static_cast<uint32_t>(real ? causal_limit(i) : 0);
      begin[ii] = static_cast<uint32_t>(real ? std::min(p.window_begin(i), causal_limit(i)) : 0);
      if (p.dropout_p > 0 && real) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>(r));
        key_lo[ii] = key.lo;
        key_hi[ii] = key.hi;
      }
    }
    const bool dropout = p.dropout_p > 0;
    const U threshold = S::set1_u(dropout_threshold(p.dropout_p));
    const F keep_scale = S::set1(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    const F zero = S::zero();
    const float* krows[kBlock];
    const float* vrows[kBlock];
    const int vecs = T::vecs_for(ni);  // the last block of a short sequence skips its empty vectors
    const int64_t key_end = limit[ni - 1];  // limits grow with the query: later keys are unseen
    // A sliding window's first keys grow too: blocks before the first row's are skipped, those
    // before the last row's masked.
    const int64_t key_begin = std::min<int64_t>(begin[0], key_end) / kBlock * kBlock, masked_before = begin[ni - 1];
    if (out.dscores) {  // keys before every row's window
      for (int64_t ii = 0; ii < ni; ++ii) {
        float* dsr = out.dscores + b * out.dscores_strides[0] + h * out.dscores_strides[1] +
                     (i0 + ii) * out.dscores_strides[2];
        for (int64_t j = 0; j < key_begin; ++j) dsr[j * out.dscores_strides[3]] = 0.0f;
      }
    }
    for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlock) {
      const int64_t nj = std::min<int64_t>(kBlock, key_end - j0);
      if (key_block_excluded(b, h, i0, j0)) {  // a mask excludes every pair of the tile: dS = 0
        if (out.dscores) {
          for (int64_t ii = 0; ii < ni; ++ii) {
            float* dsr = out.dscores + b * out.dscores_strides[0] + h * out.dscores_strides[1] +
                         (i0 + ii) * out.dscores_strides[2];
            for (int64_t jj = 0; jj < nj; ++jj) dsr[(j0 + jj) * out.dscores_strides[3]] = 0.0f;
          }
        }
        continue;
      }
      const int64_t njp = T::round_up(nj, kRows);
      if constexpr (kPairs) {
        const auto* zero = reinterpret_cast<const uint32_t*>(zero_row);
        for (int64_t jj = 0; jj < njp; ++jj) {
          const bool real = j0 + jj < p.len_k;
          kw[jj] = real ? in_place_pairs(k_rows(), b, hk, j0 + jj) : zero;
          vw[jj] = real ? in_place_pairs(v_rows(), b, hk, j0 + jj) : zero;
        }
        for (int64_t jj = 0; jj < njp; jj += kRows) {
          T::dot_pairs(st + jj * kPanel, kw + jj, reinterpret_cast<const uint32_t*>(qt), dk / 2, vecs, S::set1(qk_scale));
          T::dot_pairs(gt + jj * kPanel, vw + jj, reinterpret_cast<const uint32_t*>(got), dv / 2, vecs, S::set1(1.0f));
        }
      } else {
        for (int64_t jj = 0; jj < njp; ++jj) {
          const bool real = j0 + jj < p.len_k;
          krows[jj] = real ? row(k_rows(), b, hk, j0 + jj, k_slots + jj * dk) : zero_row;
          vrows[jj] = real ? row(v_rows(), b, hk, j0 + jj, v_slots + jj * dv) : zero_row;
        }
        for (int64_t jj = 0; jj < njp; jj += kRows) {
          T::dot_rows_call(st + jj * kPanel, krows + jj, qt, dk, vecs);
          T::dot_rows_call(gt + jj * kPanel, vrows + jj, got, dv, vecs);
        }
      }
      if (cap.on) cap.rows(st, nj, kPanel, vecs, slopes);
      for (int t = 0; t < p.num_masks; ++t) T::add_mask(p.masks[t], st, 1, kPanel, b, h, i0, ni, j0, nj);
      for (int c = 0; c < vecs; ++c) {
        const F l2 = S::load(lse2 + c * kLanes);
        const F sc = S::load(p_scale + c * kLanes);
        const F dl = S::load(delta + c * kLanes);
        const U lim = S::load_u(limit + c * kLanes), first = S::load_u(begin + c * kLanes);
        const U lo = S::load_u(key_lo + c * kLanes), hi = S::load_u(key_hi + c * kLanes);
        for (int64_t jj = 0; jj < njp; ++jj) {
          float* srow = st + jj * kPanel + c * kLanes;
          const U j = S::set1_u(static_cast<uint32_t>(j0 + jj));
          const M visible = S::lt_i(j, lim);
          F pr = S::select(visible, S::exp2(S::sub(S::load(srow), l2)), zero);
          if (j0 + jj < masked_before) pr = S::select(S::lt_i(j, first), zero, pr);  // before the window
          if (rescaled) pr = S::mul(pr, sc);
          F dp = S::load(gt + jj * kPanel + c * kLanes);
          if (dropout) dp = S::select(S::ge_u(T::dropout_bits(j, lo, hi), threshold), S::mul(dp, keep_scale), zero);
          S::store(srow, S::mul(pr, S::sub(dp, dl)));  // dS
        }
      }
      if (out.dscores) {
        for (int64_t ii = 0; ii < ni; ++ii) {
          float* dsr = out.dscores + b * out.dscores_strides[0] + h * out.dscores_strides[1] +
                       (i0 + ii) * out.dscores_strides[2];
          for (int64_t jj = 0; jj < nj; ++jj) dsr[(j0 + jj) * out.dscores_strides[3]] = st[jj * kPanel + ii];
        }
      }
      if (cap.on) Softcap<S>::chain(st, slopes, nj, kPanel, vecs);  // q.k's share of dS, through the cap
      if constexpr (kPairs) {  // keys past the block's end (or Lk) have dS = 0: not visible
        if (out.dq) {
          pair_rows_of(k_rows(), b, hk, j0, std::min<int64_t>(njp, p.len_k - j0), njp / 2, k_pairs, dk16);
          round_row_pairs(st, njp, vecs, dst_w);
          T::accumulate(dqt, k_pair_rows, dst_w, njp / 2, dk, vecs);  // dQ^T += K^T dS^T
        }
        continue;
      }
      if (out.dq) T::accumulate_call(dqt, krows, st, nj, dk, vecs);  // dQ^T += K^T dS^T
    }
    if (out.dscores) {  // keys no query of the task sees
      for (int64_t ii = 0; ii < ni; ++ii) {
        float* dsr = out.dscores + b * out.dscores_strides[0] + h * out.dscores_strides[1] +
                     (i0 + ii) * out.dscores_strides[2];
        for (int64_t j = key_end; j < p.len_k; ++j) dsr[j * out.dscores_strides[3]] = 0.0f;
      }
    }
    if (out.dq) store_grad_rows(out.dq, out.dq_strides, b, h, i0, ni, dqt, dk, static_cast<float>(p.scale));
  }

  // dS of queries [i0, i0 + ni) and keys [j0, j0 + nk) of head (b, h) into out.dscores, from a
  // [query][key] tile (row stride 48), or zeros where `tile` is null (pairs no product reaches).
  void store_dscores(int64_t b, int64_t h, int64_t i0, int64_t ni, int64_t j0, int64_t nk, const float* tile) const {
    const int64_t sj = out.dscores_strides[3];
    for (int64_t ii = 0; ii < ni; ++ii) {
      float* dst = out.dscores + b * out.dscores_strides[0] + h * out.dscores_strides[1] +
                   (i0 + ii) * out.dscores_strides[2] + j0 * sj;
      if (tile == nullptr) for (int64_t jj = 0; jj < nk; ++jj) dst[jj * sj] = 0.0f;
      else if (sj == 1) std::memcpy(dst, tile + ii * kPanel, sizeof(float) * nk);
      else for (int64_t jj = 0; jj < nk; ++jj) dst[jj * sj] = tile[ii * kPanel + jj];
    }
  }

  // One pass for a whole key/value head group (used when there are enough groups to keep every
  // thread busy): each (query block, key block) pair is visited once, 5 matrix products instead of
  // the two passes' 7. dQ accumulates per 48-query block, transposed, from dS^T; dK and dV per
  // 48-key block. Extra memory is O(L d) per task.
  void group_task(int64_t b, int64_t hk, RowPrefetch& ahead) const {
    const int64_t dk = p.dim_qk, dv = p.dim_v;
    const int64_t nkb = (p.len_k + kPanel - 1) / kPanel, nqb = (p.len_q + kPanel - 1) / kPanel;
    const float qk_scale = static_cast<float>(p.scale) * kLog2e;
    const int64_t panel_k = dk * kPanel, panel_v = dv * kPanel;
    // Widened rows: K of the group, Q and dO of one head. With bfloat16 products, in their place:
    // K of the group, Q and dO of one head as pairs of rows (round_up(L, 48) / 2 rows of whole
    // vectors), and the three tiles rounded as pairs of rows.
    const int64_t dk16 = T::round_up(dk, kLanes), dv16 = T::round_up(dv, kLanes);
    const int64_t widened = kPairs ? nkb * kPanel / 2 * dk16 + nqb * kPanel / 2 * (dk16 + dv16) + 3 * kPanel * kPanel / 2
                            : copies_any() ? p.len_k * dk + p.len_q * (dk + dv) : 0;
    const Softcap<S> cap(p);
    // (With bfloat16 products, the panels of K and V and the pairs of rows are written whole
    // before they are read, and dQ^T is cleared per head: the rest is cleared below. Clearing the
    // whole buffer took 4% of a bf16 backward at L=128, B=32 H=12 d=64.)
    Buffer buf(nkb * 2 * (panel_k + panel_v) + nqb * panel_k + 3 * kPanel * kPanel + std::max(dk, dv) + kLanes +
               widened + (cap.on ? kPanel * kPanel : 0), !kPairs);
    float* kt_all = buf.data;                  // [nkb][Dk][48] K^T, scaled
    float* vt_all = kt_all + nkb * panel_k;    // [nkb][Dv][48] V^T
    float* dkt_all = vt_all + nkb * panel_v;   // [nkb][Dk][48] dK^T accumulators
    float* dvt_all = dkt_all + nkb * panel_k;  // [nkb][Dv][48] dV^T accumulators
    float* dqt_all = dvt_all + nkb * panel_v;  // [nqb][Dk][48] dQ^T accumulators of one head
    float* pt = dqt_all + nqb * panel_k;       // [48 queries][48 keys] P, then Pd
    float* gt = pt + kPanel * kPanel;          // [48 queries][48 keys] dPd, then dS
    float* st = gt + kPanel * kPanel;          // [48 keys][48 queries] dS^T
    const float* zero_row = st + kPanel * kPanel;
    float* k_widened = st + kPanel * kPanel + std::max(dk, dv) + kLanes;  // [Lk][Dk]
    float* q_widened = k_widened + p.len_k * dk;                         // [Lq][Dk]
    float* g_widened = q_widened + p.len_q * dk;                         // [Lq][Dv]
    float* slopes = k_widened + widened;  // [48 queries][48 keys] the soft-cap's derivatives
    // bfloat16 products: pairs of rows in k_widened's place (see `widened`), rows per pair a vector multiple wide.
    auto* k_pairs = reinterpret_cast<uint32_t*>(k_widened);  // [nkb * 24][dk16] K, pairs of keys
    uint32_t* q_pairs = k_pairs + nkb * kPanel / 2 * dk16;   // [nqb * 24][dk16] Q of one head, pairs of queries
    uint32_t* g_pairs = q_pairs + nqb * kPanel / 2 * dk16;   // [nqb * 24][dv16] dO of one head, likewise
    uint32_t* pd_w = g_pairs + nqb * kPanel / 2 * dv16;      // [24 query pairs][48 keys] Pd
    uint32_t* ds_w = pd_w + kPanel * kPanel / 2;             // [24 query pairs][48 keys] dS
    uint32_t* dst_w = ds_w + kPanel * kPanel / 2;            // [24 key pairs][48 queries] dS^T
    if constexpr (kPairs) {
      std::fill(dkt_all, dqt_all, 0.0f);                                            // dK^T, dV^T
      std::fill(pt, k_widened, 0.0f);                                               // tiles, zero row
      std::fill(reinterpret_cast<float*>(pd_w), slopes + (cap.on ? kPanel * kPanel : 0), 0.0f);  // pair tiles, slopes
    }
    const uint32_t* qw[kPanel];      // Q and dO rows in place, as pairs of dims
    const uint32_t* gw[kPanel];
    const uint32_t* q_pair_rows[kPanel / 2];
    const uint32_t* g_pair_rows[kPanel / 2];
    const uint32_t* k_pair_rows[kPanel / 2];
    // K^T (scaled) and V^T, a 48-key panel at a time, transposed 8 x 8 in registers where the rows
    // are in place (V's copied rows one at a time through g_widened, free until the first head).
    // bfloat16 products: K^T and V^T as pairs of dims (unscaled), and K as pairs of keys.
    Rows keys{};
    if constexpr (kPairs) {
      pair_rows_of(k_rows(), b, hk, 0, p.len_k, nkb * kPanel / 2, k_pairs, dk16);
    } else {
      keys = all_rows(k_rows(), b, hk, p.len_k, k_widened);
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t j0 = kb * kPanel, nk = std::min<int64_t>(kPanel, p.len_k - j0);
      if constexpr (kPairs) {
        pairs_panel(k_rows(), b, hk, j0, nk, reinterpret_cast<uint32_t*>(kt_all + kb * panel_k));
        pairs_panel(v_rows(), b, hk, j0, nk, reinterpret_cast<uint32_t*>(vt_all + kb * panel_v));
        continue;
      }
      T::transpose_rect(keys.at(j0), keys.stride, kt_all + kb * panel_k, kPanel, nk, dk);
      scale_panel(kt_all + kb * panel_k, dk, nk, qk_scale);
      transposed_panel(v_rows(), b, hk, j0, nk, vt_all + kb * panel_v, 1.0f, g_widened);
    }
    const float* qrows[kPanel];
    const float* grows[kPanel];
    const float* krows[kPanel];
    const int64_t group = p.heads_q / p.heads_kv;
    // The next group's prefetches are spread over the tiles' dot steps (at most this many), a
    // share after each: issued once per tile, a BERT-sized group's shares came in bursts of
    // hundreds of lines that stalled the core (10% of an fp32 backward).
    int64_t steps_left = group * nkb * nqb * (kPanel / kRows) * 2;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      std::memset(dqt_all, 0, sizeof(float) * nqb * panel_k);
      Rows queries{}, grads{};
      if constexpr (kPairs) {
        pair_rows_of(q_rows(), b, h, 0, p.len_q, nqb * kPanel / 2, q_pairs, dk16);
        pair_rows_of(grad_out_rows(), b, h, 0, p.len_q, nqb * kPanel / 2, g_pairs, dv16);
      } else {
        queries = all_rows(q_rows(), b, h, p.len_q, q_widened);
        grads = all_rows(grad_out_rows(), b, h, p.len_q, g_widened);
      }
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t j0 = kb * kPanel, nk = std::min<int64_t>(kPanel, p.len_k - j0);
        if constexpr (kPairs) {
          for (int64_t jj = 0; jj < kPanel / 2; ++jj) k_pair_rows[jj] = k_pairs + (j0 / 2 + jj) * dk16;
        } else {
          for (int64_t jj = 0; jj < kPanel; ++jj) krows[jj] = jj < nk ? keys.at(j0 + jj) : zero_row;
        }
        U jv[kVecs];
        key_lanes(j0, jv);
        const int key_vecs = T::vecs_for(nk);  // a partly filled block (the last) skips its empty
                                               // vectors, and a partly filled query panel its rows
        int64_t i_start = 0, i_end = p.len_q;  // queries before and past them see no key of the block: skipped
        if (p.causal) i_start = std::clamp<int64_t>(j0 - p.causal_offset, 0, p.len_q) / kPanel * kPanel;
        if (p.windowed) i_end = T::round_up(std::clamp<int64_t>(j0 + nk - p.window_offset, 0, p.len_q), kPanel);
        i_end = std::max(std::min(i_end, p.len_q), i_start);
        for (int64_t i0 = 0; out.dscores && i0 < i_start; i0 += kPanel) store_dscores(b, h, i0, kPanel, j0, nk, nullptr);
        for (int64_t i0 = i_end; out.dscores && i0 < p.len_q; i0 += kPanel) {
          store_dscores(b, h, i0, std::min<int64_t>(kPanel, p.len_q - i0), j0, nk, nullptr);
        }
        for (int64_t i0 = i_start; i0 < i_end; i0 += kPanel) {
          const int64_t ni = std::min<int64_t>(kPanel, p.len_q - i0);
          if (tile_excluded(b, h, kb, i0 / kPanel, i0, i0 + ni)) {  // P = 0, dS = 0
            if (out.dscores) store_dscores(b, h, i0, ni, j0, nk, nullptr);
            continue;
          }
          const int64_t nip = T::round_up(ni, kRows);
          const int query_vecs = T::vecs_for(ni);
          if constexpr (kPairs) {
            const auto* zero = reinterpret_cast<const uint32_t*>(zero_row);
            for (int64_t ii = 0; ii < nip; ++ii) {
              qw[ii] = ii < ni ? in_place_pairs(q_rows(), b, h, i0 + ii) : zero;
              gw[ii] = ii < ni ? in_place_pairs(grad_out_rows(), b, h, i0 + ii) : zero;
            }
            for (int64_t ii = 0; ii < kPanel / 2; ++ii) {
              q_pair_rows[ii] = q_pairs + (i0 / 2 + ii) * dk16;
              g_pair_rows[ii] = g_pairs + (i0 / 2 + ii) * dv16;
            }
            for (int64_t ii = 0; ii < nip; ii += kRows) {
              T::dot_pairs(pt + ii * kPanel, qw + ii, reinterpret_cast<const uint32_t*>(kt_all + kb * panel_k), dk / 2,
                           key_vecs, S::set1(qk_scale));
              ahead.issue(ahead.share(steps_left--));
              T::dot_pairs(gt + ii * kPanel, gw + ii, reinterpret_cast<const uint32_t*>(vt_all + kb * panel_v), dv / 2,
                           key_vecs, S::set1(1.0f));
              ahead.issue(ahead.share(steps_left--));
            }
          } else {
            for (int64_t ii = 0; ii < nip; ++ii) {
              qrows[ii] = ii < ni ? queries.at(i0 + ii) : zero_row;
              grows[ii] = ii < ni ? grads.at(i0 + ii) : zero_row;
            }
            for (int64_t ii = 0; ii < nip; ii += kRows) {
              T::dot_rows_call(pt + ii * kPanel, qrows + ii, kt_all + kb * panel_k, dk, key_vecs);
              ahead.issue(ahead.share(steps_left--));
              T::dot_rows_call(gt + ii * kPanel, grows + ii, vt_all + kb * panel_v, dv, key_vecs);
              ahead.issue(ahead.share(steps_left--));
            }
          }
          if (cap.on) cap.rows(pt, ni, kPanel, key_vecs, slopes);
          for (int t = 0; t < p.num_masks; ++t) {
            if (const float* tile = mask_tiles.data[t]) {  // the tile's own copy, in consecutive memory
              tile += (mask_slice(p.masks[t], p.heads_q, b, h) * nkb * nqb + kb * nqb + i0 / kPanel) * kPanel * kPanel;
              for (int64_t ii = 0; ii < ni; ++ii)
                for (int c = 0; c < key_vecs; ++c) {
                  float* at = pt + ii * kPanel + c * kLanes;
                  S::store(at, S::add(S::load(at), S::load(tile + ii * kPanel + c * kLanes)));
                }
            } else {
              T::add_mask(p.masks[t], pt, kPanel, 1, b, h, i0, ni, j0, nk);
            }
          }
          // Every row past ni is zeroed (over key_vecs), so the transpose below holds no stale dS.
          probabilities_and_score_gradients(pt, gt, kPanel, ni, b, h, i0, j0, jv, key_vecs);
          if (out.dscores) store_dscores(b, h, i0, ni, j0, nk, gt);
          if (cap.on) Softcap<S>::chain(gt, slopes, ni, kPanel, key_vecs);  // q.k's share of dS, through the cap
          if constexpr (kPairs) {
            // Rows past ni are zero (above), so are the pairs they complete.
            if (out.dv) {
              round_row_pairs(pt, nip, key_vecs, pd_w);
              T::accumulate(dvt_all + kb * panel_v, g_pair_rows, pd_w, nip / 2, dv, key_vecs);  // dV^T += dO^T Pd
            }
            if (out.dk) {
              round_row_pairs(gt, nip, key_vecs, ds_w);
              T::accumulate(dkt_all + kb * panel_k, q_pair_rows, ds_w, nip / 2, dk, key_vecs);  // dK^T += Q^T dS
            }
            if (out.dq) {
              // dS^T's rows past nk are keys past Lk, zero in dS (a key block is short only at the end).
              T::transpose_panel(gt, st);
              const int64_t nkp = T::round_up(nk, 2);
              round_row_pairs(st, nkp, query_vecs, dst_w);
              T::accumulate(dqt_all + (i0 / kPanel) * panel_k, k_pair_rows, dst_w, nkp / 2, dk, query_vecs);
            }
            continue;
          }
          if (out.dv) T::accumulate_call(dvt_all + kb * panel_v, grows, pt, ni, dv, key_vecs);  // dV^T += dO^T Pd
          if (out.dk) T::accumulate_call(dkt_all + kb * panel_k, qrows, gt, ni, dk, key_vecs);  // dK^T += Q^T dS
          if (out.dq) {
            T::transpose_panel(gt, st);  // dS^T, for dQ^T += K^T dS^T
            T::accumulate_call(dqt_all + (i0 / kPanel) * panel_k, krows, st, nk, dk, query_vecs);
          }
        }
      }
      for (int64_t i0 = 0; out.dq && i0 < p.len_q; i0 += kPanel) {
        store_grad_rows(out.dq, out.dq_strides, b, h, i0, std::min<int64_t>(kPanel, p.len_q - i0),
                        dqt_all + (i0 / kPanel) * panel_k, dk, static_cast<float>(p.scale));
      }
    }
    ahead.issue(ahead.lines_left());  // (what skipped tiles left)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t j0 = kb * kPanel, nk = std::min<int64_t>(kPanel, p.len_k - j0);
      if (out.dk) store_grad_rows(out.dk, out.dk_strides, b, hk, j0, nk, dkt_all + kb * panel_k, dk, static_cast<float>(p.scale));
      if (out.dv) store_grad_rows(out.dv, out.dv_strides, b, hk, j0, nk, dvt_all + kb * panel_v, dv, 1.0f);
    }
  }

  // The rows a group task reads first, prefetched for the thread's next one while it runs (see
  // row_prefetch.hpp; a BERT-sized backward, B=32 H=12 L=128, streams 75 MB a call): the group's
  // keys and values, its first head's queries and output gradient, then, as room allows, the
  // gradients it writes. Up to kMaxPrefetchedBytes, beyond which they would not stay in L2 until
  // the task reads them (long heads stream their rows in order, which the hardware follows).
  static constexpr int64_t kMaxPrefetchedBytes = 384 << 10;
  void queue_rows(RowPrefetch& ahead, int64_t b, int64_t hk) const {
    const int64_t h = hk * (p.heads_q / p.heads_kv);
    int64_t room = kMaxPrefetchedBytes;
    auto add = [&](const void* data, DType dtype, const int64_t* strides, int64_t hh, int64_t rows, int64_t width, bool write) {
      const int64_t size = dtype_size(dtype), bytes = rows * width * size;
      if (data == nullptr || strides[3] != 1 || bytes > room) return;
      room -= bytes;
      ahead.add(element_address(data, dtype, b * strides[0] + hh * strides[1]), rows, width * size, strides[2] * size, write);
    };
    add(p.k.data, p.k.dtype, p.k.strides.data(), hk, p.len_k, p.dim_qk, false);
    add(p.v.data, p.v.dtype, p.v.strides.data(), hk, p.len_k, p.dim_v, false);
    add(p.q.data, p.q.dtype, p.q.strides.data(), h, p.len_q, p.dim_qk, false);
    add(in.grad_out, in.grad_out_dtype, in.grad_out_strides, h, p.len_q, p.dim_v, false);
    add(out.dq, out.grad_dtype, out.dq_strides, h, p.len_q, p.dim_qk, true);
    add(out.dk, out.grad_dtype, out.dk_strides, hk, p.len_k, p.dim_qk, true);
    add(out.dv, out.grad_dtype, out.dv_strides, hk, p.len_k, p.dim_v, true);
  }

  // The one-pass schedule walks, per head, the key panels and within each the query panels: a
  // mask that varies along the queries is read in 48 x 48 tiles whose rows lie a mask row apart,
  // often a multiple of 4 KiB, each tile's lines from memory (an additive [1024, 1024] mask made
  // a backward take 1.06-1.09x the unmasked time; 1.03-1.04x with the copy). Such masks are copied
  // once per call, scaled (mask_row's values, so the bits are add_mask's), each tile's rows
  // consecutive and the tiles in the order they are read.
  MaskTiles tile_masks(int threads, std::vector<Tensor>& storage) const {
    MaskTiles tiles;
    const int64_t nkb = (p.len_k + kPanel - 1) / kPanel, nqb = (p.len_q + kPanel - 1) / kPanel;
    for (int t = 0; t < p.num_masks; ++t) {
      const MaskTerm& m = p.masks[t];
      int64_t slices = 0, floats = 0;
      if (m.strides[2] == 0) {
        tiles.excluded_keys[t] = excluded_key_blocks<S>(p, m, kPanel, threads, storage, true);
        continue;
      }
      if (!mask_slice_count(m, p.batch, p.heads_q, &slices) ||
          __builtin_mul_overflow(slices, nkb * nqb * kPanel * kPanel, &floats) || floats > transposed_mask_floats().load()) {
        tiles.excluded[t] = excluded_tiles<S>(p, m, kPanel, kPanel, threads, storage, true);  // read in place
        continue;
      }
      storage.push_back(Tensor::empty({floats}));
      float* dst = storage.back().data<float>();
      storage.push_back(Tensor::empty({slices * nkb * nqb}, DType::boolean));
      uint8_t* excluded = storage.back().data<uint8_t>();
      parallel_for(slices * nkb, threads, [&](int64_t task, int) {
        const int64_t slice = task / nkb, kb = task % nkb, j0 = kb * kPanel;
        int64_t b = 0, h = 0;
        mask_slice_origin(m, p.heads_q, slice, &b, &h);
        float* tile = dst + (slice * nkb + kb) * nqb * kPanel * kPanel;
        for (int64_t i = 0; i < nqb * kPanel; ++i, tile += kPanel) {  // query i: row i % 48 of tile i / 48
          for (int c0 = 0; c0 < kPanel; c0 += kLanes) {
            const int nc = static_cast<int>(std::clamp<int64_t>(p.len_k - j0 - c0, 0, kLanes));
            S::store(tile + c0, i < p.len_q && nc > 0 ? T::mask_row(m, b, h, i, j0 + c0, nc) : S::zero());
          }
        }
        const float* first = dst + (slice * nkb + kb) * nqb * kPanel * kPanel;
        const int64_t nk = std::min<int64_t>(kPanel, p.len_k - j0);
        for (int64_t qb = 0; qb < nqb; ++qb) {
          const int64_t nq = std::min<int64_t>(kPanel, p.len_q - qb * kPanel);
          bool all = true, all_swamped = true;
          for (int64_t ii = 0; ii < nq && (all || all_swamped); ++ii)
            for (int64_t jj = 0; jj < nk; ++jj) {
              const float x = first[(qb * kPanel + ii) * kPanel + jj];
              all = all && x == -std::numeric_limits<float>::infinity();
              all_swamped = all_swamped && x <= kSwampedBelow;
            }
          excluded[(slice * nqb + qb) * nkb + kb] = block_class(all, all_swamped, true);
        }
      });
      tiles.data[t] = dst;
      if (skips_excluded_blocks().load()) tiles.excluded[t] = excluded;
    }
    tiles.ordinary = ordinary_rows(p, threads, storage);
    return tiles;
  }

  void run() const {
    if (!out.dq && !out.dk && !out.dv && !out.dscores) return;  // nothing wanted
    const int threads = resolve_threads(p.num_threads);
    if constexpr (!kPairs) {  // (decoding does not take the pair products: bf16_pairs_backward_takes)
    if (FewQueriesBackward<S>::applies(p)) {
      if (!p.windowed) return FewQueriesBackward<S>{p, in, out}.run();
      const AttentionProblem masked = with_window_as_mask(p);  // (its own key blocks skip by masks)
      return FewQueriesBackward<S>{masked, in, out}.run();
    }
    }
    // Many head groups: one pass per group, which writes dS (a mask's gradient) from its tiles as
    // it goes. Otherwise two passes, over key blocks then query blocks, which split the sequence
    // too. The choice depends on the shape only (never on the thread count), which keeps the
    // results bit-identical across thread counts; 16 groups keep up to 4 threads busy with room to
    // balance.
    if (p.batch * p.heads_kv >= kMinGroupsForOnePassBackward) {
      std::vector<Tensor> storage;
      FlashBackward with_tiles{p, in, out, tile_masks(threads, storage)};
      const int64_t groups = p.batch * p.heads_kv;
      const int64_t queries = p.batch * p.heads_q * p.len_q, keys = p.batch * p.heads_kv * p.len_k;
      const int64_t bytes = 2 * (queries + keys) * (p.dim_qk + p.dim_v) * dtype_size(p.q.dtype);  // read and written
      parallel_for(groups, threads, [&](int64_t t, int) {
        // With every thread taking the next index in turn, this thread's next group is likely t + threads.
        RowPrefetch ahead;
        const int64_t next = t + threads;
        if (bytes >= kMinBytesToPrefetch && next < groups) with_tiles.queue_rows(ahead, next / p.heads_kv, next % p.heads_kv);
        with_tiles.group_task(t / p.heads_kv, t % p.heads_kv, ahead);
      });
      return;
    }
    // Each pass runs only for the gradients it writes. Masks (read in place) get maps of the
    // tiles of each pass they exclude entirely, which the tasks skip.
    std::vector<Tensor> storage;
    MaskTiles maps;
    for (int t = 0; t < p.num_masks; ++t) {
      const MaskTerm& m = p.masks[t];
      if (m.strides[2] == 0) {
        maps.excluded_keys[t] = excluded_key_blocks<S>(p, m, kPanel, threads, storage, true);
        maps.excluded_key_blocks[t] = excluded_key_blocks<S>(p, m, kBlock, threads, storage, true);
      } else {
        maps.keys_pass[t] = excluded_tiles<S>(p, m, kBlock, kPanel, threads, storage, true);
        maps.queries_pass[t] = excluded_tiles<S>(p, m, kPanel, kBlock, threads, storage, true);
      }
    }
    maps.ordinary = ordinary_rows(p, threads, storage);
    const FlashBackward two_pass{p, in, out, maps};
    const int64_t key_blocks = (p.len_k + kPanel - 1) / kPanel;
    parallel_for(out.dk || out.dv ? p.batch * p.heads_kv * key_blocks : 0, threads, [&](int64_t t, int) {
      const int64_t bh = t / key_blocks;
      two_pass.keys_task(bh / p.heads_kv, bh % p.heads_kv, (t % key_blocks) * kPanel);
    });
    const int64_t query_blocks = (p.len_q + kPanel - 1) / kPanel;
    parallel_for(out.dq || out.dscores ? p.batch * p.heads_q * query_blocks : 0, threads, [&](int64_t t, int) {
      const int64_t qb = query_blocks - 1 - t % query_blocks;  // long causal rows first
      const int64_t bh = t / query_blocks;
      two_pass.queries_task(bh / p.heads_q, bh % p.heads_q, qb * kPanel);
    });
  }
};

}  // namespace
}  // namespace mha::detail
