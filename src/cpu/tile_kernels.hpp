// The register-blocked building blocks of the fused kernels, over a SIMD layer S. A "panel" is
// kWidth = 48 floats (3 vectors) wide: the lanes run over the queries of a forward task, or over
// the keys of a backward task, and every matrix product of attention is one of the two shapes below
// with rows read in place through one broadcast per element.
// Internal linkage (an anonymous namespace): each ISA's file compiles its own copy.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/attention_problem.hpp"

namespace mha::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // softmax runs in base 2: e^x = 2^(x log2 e)
constexpr float kLn2 = 0.6931471805599453f;

template <class S>
struct Tiles {
  using F = typename S::F;
  using U = typename S::U;
  static constexpr int kLanes = S::kLanes;
  static constexpr int kVecs = 3;                 // 24 accumulators + 3 operands fit 32 zmm registers
  static constexpr int kWidth = kLanes * kVecs;   // floats per panel row
  static constexpr int kRowsPerTile = S::kRowsPerTile;  // broadcast rows per dot_rows call

  static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

  // n bfloat16, float16 or float8 (e4m3, e5m2) values (`dtype`, as bits, from src's first element)
  // to float32, exactly: how the kernels read low-precision rows.
  static void widen(DType dtype, const void* src, float* dst, int64_t n) {
    if (dtype == DType::bf16) S::widen_bf16(static_cast<const uint16_t*>(src), dst, n);
    else if (dtype == DType::f16) S::widen_f16(static_cast<const uint16_t*>(src), dst, n);
    else if (dtype == DType::f8e5m2) S::widen_f8e5m2(static_cast<const uint8_t*>(src), dst, n);
    else S::widen_f8(static_cast<const uint8_t*>(src), dst, n);
  }

  // The register block of the two products: kBlockRows broadcast rows times kBlockVecs vectors of
  // the panel, from the SIMD layer. AVX-512 (32 registers) holds a whole 8 x 48 tile, 24
  // accumulators; AVX2 (16 ymm registers, two per 16-lane vector) a 6 x 16 block, 12 accumulators,
  // 2 operands and a broadcast, the shape of the classic AVX2 GEMM kernel: 8 loads per 12 FMAs,
  // where a 4 x 16 block needs 6 per 8 and leaves the FMA units waiting on the loads. A block that
  // does not fit the register file spills every iteration.
  static constexpr int kBlockRows = S::kBlockRows;
  static constexpr int kBlockVecs = S::kBlockVecs;
  static_assert(kRowsPerTile % kBlockRows == 0 && kVecs % kBlockVecs == 0);

  // One step of the products, over float32 (E = float: a fused multiply-add of a broadcast element)
  // or over pairs of bfloat16 values in 32-bit words (E = uint32_t, S::kBf16Pairs: vdpbf16ps, two
  // products per lane of a broadcast pair and a panel word).
  static auto load_e(const float* p) { return S::load(p); }
  static auto load_e(const uint32_t* p) { return S::load_w(p); }
  static auto broadcast_e(const float* p) { return S::set1(*p); }
  static auto broadcast_e(const uint32_t* p) { return S::broadcast_w(p); }
  template <class E, class V>
  static F multiply_add(V b, V x, F acc) {
    if constexpr (std::is_same_v<E, float>) return S::fmadd(b, x, acc);
    else return S::dot_pairs(b, x, acc);
  }

  // Calls block(std::integral_constant<int, V>, c0) over the first `vecs` vectors of a panel:
  // whole register blocks of kBlockVecs vectors from c0 = 0, then one block of the V < kBlockVecs
  // vectors left. A partly filled panel (the last 32 queries of L=128, say) computes only the
  // vectors that hold its lanes; each lane's sums are the same operations in the same order
  // whatever the block's width, so the bits do not depend on it.
  template <class Block>
  static void over_vectors(int vecs, const Block& block) {
    static_assert(kBlockVecs <= 3, "the rest is one block of 1 or 2 vectors");
    if (vecs == kVecs) {  // a whole panel (the usual case), its loop unrolled
      for (int c0 = 0; c0 < kVecs; c0 += kBlockVecs) block(std::integral_constant<int, kBlockVecs>{}, c0);
      return;
    }
    int c0 = 0;
    for (; c0 + kBlockVecs <= vecs; c0 += kBlockVecs) block(std::integral_constant<int, kBlockVecs>{}, c0);
    if constexpr (kBlockVecs > 1) {
      if (vecs - c0 == 1) block(std::integral_constant<int, 1>{}, c0);
      if constexpr (kBlockVecs > 2)
        if (vecs - c0 == 2) block(std::integral_constant<int, 2>{}, c0);
    }
  }

  // out[r][c..] = sum_d rows[r][d] * panel[d][c..] for one register block of R rows and V vectors
  // from vector c0 (times `scale` over bfloat16 pairs, whose operands are not pre-scaled: a scaled
  // bfloat16 would round again).
  template <int R, int V = kBlockVecs, class E>
  static void dot_rows_block(float* out, const E* const* rows, const E* panel, int64_t depth, int c0, F scale = S::zero()) {
    constexpr bool kScaled = std::is_same_v<E, uint32_t>;
    F acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) acc[r][c] = S::zero();
    if (depth <= 0) {  // an empty head dimension: zero scores
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < V; ++c) S::store(out + r * kWidth + (c0 + c) * kLanes, acc[r][c]);
      return;
    }
    // A loop that runs at least once (do-while, the empty case returned above): with a loop that
    // might not run, GCC 12 kept a stack copy of the AVX2 accumulators (structs of two ymm) for the
    // skipped path, a store and reload of all 12 around every call, 5-10% of a product of 48 rows.
    int64_t d = 0;
    do {
      decltype(load_e(panel)) x[V];
      for (int c = 0; c < V; ++c) x[c] = load_e(panel + d * kWidth + (c0 + c) * kLanes);
      for (int r = 0; r < R; ++r) {
        const auto b = broadcast_e(rows[r] + d);
        for (int c = 0; c < V; ++c) acc[r][c] = multiply_add<E>(b, x[c], acc[r][c]);
      }
    } while (++d < depth);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c)
        S::store(out + r * kWidth + (c0 + c) * kLanes, kScaled ? S::mul(acc[r][c], scale) : acc[r][c]);
  }

  // out[r][:] = sum_d rows[r][d] * panel[d][:] for kRowsPerTile rows (e.g. S^T = K Q^T), over the
  // first `vecs` vectors of the panel: a partly filled panel skips the rest.
  static void dot_rows(float* out, const float* const* rows, const float* panel, int64_t depth, int vecs = kVecs) {
    for (int r0 = 0; r0 < kRowsPerTile; r0 += kBlockRows)
      over_vectors(vecs, [&](auto v, int c0) {
        dot_rows_block<kBlockRows, decltype(v)::value>(out + r0 * kWidth, rows + r0, panel, depth, c0);
      });
  }
  // The same over bfloat16 pairs (S::kBf16Pairs): rows and panel of 32-bit words, `words` of them
  // deep, the sums times `scale`.
  static void dot_pairs(float* out, const uint32_t* const* rows, const uint32_t* panel, int64_t words, int vecs, F scale) {
    for (int r0 = 0; r0 < kRowsPerTile; r0 += kBlockRows)
      over_vectors(vecs, [&](auto v, int c0) {
        dot_rows_block<kBlockRows, decltype(v)::value>(out + r0 * kWidth, rows + r0, panel, words, c0, scale);
      });
  }

  // The two products kept out of line, for large callers (the backward's tasks, the forward's key
  // pass): inlined there, GCC 12 kept the AVX2 accumulators (structs of two ymm) on the stack, a
  // store and reload per FMA that halved the backward's speed, and the forward's once its key pass
  // had grown (soft-capping, ALiBi, float8 rows): 0.57x the time out of line. A full panel (the
  // usual case) gets its own copy with the vector count a constant.
  [[gnu::noinline]] static void dot_rows_call(float* out, const float* const* rows, const float* panel, int64_t depth,
                                              int vecs = kVecs) {
    if (vecs == kVecs) dot_rows(out, rows, panel, depth, kVecs);
    else dot_rows(out, rows, panel, depth, vecs);
  }
  [[gnu::noinline]] static void accumulate_call(float* acc, const float* const* rows, const float* weights, int64_t n,
                                                int64_t cols, int vecs = kVecs) {
    if (vecs == kVecs) accumulate(acc, rows, weights, n, cols, kVecs);
    else accumulate(acc, rows, weights, n, cols, vecs);
  }

  // The vectors of a panel that hold its first `n` lanes (the products run a narrower register
  // block for those past the last whole one: over_vectors).
  static int vecs_for(int64_t n) { return static_cast<int>((n + kLanes - 1) / kLanes); }

  // acc[r][c..] = acc[r][c..] * scale[c..] + sum_j rows[j][col0 + r] * weights[j][c..] for R
  // columns and one block of vectors (E: float32 elements, or words of bfloat16 pairs as in
  // dot_rows_block); a null scale multiplies by none. Fresh accumulators start at zero, acc unread.
  template <int R, int V, class E>
  static void accumulate_block(float* acc, const E* const* rows, int64_t col0, const E* weights, int64_t n, int c0,
                               const float* scale, bool fresh) {
    F a[R][V];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) a[r][c] = fresh ? S::zero() : S::load(acc + r * kWidth + (c0 + c) * kLanes);
    if (scale && !fresh) {
      for (int c = 0; c < V; ++c) {
        const F f = S::load(scale + (c0 + c) * kLanes);
        for (int r = 0; r < R; ++r) a[r][c] = S::mul(a[r][c], f);
      }
    }
    if (n <= 0) {  // nothing to add; else a loop that runs at least once, as in dot_rows_block
      if (scale || fresh)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < V; ++c) S::store(acc + r * kWidth + (c0 + c) * kLanes, a[r][c]);
      return;
    }
    int64_t j = 0;
    do {
      decltype(load_e(weights)) w[V];
      for (int c = 0; c < V; ++c) w[c] = load_e(weights + j * kWidth + (c0 + c) * kLanes);
      const E* row = rows[j] + col0;
      for (int r = 0; r < R; ++r) {
        const auto b = broadcast_e(row + r);
        for (int c = 0; c < V; ++c) a[r][c] = multiply_add<E>(b, w[c], a[r][c]);
      }
    } while (++j < n);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) S::store(acc + r * kWidth + (c0 + c) * kLanes, a[r][c]);
  }

  // acc[c][:] = acc[c][:] * scale[:] + sum_j rows[j][c0 + c] * weights[j][:] for kCols columns
  // (e.g. O^T = O^T diag(alpha) + V^T P^T).
  template <int kCols, class E>
  static void accumulate_cols(float* acc, const E* const* rows, int64_t c0, const E* weights, int64_t n, int vecs,
                              const float* scale, bool fresh) {
    constexpr int kFull = kCols / kBlockRows * kBlockRows, kRest = kCols % kBlockRows;
    over_vectors(vecs, [&](auto v, int v0) {
      constexpr int kV = decltype(v)::value;
      for (int r0 = 0; r0 < kFull; r0 += kBlockRows)
        accumulate_block<kBlockRows, kV>(acc + r0 * kWidth, rows, c0 + r0, weights, n, v0, scale, fresh);
      if constexpr (kRest > 0) accumulate_block<kRest, kV>(acc + kFull * kWidth, rows, c0 + kFull, weights, n, v0, scale, fresh);
    });
  }

  // acc[c][:] += sum_j rows[j][c] * weights[j][:] for all `cols` columns, a register block at a
  // time, over the first `vecs` vectors of the panel (as in dot_rows). With `scale` (a panel row,
  // kWidth floats), each column is first multiplied by it, lane by lane: the forward's rescaling of
  // O^T as the running max grows, done on the accumulators as they are loaded (the same multiply,
  // so the same bits, as a pass of its own over O^T, which took 7% of the bf16 key pass). `fresh`
  // accumulators start at zero without reading acc: a task's first key block (its O^T not zeroed
  // first; the rescale of zeros by alpha = 0 gave zeros anyway).
  static_assert(kBlockRows <= 8, "accumulate's remainder switch covers up to 7 columns");
  // (Over bfloat16 pairs, S::kBf16Pairs: rows and weights of 32-bit words, n pairs of rows deep.)
  template <class E>
  static void accumulate(float* acc, const E* const* rows, const E* weights, int64_t n, int64_t cols,
                         int vecs = kVecs, const float* scale = nullptr, bool fresh = false) {
    int64_t c0 = 0;
    for (; c0 + kBlockRows <= cols; c0 += kBlockRows) {
      accumulate_cols<kBlockRows, E>(acc + c0 * kWidth, rows, c0, weights, n, vecs, scale, fresh);
    }
    float* a = acc + c0 * kWidth;
    switch (cols - c0) {  // the columns left over, one instance per count
      case 1: accumulate_cols<1, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 2: accumulate_cols<2, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 3: accumulate_cols<3, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 4: accumulate_cols<4, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 5: accumulate_cols<5, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 6: accumulate_cols<6, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      case 7: accumulate_cols<7, E>(a, rows, c0, weights, n, vecs, scale, fresh); break;
      default: break;
    }
  }

  // dst[c][r] = src[r][c] for an N x N block, in 8 x 8 blocks where the SIMD layer has a block
  // transpose (the portable layer does not).
  template <int N>
  static void transpose(const float* src, float* dst) {
    static_assert(N % 8 == 0);
    if constexpr (requires { S::transpose8x8(src, int64_t{0}, dst, int64_t{0}); }) {
      for (int r = 0; r < N; r += 8)
        for (int c = 0; c < N; c += 8) S::transpose8x8(src + r * N + c, N, dst + c * N + r, N);
    } else {
      for (int r = 0; r < N; ++r)
        for (int c = 0; c < N; ++c) dst[c * N + r] = src[r * N + c];
    }
  }
  static void transpose_panel(const float* src, float* dst) { transpose<kWidth>(src, dst); }   // kWidth x kWidth

  // dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: 8 x 8 blocks in
  // registers where the SIMD layer has them, the ragged edges (and the portable layer) one by one.
  static void transpose_rect(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                             int64_t cols) {
    int64_t r0 = 0;
    if constexpr (requires { S::transpose8x8(src, int64_t{0}, dst, int64_t{0}); }) {
      for (; r0 + 8 <= rows; r0 += 8) {
        int64_t c0 = 0;
        for (; c0 + 8 <= cols; c0 += 8) S::transpose8x8(src + r0 * src_stride + c0, src_stride, dst + c0 * dst_stride + r0, dst_stride);
        for (; c0 < cols; ++c0)
          for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * dst_stride + r] = src[r * src_stride + c0];
      }
    }
    for (; r0 < rows; ++r0)
      for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r0] = src[r0 * src_stride + c];
  }
  static void transpose_square(const float* src, float* dst) { transpose<kLanes>(src, dst); }  // kLanes x kLanes

  // log2(e) * mask(b, h, i, j0 + c) for c < nc, zero past them, as one vector: read along the
  // mask's row (where masks are contiguous) and scaled in a SIMD multiply, so that every reader of
  // a mask (the forward's tiles and its transposed copy, the backward's tiles) adds the same values.
  static F mask_row(const MaskTerm& t, int64_t b, int64_t h, int64_t i, int64_t j0, int nc) {
    const int64_t sj = t.strides[3];
    const int64_t off = b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + j0 * sj;
    const F log2e = S::set1(kLog2e);
    alignas(64) float raw[kLanes];
    if (t.kind == MaskKind::additive) {
      // Saturated: a finite value past FLT_MAX / log2(e) (Hugging Face's finfo.min, -3.4e38) stays
      // finite. At -inf, a row of such values would give zeros; PyTorch adds them to the scores in
      // float32, where each sum rounds to the mask value, and gives that row uniform weights.
      const float* m = static_cast<const float*>(t.data) + off;
      if (sj == 1 && nc == kLanes) return S::mul_saturated(S::load(m), log2e);  // a whole vector of a contiguous row
      for (int c = 0; c < nc; ++c) raw[c] = m[c * sj];
      for (int c = nc; c < kLanes; ++c) raw[c] = 0.0f;
      return S::mul_saturated(S::load(raw), log2e);
    } else {
      const float neg_inf = -std::numeric_limits<float>::infinity();
      const bool keep_if_true = t.kind == MaskKind::keep_if_true;
      const float bias[2] = {keep_if_true ? neg_inf : 0.0f, keep_if_true ? 0.0f : neg_inf};  // a lookup, no branch
      const uint8_t* m = static_cast<const uint8_t*>(t.data) + off;
      for (int c = 0; c < nc; ++c) raw[c] = bias[m[c * sj] != 0];
    }
    for (int c = nc; c < kLanes; ++c) raw[c] = 0.0f;
    return S::mul(S::load(raw), log2e);
  }

  // square[r][c] = mask_row(i0 + r, j0)[c] for r < nr, zero rows past them: a kLanes x kLanes
  // square, [query][key].
  static void mask_square(const MaskTerm& t, int64_t b, int64_t h, int64_t i0, int nr, int64_t j0, int nc,
                          float* square) {
    for (int r = 0; r < kLanes; ++r) S::store(square + r * kLanes, r < nr ? mask_row(t, b, h, i0 + r, j0, nc) : S::zero());
  }

  // tile[ii * row_step + jj * col_step] += log2(e) * mask(b, h, i0 + ii, j0 + jj) for ii < rows,
  // jj < cols, one of the steps 1, a vector at a time (a SIMD add of mask_row's values, so the same
  // bits for every layout and tail). The tile's unit-stride side is padded to whole vectors: its
  // other step is at least that count rounded up to kLanes (the lanes past it get + 0).
  //   [query][key] tiles (col_step 1): a mask row onto each tile row.
  //   [key][query] tiles (the forward's S^T): a key padding mask adds one broadcast value per key;
  //   a term by distance (ALiBi's) one load per key and kLanes queries, its lanes reversed;
  //   others a square of kLanes x kLanes at a time, transposed in registers. Element by element,
  //   a 48-query tile's stores fell 192 bytes apart and masks took 14-23% of a forward (d=64,
  //   L=1024). The forward reads masks that vary along the queries from a transposed copy
  //   instead, where it can (FlashForward::transpose_masks).
  static void add_mask(const MaskTerm& t, float* tile, int64_t row_step, int64_t col_step, int64_t b, int64_t h,
                       int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
    const bool same_for_every_query = t.strides[2] == 0;  // a key padding mask, [B, 1, 1, Lk]
    auto add = [](float* at, F v) { S::store(at, S::add(S::load(at), v)); };
    if (col_step == 1) {  // along each mask row in turn: its lines are consecutive
      for (int64_t ii = 0; ii < (same_for_every_query ? 1 : rows); ++ii) {
        for (int64_t jj0 = 0; jj0 < cols; jj0 += kLanes) {
          const F v = mask_row(t, b, h, i0 + ii, j0 + jj0, static_cast<int>(std::min<int64_t>(kLanes, cols - jj0)));
          if (!same_for_every_query) add(tile + ii * row_step + jj0, v);
          else for (int64_t r = 0; r < rows; ++r) add(tile + r * row_step + jj0, v);
        }
      }
      return;
    }
    alignas(64) float square[kLanes * kLanes];
    alignas(64) float turned[kLanes * kLanes];  // [key][query]
    for (int64_t jj0 = 0; jj0 < cols; jj0 += kLanes) {
      const int nc = static_cast<int>(std::min<int64_t>(kLanes, cols - jj0));
      if (same_for_every_query) {
        S::store(square, mask_row(t, b, h, i0, j0 + jj0, nc));
        for (int c = 0; c < nc; ++c)
          for (int64_t ii0 = 0; ii0 < rows; ii0 += kLanes) add(tile + (jj0 + c) * col_step + ii0, S::set1(square[c]));
        continue;
      }
      int64_t ii0 = 0;
      if (t.by_distance()) {  // a key's whole vector of queries is one load, reversed: no square to transpose
        const float* slice = static_cast<const float*>(t.data) + b * t.strides[0] + h * t.strides[1];
        const F log2e = S::set1(kLog2e);
        for (; ii0 + kLanes <= rows; ii0 += kLanes)  // (whole vectors of queries only: the others' values may lie outside)
          for (int c = 0; c < nc; ++c) {
            const F v = S::reverse(S::load(slice + (j0 + jj0 + c) - (i0 + ii0 + kLanes - 1)));
            add(tile + (jj0 + c) * col_step + ii0, S::mul_saturated(v, log2e));
          }
      }
      for (; ii0 < rows; ii0 += kLanes) {
        mask_square(t, b, h, i0 + ii0, static_cast<int>(std::min<int64_t>(kLanes, rows - ii0)), j0 + jj0, nc, square);
        transpose_square(square, turned);
        for (int c = 0; c < nc; ++c) add(tile + (jj0 + c) * col_step + ii0, S::load(turned + c * kLanes));
      }
    }
  }

  // j, j + 1, ..., j + kLanes - 1: the key (or row) index of each lane.
  static U lane_indices(int64_t j) {
    static constexpr auto kLaneIndex = [] {
      std::array<uint32_t, kLanes> lanes{};
      for (int c = 0; c < kLanes; ++c) lanes[c] = static_cast<uint32_t>(c);
      return lanes;
    }();
    return S::add_u(S::set1_u(static_cast<uint32_t>(j)), S::load_u(kLaneIndex.data()));
  }

  // The dropout hash of core/dropout.hpp, on 16 keys (or 16 rows) at once.
  static U mix32(U x) {
    x = S::xor_u(x, S::template shr_u<16>(x));
    x = S::mullo_u(x, S::set1_u(0x7feb352du));
    x = S::xor_u(x, S::template shr_u<15>(x));
    x = S::mullo_u(x, S::set1_u(0x846ca68bu));
    return S::xor_u(x, S::template shr_u<16>(x));
  }
  static U dropout_bits(U j, U key_lo, U key_hi) { return mix32(S::add_u(mix32(S::xor_u(j, key_lo)), key_hi)); }
};

}  // namespace
}  // namespace mha::detail
