// Attention for a handful of queries per head: decoding (one new token against a key/value cache),
// speculative decoding and short chunks of a prompt (a few tokens each). The tile kernel
// (flash_forward.hpp) puts the queries of one head in the lanes of a 48-wide panel; with a few
// queries per head most of its lanes compute nothing, and such a step ran at 0.2-0.6x PyTorch's.
// Here the lanes run over the keys: a block of 48 keys is transposed once into a panel and each
// query is a broadcast row of the score product (the backward's shape, tile_kernels.hpp), with an
// online softmax per block; then O += P V takes each probability as a broadcast against value rows
// read in place. With up to 8 (AVX2) or 4 queries per key/value head (dot mode), each score is a
// dot product of whole rows instead, and a run's keys are read in one pass, its softmax taken
// whole, then its values read in another pass (no rescaling per block); 16-bit rows are widened as
// they are loaded, float8 rows too (e4m3 up to 4 queries per key/value head). The query heads that
// share a key/value head (GQA) are rows of the same task, so each key block is read once for all
// of them. Long caches are split into shape-fixed runs of keys
// whose partial softmax states are merged in order afterwards; every query row's arithmetic is the
// same whichever rows share its register block or task, so the bits depend on the shape only, not
// on the thread count. Key blocks a mask excludes for every row of a task (a batch's left
// padding) are skipped, keys and values unread. With AVX512-BF16 (S::kBf16Pairs), bfloat16 problems
// take both products over pairs of bfloat16 values, in the panel schedule (run_keys_by_pairs) and
// in dot mode (pair_scores).
// Internal linkage: each ISA's file compiles its own copy.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/dropout.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/excluded_keys.hpp"
#include "cpu/softcap.hpp"
#include "cpu/tile_kernels.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {
namespace {

template <class S>
struct FewQueries {
  using F = typename S::F;
  using M = typename S::M;
  using U = typename S::U;
  using T = Tiles<S>;
  static constexpr int kLanes = S::kLanes;
  // The first n lanes (0 <= n <= kLanes).
  static M first_lanes(int64_t n) { return static_cast<M>(n == kLanes ? (1u << kLanes) - 1 : (1u << n) - 1); }
  static constexpr int kKeys = T::kWidth;  // keys per block: the lanes of one panel (48)
  static constexpr int kBlockRows = T::kBlockRows, kBlockVecs = T::kBlockVecs;
  static constexpr int64_t kMaxQueriesPerHead = kFewQueriesPerHead;
  // Most keys per run of a split cache: runs are tasks of their own (a cache of 4096 keys and 8
  // key/value heads makes 40), merged afterwards. The runs of a cache are as even as whole blocks
  // allow (2048 keys: 720, 720 and 608, not 1008, 1008 and 32), so that the last tasks are not
  // the longest; the split depends on the shape only, and so do the bits.
  static constexpr int64_t kKeysPerRun = 21 * kKeys;  // 1008
  static_assert(kKeysPerRun % kLanes == 0, "a run's scores are whole vectors (run_keys_by_dot)");

  const AttentionProblem& p;
  const ForwardOutputs& o;
  // Per mask term, per (slice, block of kKeys keys): 1 where the term excludes the block's every
  // key for every query (-inf or false: the left padding of a batch of prompts of different
  // lengths), from excluded_keys.hpp; null where there is no map. A task skips a block its every
  // row has excluded by some term, reading none of its keys or values: its probabilities are 0
  // and adding them changes no bit of O, m or l.
  struct ExcludedBlocks {
    std::array<const uint8_t*, 3> maps{};
    OrdinaryRows ordinary{};  // the rows for which swamped blocks are skipped too (excluded_keys.hpp)
    bool done = false;  // run() has built them (it may have built none)
  };
  ExcludedBlocks excluded{};

  // The weights stay with the tile kernel outside dot mode (the panel schedule rescales its blocks
  // online and keeps none of their probabilities). Dropout runs in both schedules (dropped()). Dot mode has each run's
  // probabilities whole: it writes them as weights, scaled once the row's statistics are final.
  // The head average (average_weights) is the caller's (FlashForward::run_then_average): here,
  // o.weights only.
  static bool applies(const AttentionProblem& p, const ForwardOutputs& o) {
    if (p.len_q > kMaxQueriesPerHead) return false;
    return (o.weights == nullptr && o.average_weights == nullptr) || p.heads_q / p.heads_kv * p.len_q <= kDotRows;
  }

  int64_t group() const { return p.heads_q / p.heads_kv; }
  int64_t queries() const { return group() * p.len_q; }  // per key/value head: query (h, i) is row (h % group) * Lq + i
  int64_t runs() const { return (p.len_k + kKeysPerRun - 1) / kKeysPerRun; }
  int64_t keys_per_run() const { return T::round_up((p.len_k + runs() - 1) / runs(), kKeys); }  // <= kKeysPerRun
  int64_t dk8() const { return T::round_up(p.dim_qk, 8); }  // key rows are transposed 8 x 8
  int64_t dk() const { return T::round_up(p.dim_qk, kLanes); }
  int64_t dv() const { return T::round_up(p.dim_v, kLanes); }  // value rows padded with zeros to whole vectors
  // A run's partial result per query: O, then m, l and (with weights) how many of its keys the task saw.
  int64_t state_floats() const { return dv() + 3; }
  // Up to kDotRows queries per key/value head: each score a dot product of whole key rows, as
  // transposing 48 keys into a panel and rescaling per block cost more than that many rows'
  // products. Where the partial sums are added in registers (S::sum4; AVX2), 8 rows: 0.70-0.85x
  // the panel's time at caches of 2048-4096 keys, level at 512 (16 rows: 1.15x at 512). Where
  // they go through a transpose in memory, once per row and 16 keys, 4 rows (measured on AVX-512
  // with the one-pass schedule). Where several rows share each key vector loaded (kScoreRows;
  // AVX-512), every shape the decoding kernel takes, up to 32 rows (Zen 5, caches of 4096 keys
  // streamed from memory, against the panel: bf16 8-20 rows 0.53-0.76x the time, float16 8-32
  // rows 0.53-0.85x, float8 0.71-0.82x, float32 d = 64 0.65-0.72x, float32 d = 128 8 rows 0.92x
  // but 12-16 rows 1.05-1.13x, 32 level). One rule whatever the dtype, so that a bfloat16 or
  // float8 cache gives the bits of its widened copy; bfloat16 q, k and v take pair products for
  // the scores (pair_scores). Decided by the ISA and the shape, so the bits are too.
  static constexpr bool kSum4 = requires(F x, float* out) { S::sum4(x, x, x, x, out); };
  // Rows of queries scored together against each key block (S::kDotScoreRows where the ISA has
  // registers for them, else 1): each key vector is loaded, and widened, once for all of them.
  static constexpr int kScoreRows = [] {
    if constexpr (requires { S::kDotScoreRows; }) return kSum4 ? S::kDotScoreRows : 1;
    else return 1;
  }();
  static constexpr int64_t kDotRows = kScoreRows > 1 ? kMaxQueriesPerHead : kSum4 ? 8 : 4;
  bool scores_by_dot() const { return queries() <= kDotRows && !takes_pairs(p); }
  // bfloat16 pair products (vdpbf16ps) where the layer has them and q, k and v are bfloat16 with
  // an even head dim (bf16_pairs_supports): in the panel schedule for more rows per key/value head
  // than dot mode takes (a group of 64 query heads, or 8 heads of 5 tokens and more), against
  // the float32 panel 1.30x faster at 64 rows. Dot mode's scores in pair products took 0.64x the
  // panel's time at 24 rows and 0.71x at 32 (Zen 5, B=8 H=192-256/8 S=4096 d=128 streamed; in L3
  // 0.86x and 0.90x; d=64 0.89x; 32 queries of one head 0.68x): a block's transposes as pairs
  // cost the same whatever its rows, and the panel reads its rows in an order the hardware
  // prefetchers do not follow (see run_keys_by_pairs).
  static constexpr bool kPairs = requires { S::kBf16Pairs; };
  // Whether the layer runs q, k and v in pair products at all (either schedule below).
  static bool pair_products(const AttentionProblem& p) { return kPairs && bf16_pairs_supports(p) && p.heads_kv > 0; }
  static bool takes_pairs(const AttentionProblem& p) {
    return pair_products(p) && p.heads_q / p.heads_kv * p.len_q > kDotRows;
  }
  // In dot mode, the scores take the pair products (dot_pair_scores_rows): each vdpbf16ps two
  // products per lane on the key row as it lies, no widening (or, scores_by_panel, on the block's
  // keys transposed as pairs); the softmax stays float32, and the value product takes P rounded to
  // bfloat16 against pairs of value rows interleaved as they are read (accumulate_pairs_in_place),
  // as the panel does. Its output is within bfloat16 rounding of the float32 kernel's, not its bits.
  static bool pair_scores(const AttentionProblem& p) { return pair_products(p) && !takes_pairs(p); }
  // With pair products, dot mode's scores from each block of 16 keys transposed as pairs of dims
  // (panel_pair_scores: no horizontal sums) from kPanelScoreRows query rows per key/value head and
  // head dims up to 64 (at 128 the transposes and a broadcast per product cost more than the sums
  // save: 1.05-1.15x the time at 32 rows). Decided by the shape alone, never the layout or the
  // tasks, so that a paged cache, a [B, S, H, D] view and its keys gathered give the same bits (rows
  // of at most 128 bytes are swept whole blocks at a time: sweep_keys).
  static constexpr int64_t kPanelScoreRows = 16;
  bool scores_by_panel() const { return queries() >= kPanelScoreRows && p.dim_qk <= 64; }
  // Whether dot mode reads low-precision rows (of `dtype`, `width` elements) in place, widening
  // each vector as it loads it: 16-bit and e5m2 rows of whole vectors always; e4m3 rows up to 4 queries
  // per key/value head, as their widening costs several times a 16-bit one's and rows in place
  // are widened again for every query (AVX2, bf16 queries, medians of 40, three runs: 4 rows
  // 0.78-0.87x the time of widening each block once into a buffer, at B=4 H=16 S=2048 d=64 and
  // GQA 32/8 S=4096 d=128; 8 rows 1.19-1.22x).
  bool reads_in_place(DType dtype, int64_t width) const {
    return width % kLanes == 0 && (dtype != DType::f8e4m3 || queries() <= 4);
  }
  // What dot mode's queries (keys) and output (values) are multiplied by where it reads float8
  // rows in place (AsF8): 2^8, else 1.
  float key_unscale() const {
    return scores_by_dot() && p.k.dtype == DType::f8e4m3 && reads_in_place(p.k.dtype, p.dim_qk) ? 256.0f : 1.0f;
  }
  float value_unscale() const {
    return scores_by_dot() && p.v.dtype == DType::f8e4m3 && reads_in_place(p.v.dtype, p.dim_v) ? 256.0f : 1.0f;
  }
  // The panel schedule prefetches key rows of 512 bytes and more a block ahead; with shorter rows
  // (d = 64 in float32), prefetching next to its panel transposes cost more than it saved (a step
  // at B=4 H=16 S=4096 d=64 took 1.4x the time on AVX2). 16- and 8-bit rows are prefetched
  // whatever their length: widened (or transposed as pairs) before their products, their misses
  // stalled the block (AVX-512 on Zen 5, bf16, 8 query rows per key/value head: 1.12-1.28x faster
  // at d = 64 and 128, float16 1.30x, float8 1.11-1.13x). Dot mode reads keys, then values, each
  // in one sequential pass, and asks for rows kDotPrefetchKeys ahead whatever their length (48
  // to 96 keys measured best on AVX2, 0.90-0.95x the time of no prefetch at d=64 and 128).
  bool prefetches() const { return p.dim_qk * dtype_size(p.k.dtype) >= 512 || p.k.dtype != DType::f32; }
  static constexpr int64_t kDotPrefetchKeys = 64;

  // Key rows are transposed in place when they are float32 of whole 8-float groups, value rows read
  // in place when they are float32 of whole vectors; otherwise a block is widened or copied first.
  bool keys_in_place() const {
    return p.k.dtype == DType::f32 && p.dim_qk % (scores_by_dot() ? kLanes : 8) == 0;
  }
  bool values_in_place() const { return p.v.dtype == DType::f32 && p.dim_v % kLanes == 0; }

  struct Scratch {
    float* q;       // [rows][dk] queries, scaled by scale * log2(e)
    float* acc;     // [rows][dv] O, unnormalised
    float* m;       // [rows] running max (base 2)
    float* l;       // [rows][kLanes] running sums, one per lane, added up at the end
    float* alpha;   // [rows] this block's rescaling of O
    float* scores;  // [rows][score_stride()]: the block's (or, in dot mode, the run's) scores, then probabilities
    float* kt;      // [dk8][kKeys] the block's keys transposed: the panel of the score product
    float* kbuf;    // [kKeys][dk] key rows widened or copied
    float* vbuf;    // [kKeys][dv] value rows widened or copied
    float* zero;    // [max(dk, dv)]
    int64_t* lim;   // [rows] keys [0, lim) visible to each query
    uint32_t* key_lo;  // [rows] dropout row keys (core/dropout.hpp)
    uint32_t* key_hi;
    int64_t* active;     // [rows] the rows that see some key of the block, in order
    const float** qrow;  // [rows] their queries
    float** accrow;      // [rows] their accumulators
    const uint32_t** qw_row;  // [rows] pair products: each row's query in place, pairs of dims as words
    const uint32_t** qw;      // [rows] those of the rows that see the block, in order
    const float* kp[kKeys];  // key rows, when scores are dot products
    const float* vp[kKeys];
    const uint16_t* kp16[kKeys];  // bfloat16 or float16 rows read in place (dot mode)
    const uint16_t* vp16[kKeys];
    const uint8_t* kp8[kKeys];  // float8 rows read in place (dot mode)
    const uint8_t* vp8[kKeys];
    // The key (value) row pointers of elements E.
    template <class E> const E** keys_of() {
      if constexpr (std::is_same_v<E, uint8_t>) return kp8;
      else return kp16;
    }
    template <class E> const E** values_of() {
      if constexpr (std::is_same_v<E, uint8_t>) return vp8;
      else return vp16;
    }
    int64_t seen = 0;  // dot mode: keys [j_begin, j_begin + seen) of the last run had their probabilities in `scores`
    bool skipped[kKeysPerRun / kKeys];  // per block of the run from j_begin: excluded for every row (mark_skipped)
  };

  int64_t zeros() const { return std::max(dk(), dv()); }
  // Dot mode keeps a whole run's scores per row (two passes over the run, no online rescaling).
  int64_t score_stride() const { return scores_by_dot() ? kKeysPerRun : kKeys; }

  Scratch allocate(int64_t rows) const {
    const int64_t floats = rows * (dk() + dv() + 2 + kLanes + score_stride()) + dk8() * kKeys + kKeys * (dk() + dv()) + zeros() +
                           14 * rows;  // the last: lim, active, qrow, accrow, qw_row, qw (8 bytes each), the dropout keys
    float* f = static_cast<float*>(thread_scratch(static_cast<size_t>(T::round_up(floats * 4, 64) + 64)));
    Scratch s;
    s.lim = reinterpret_cast<int64_t*>(f), f += 2 * rows;  // first: the buffer's start is aligned for 8 bytes
    s.active = reinterpret_cast<int64_t*>(f), f += 2 * rows;
    s.qrow = reinterpret_cast<const float**>(f), f += 2 * rows;
    s.accrow = reinterpret_cast<float**>(f), f += 2 * rows;
    s.qw_row = reinterpret_cast<const uint32_t**>(f), f += 2 * rows;
    s.qw = reinterpret_cast<const uint32_t**>(f), f += 2 * rows;
    s.kt = f, f += dk8() * kKeys;
    s.scores = f, f += rows * score_stride();
    s.l = f, f += rows * kLanes;
    s.q = f, f += rows * dk();
    s.acc = f, f += rows * dv();
    s.kbuf = f, f += kKeys * dk();
    s.vbuf = f, f += kKeys * dv();
    s.zero = f, f += zeros();
    s.m = f, f += rows;
    s.key_lo = reinterpret_cast<uint32_t*>(f), f += rows;
    s.key_hi = reinterpret_cast<uint32_t*>(f), f += rows;
    s.alpha = f;
    std::memset(s.zero, 0, sizeof(float) * zeros());
    if (!scores_by_dot()) std::memset(s.kt, 0, sizeof(float) * dk8() * kKeys);  // a short block leaves its last columns
    return s;
  }

  // Row j of k (or v) of batch b, head hk, as float32 of `padded` elements: in place, or into dst.
  const float* key_row(const TensorView& t, int64_t b, int64_t hk, int64_t j, int64_t width, int64_t padded,
                       bool in_place, float* dst) const {
    const int64_t offset = p.key_row_offset(t, b, hk, j);
    if (in_place) return t.data_as<float>() + offset;
    if (t.dtype == DType::f32) std::memcpy(dst, t.data_as<float>() + offset, sizeof(float) * width);
    else T::widen(t.dtype, element_address(t.data, t.dtype, offset), dst, width);
    std::fill(dst + width, dst + padded, 0.0f);
    return dst;
  }

  // Row j of a 16- or 8-bit k (or v) of batch b, head hk, in place, as elements E.
  template <class E>
  const E* low_row(const TensorView& t, int64_t b, int64_t hk, int64_t j) const {
    return static_cast<const E*>(element_address(t.data, t.dtype, p.key_row_offset(t, b, hk, j)));
  }

  // kt[d][c] = key j0 + c, element d, for c < nc (rounded up to 8 keys, zero rows past nc) and
  // d < dk8: read in place at the tensor's row stride, or from rows copied into kbuf.
  void transpose_keys(Scratch& s, int64_t b, int64_t hk, int64_t j0, int nc) const {
    const int keys = static_cast<int>(T::round_up(nc, 8));
    const float* src;
    int64_t stride;
    if (keys_in_place() && nc == kKeys && p.key_rows_evenly_spaced(j0, nc)) {
      src = p.k.data_as<float>() + p.key_row_offset(p.k, b, hk, j0);
      stride = p.k.strides[2];
    } else {
      for (int c = 0; c < nc; ++c) key_row(p.k, b, hk, j0 + c, p.dim_qk, dk8(), false, s.kbuf + c * dk8());
      std::fill(s.kbuf + nc * dk8(), s.kbuf + keys * dk8(), 0.0f);
      src = s.kbuf;
      stride = dk8();
    }
    if constexpr (requires { S::transpose8x8(src, int64_t{0}, s.kt, int64_t{0}); }) {
      for (int c = 0; c < keys; c += 8)
        for (int64_t d = 0; d < dk8(); d += 8) S::transpose8x8(src + c * stride + d, stride, s.kt + d * kKeys + c, kKeys);
    } else {
      for (int c = 0; c < keys; ++c)
        for (int64_t d = 0; d < dk8(); ++d) s.kt[d * kKeys + c] = src[c * stride + d];
    }
  }

  // How rows are read: float32, or bfloat16 / float16 / float8 e4m3 widened as they are loaded.
  // Dot mode reads 16-bit rows of whole vectors in place this way, whatever its row count: on AVX2,
  // 0.60-0.73x the time of widening each block into a buffer first at one or two rows, 0.78-1.04x
  // at 4 and 8 (level at worst, so no row threshold); float8 rows up to 4 queries (reads_in_place).
  struct AsF32 {
    using E = float;
    static F load(const float* x) { return S::load(x); }
  };
  struct AsBf16 {
    using E = uint16_t;
    static F load(const uint16_t* x) { return S::load_bf16(x); }
  };
  struct AsF16 {
    using E = uint16_t;
    static F load(const uint16_t* x) { return S::load_f16(x); }
  };
  // float8 rows are read as their values times 2^-8 (the widening without its last multiply):
  // dot mode multiplies its queries by 2^8 for the keys and the output's 1 / l for the values
  // (key_unscale, value_unscale), exactly, as powers of two move no rounding, so the bits are
  // those of widened rows, one multiply per 8 elements fewer (AVX2).
  struct AsF8 {
    using E = uint8_t;
    static F load(const uint8_t* x) { return S::load_f8_over_256(x); }
  };
  // e4m3 rows of a block tested once for NaN bytes (S::f8_rows_free_of_nan): loaded without the
  // test per vector that AsF8 makes (on AVX2 its 4 instructions per 16 elements).
  struct AsF8Finite {
    using E = uint8_t;
    static F load(const uint8_t* x) { return S::load_f8_over_256_finite(x); }
  };
  // float8 e5m2 rows: each byte shifted up is a half, widened as a 16-bit row is.
  struct AsF8E5M2 {
    using E = uint8_t;
    static F load(const uint8_t* x) { return S::load_f8e5m2(x); }
  };
  // fn(loader) for rows of `dtype`: AsF32 unless low-precision rows are read in place.
  template <class Fn>
  static void with_loader(DType dtype, bool in_place_low, Fn fn) {
    if (!in_place_low || dtype == DType::f32) fn(AsF32{});
    else if (dtype == DType::bf16) fn(AsBf16{});
    else if (dtype == DType::f16) fn(AsF16{});
    else if (dtype == DType::f8e5m2) fn(AsF8E5M2{});
    else fn(AsF8{});
  }

  // The scores of one query row against kLanes key rows kp[0..kLanes): per key a vector of partial
  // sums over the head dimension, four keys at a time (independent chains), then each vector's
  // lanes added: by a tree of horizontal adds where the ISA has one (S::sum4), else by transposing
  // the kLanes vectors in memory and adding the rows.
  // `width` (a multiple of kLanes) is the padded row length (dk()); the backward of few rows shares it.
  template <class L>
  static F dot_scores(const typename L::E* const* kp, const float* q, int64_t width) {
    alignas(64) float sums[kLanes * kLanes], turned[kLanes * kLanes];
    for (int c = 0; c < kLanes; c += 4) {
      F a0 = S::zero(), a1 = S::zero(), a2 = S::zero(), a3 = S::zero();
      for (int64_t d0 = 0; d0 < width; d0 += kLanes) {
        const F x = S::load(q + d0);
        a0 = S::fmadd(L::load(kp[c] + d0), x, a0);
        a1 = S::fmadd(L::load(kp[c + 1] + d0), x, a1);
        a2 = S::fmadd(L::load(kp[c + 2] + d0), x, a2);
        a3 = S::fmadd(L::load(kp[c + 3] + d0), x, a3);
      }
      if constexpr (kSum4) {
        S::sum4(a0, a1, a2, a3, turned + c);
      } else {
        S::store(sums + c * kLanes, a0);
        S::store(sums + (c + 1) * kLanes, a1);
        S::store(sums + (c + 2) * kLanes, a2);
        S::store(sums + (c + 3) * kLanes, a3);
      }
    }
    if constexpr (kSum4) return S::load(turned);
    T::transpose_square(sums, turned);
    F total = S::load(turned);
    for (int r = 1; r < kLanes; ++r) total = S::add(total, S::load(turned + r * kLanes));
    return total;
  }

  // dot_scores of R query rows (q, rows q_stride apart) into out (rows out_stride apart), where
  // the SIMD layer has room for only one row of four keys' chains (AVX2: kScoreRows 1): K = 4 / R
  // keys at a time against all R rows, so that each key vector is loaded, and widened, once for
  // them. Each key's chain over the head dimension and its sum (its place in S::sum4's tree of
  // adds is the same whichever four vectors it sums) are dot_scores', so the same bits.
  template <class L, int R>
  static void dot_scores_grid(const typename L::E* const* kp, const float* q, int64_t q_stride, int64_t width,
                              float* out, int64_t out_stride) {
    static_assert(kSum4 && 4 % R == 0, "four chains summed by a tree of horizontal adds in registers");
    constexpr int K = 4 / R;
    alignas(16) float sums[4];
    for (int c = 0; c < kLanes; c += K) {
      F a[R][K];
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < K; ++k) a[r][k] = S::zero();
      for (int64_t d0 = 0; d0 < width; d0 += kLanes) {
        F key[K];
        for (int k = 0; k < K; ++k) key[k] = L::load(kp[c + k] + d0);
        for (int r = 0; r < R; ++r) {
          const F x = S::load(q + r * q_stride + d0);
          for (int k = 0; k < K; ++k) a[r][k] = S::fmadd(key[k], x, a[r][k]);
        }
      }
      const F* chains = &a[0][0];  // row-major: chain r * K + k is row r's against key c + k
      S::sum4(chains[0], chains[1], chains[2], chains[3], sums);
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < K; ++k) out[r * out_stride + c + k] = sums[r * K + k];
    }
  }

  // The scores of R query rows (q, rows q_stride apart) against kLanes key rows, into out (rows
  // out_stride apart): for each row the chains and sums of dot_scores, so the same bits.
  template <class L, int R>
  static void dot_scores_rows(const typename L::E* const* kp, const float* q, int64_t q_stride, int64_t width,
                              float* out, int64_t out_stride, int c_begin, int c_end) {
    static_assert(kSum4, "rows of scores are summed in registers");
    for (int c = c_begin; c < c_end; c += 4) {
      F a[R][4];
      for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = S::zero();
      for (int64_t d0 = 0; d0 < width; d0 += kLanes) {
        const F k0 = L::load(kp[c] + d0), k1 = L::load(kp[c + 1] + d0), k2 = L::load(kp[c + 2] + d0),
                k3 = L::load(kp[c + 3] + d0);
        for (int r = 0; r < R; ++r) {
          const F x = S::load(q + r * q_stride + d0);
          a[r][0] = S::fmadd(k0, x, a[r][0]);
          a[r][1] = S::fmadd(k1, x, a[r][1]);
          a[r][2] = S::fmadd(k2, x, a[r][2]);
          a[r][3] = S::fmadd(k3, x, a[r][3]);
        }
      }
      for (int r = 0; r < R; ++r) S::sum4(a[r][0], a[r][1], a[r][2], a[r][3], out + r * out_stride + c);
    }
  }
  // With pair products: the scores of R query rows (bfloat16 rows in place, as words) against
  // kLanes bfloat16 key rows, each sum times `scale`, into out (rows out_stride apart).
  template <int R>
  static void dot_pair_scores_rows(const uint16_t* const* kp, const uint32_t* const* qw, int64_t words, float scale,
                                   float* out, int64_t out_stride, int c_begin, int c_end) {
    if constexpr (kPairs) {
      for (int c = c_begin; c < c_end; c += 4) {
        F a[R][4];
        for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = S::zero();
        for (int64_t w0 = 0; w0 < words; w0 += kLanes) {
          const int64_t n = words - w0;
          const auto k0 = S::load_words(kp[c] + 2 * w0, n), k1 = S::load_words(kp[c + 1] + 2 * w0, n),
                     k2 = S::load_words(kp[c + 2] + 2 * w0, n), k3 = S::load_words(kp[c + 3] + 2 * w0, n);
          for (int r = 0; r < R; ++r) {
            const auto x = S::load_words(reinterpret_cast<const uint16_t*>(qw[r] + w0), n);
            a[r][0] = S::dot_pairs(k0, x, a[r][0]);
            a[r][1] = S::dot_pairs(k1, x, a[r][1]);
            a[r][2] = S::dot_pairs(k2, x, a[r][2]);
            a[r][3] = S::dot_pairs(k3, x, a[r][3]);
          }
        }
        for (int r = 0; r < R; ++r) S::sum4(a[r][0], a[r][1], a[r][2], a[r][3], out + r * out_stride + c);
      }
      if (c_begin == 0 && c_end == kLanes) {
        for (int r = 0; r < R; ++r) S::store(out + r * out_stride, S::mul(S::load(out + r * out_stride), S::set1(scale)));
      } else {  // (the same products, a lane at a time)
        for (int r = 0; r < R; ++r)
          for (int c = c_begin; c < c_end; ++c) out[r * out_stride + c] *= scale;
      }
    }
  }
  // out[r][0, kLanes) = scale * sum_w qw[r][w] . kt[w][0, kLanes) for `rows` rows (rows of out
  // out_stride apart): the scores of 16 keys transposed as pairs (kt, `words` deep), a row's sum
  // over the words in order, whichever rows share its register block.
  static void panel_pair_scores(const uint32_t* const* qw, int64_t rows, const uint32_t* kt, int64_t words, float scale,
                                float* out, int64_t out_stride) {
    if constexpr (kPairs) {
      for_row_blocks(rows, [&](auto r, int64_t r0) {
        constexpr int R = r();
        F a[R];
        for (int i = 0; i < R; ++i) a[i] = S::zero();
        for (int64_t w = 0; w < words; ++w) {
          const auto k = S::load_w(kt + w * kLanes);
          for (int i = 0; i < R; ++i) a[i] = S::dot_pairs(S::broadcast_w(qw[r0 + i] + w), k, a[i]);
        }
        for (int i = 0; i < R; ++i) S::store(out + (r0 + i) * out_stride, S::mul(a[i], S::set1(scale)));
      });
    }
  }
  // fn(R, qi) over the rows [0, rows) in blocks of R = kScoreRows rows from qi, then one block of
  // the 1-3 left (R a compile-time constant).
  template <class Fn>
  static void for_score_rows(int64_t rows, Fn fn) {
    int64_t qi = 0;
    for (; qi + kScoreRows <= rows; qi += kScoreRows) fn(std::integral_constant<int, kScoreRows>{}, qi);
    if (rows - qi == 1) fn(std::integral_constant<int, 1>{}, qi);
    else if (rows - qi == 2) fn(std::integral_constant<int, 2>{}, qi);
    else if (rows - qi == 3) fn(std::integral_constant<int, 3>{}, qi);
  }
  static void dot_pair_scores_all(const uint16_t* const* kp, const uint32_t* const* qw, int64_t words, float scale,
                                  int64_t rows, float* out, int64_t out_stride, int c_begin, int c_end) {
    for_score_rows(rows, [&](auto r, int64_t qi) {
      dot_pair_scores_rows<r()>(kp, qw + qi, words, scale, out + qi * out_stride, out_stride, c_begin, c_end);
    });
  }
  // Every row's scores against key rows [c_begin, c_end) of kLanes (whole groups of 4; all of them
  // where kScoreRows is 1): blocks of kScoreRows rows, then the rest.
  template <class L>
  static void dot_scores_all(const typename L::E* const* kp, const float* q, int64_t q_stride, int64_t width,
                             int64_t rows, float* out, int64_t out_stride, int c_begin, int c_end) {
    if constexpr (kScoreRows == 1) {
      // Rows read in place are widened as loaded: blocks of 4 rows, then 2, share each widening
      // (Zen 3, bf16 B=8 S=4096 d=128, 8 key/value heads, five alternating runs: 2 rows per head
      // 0.74-0.97x the time of one row at a time, 4 rows 0.62-1.0x, 8 rows 0.78-0.89x). float32
      // rows, loaded and not widened, measured level either way (four runs).
      int64_t qi = 0;
      if constexpr (kSum4 && !std::is_same_v<L, AsF32>) {
        for (; qi + 4 <= rows; qi += 4)
          dot_scores_grid<L, 4>(kp, q + qi * q_stride, q_stride, width, out + qi * out_stride, out_stride);
        for (; qi + 2 <= rows; qi += 2)
          dot_scores_grid<L, 2>(kp, q + qi * q_stride, q_stride, width, out + qi * out_stride, out_stride);
      }
      for (; qi < rows; ++qi) S::store(out + qi * out_stride, dot_scores<L>(kp, q + qi * q_stride, width));
    } else {
      for_score_rows(rows, [&](auto r, int64_t qi) {
        dot_scores_rows<L, r()>(kp, q + qi * q_stride, q_stride, width, out + qi * out_stride, out_stride, c_begin, c_end);
      });
    }
  }

  // Asks for rows [j0, j0 + count) of head (b, hk) of k or v ahead of their block: a decoding step
  // streams the cache from memory, and its blocks read rows in 8-row and vector-wide slices that
  // the hardware prefetchers follow less well (steps at S=4096 d=128 took 1.1-1.3x the time without).
  [[gnu::always_inline]] void prefetch_rows(const TensorView& t, int64_t b, int64_t hk, int64_t j0, int64_t count) const {
    const int64_t size = dtype_size(t.dtype), row_bytes = t.shape[3] * size, stride = t.strides[2] * size;
    if (!p.key_rows_evenly_spaced(j0, count)) {  // across pages: each row's own address
      for (int64_t c = 0; c < count; ++c) {
        const char* row = static_cast<const char*>(t.data) + p.key_row_offset(t, b, hk, j0 + c) * size;
        for (int64_t x = 0; x < row_bytes; x += 64) __builtin_prefetch(row + x);
      }
      return;
    }
    const char* rows = static_cast<const char*>(t.data) + p.key_row_offset(t, b, hk, j0) * size;
    for (int64_t c = 0; c < count; ++c)
      for (int64_t x = 0; x < row_bytes; x += 64) __builtin_prefetch(rows + c * stride + x);
  }

  // Share `part` of `parts` of rows [j0, j0 + count) of heads [hk0, hk0 + heads) of k or v, heads
  // whose rows lie side by side at each key: the block asked for in address order over a sweep's
  // steps (sweep_keys says what that gained).
  [[gnu::always_inline]] void prefetch_share(const TensorView& t, int64_t b, int64_t hk0, int64_t heads, int64_t j0,
                                             int64_t count, int64_t part, int64_t parts) const {
    const int64_t size = dtype_size(t.dtype), bytes = heads * t.shape[3] * size, lines = count * ((bytes + 63) / 64);
    const int64_t line_begin = lines * part / parts, line_end = lines * (part + 1) / parts;
    const int64_t per_row = (bytes + 63) / 64;
    int64_t c = line_begin / per_row, x = line_begin - c * per_row;  // row c, its line x
    for (int64_t n = line_end - line_begin; n > 0; ++c, x = 0) {
      const char* row = static_cast<const char*>(t.data) + p.key_row_offset(t, b, hk0, j0 + c) * size;
      for (; x < per_row && n > 0; ++x, --n) __builtin_prefetch(row + x * 64);
    }
  }

  // fn(integral_constant<R>, r0) over `rows` rows in register blocks of kBlockRows, the last one short.
  template <class Fn>
  static void for_row_blocks(int64_t rows, Fn fn) {
    int64_t r0 = 0;
    for (; r0 + kBlockRows <= rows; r0 += kBlockRows) fn(std::integral_constant<int, kBlockRows>{}, r0);
    const int rest = static_cast<int>(rows - r0);
    [&]<int... R>(std::integer_sequence<int, R...>) {
      ((rest == R + 1 ? fn(std::integral_constant<int, R + 1>{}, r0) : void()), ...);
    }(std::make_integer_sequence<int, kBlockRows - 1>{});
  }

  // acc_r[c0..] = alpha_r acc_r[c0..] + sum_{j < nc} prob_r[j] v_j[c0..] for R rows and V vectors,
  // prob_r at prob + r * stride.
  template <int R, int V, class L = AsF32>
  static void accumulate_values(float* const* acc, const float* prob, int64_t stride, const float* alpha,
                                const typename L::E* const* vp, int nc, int64_t c0) {
    F a[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) a[r][v] = S::mul(S::load(acc[r] + c0 + v * kLanes), S::set1(alpha[r]));
    int j = 0;
    do {  // nc >= 1; a loop that runs at least once keeps the accumulators in registers (tile_kernels.hpp)
      F w[V];
      for (int v = 0; v < V; ++v) w[v] = L::load(vp[j] + c0 + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const F x = S::set1(prob[r * stride + j]);
        for (int v = 0; v < V; ++v) a[r][v] = S::fmadd(x, w[v], a[r][v]);
      }
    } while (++j < nc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) S::store(acc[r] + c0 + v * kLanes, a[r][v]);
  }

  // The online softmax of packed row a (query qi of head h, position i) over the block's scores:
  // masks added, keys past the query's limit at -inf; leaves the probabilities in the row, updates
  // m and the lane sums, and the factor that rescales O in alpha.
  void softmax_row(Scratch& s, int64_t a, int64_t qi, int64_t b, int64_t h, int64_t i, int64_t j0, int nc) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    float* row = s.scores + a * kKeys;
    const int visible = static_cast<int>(std::min<int64_t>(nc, s.lim[qi] - j0));  // >= 1: the row is active
    const int nv = (nc + kLanes - 1) / kLanes;
    F x[T::kVecs];
    bool nan = false;
    F top = S::set1(neg_inf);
    const Softcap<S> cap(p);
    for (int v = 0; v < nv; ++v) x[v] = S::load(row + v * kLanes);
    if (cap.on && nv > 0) {  // one map for the row's vectors (no test per vector: cpu/softcap.hpp)
      F least = S::zero(), greatest = S::zero();  // (0 stands in for the lanes past nc: under any cap)
      for (int v = 0; v < nv; ++v) {
        const int cols = std::min(kLanes, nc - v * kLanes);
        const F scores = S::select(first_lanes(cols), x[v], S::zero());
        least = S::min(least, scores), greatest = S::max(greatest, scores);
      }
      cap.with_map(least, greatest, [&](auto map) {
        for (int v = 0; v < nv; ++v) x[v] = map(x[v], nullptr);
      });
    }
    for (int v = 0; v < nv; ++v) {
      const int cols = std::min(kLanes, nc - v * kLanes);
      for (int t = 0; t < p.num_masks; ++t) x[v] = S::add(x[v], T::mask_row(p.masks[t], b, h, i, j0 + v * kLanes, cols));
      const int keep = std::clamp(visible - v * kLanes, 0, kLanes);
      x[v] = S::select(first_lanes(keep), x[v], S::set1(neg_inf));
      nan = nan || !S::all(S::eq(x[v], x[v]));
      top = S::max(top, x[v]);
    }
    const float m_old = s.m[qi];
    const float m_new = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(m_old, S::reduce_max(top));
    // A query that has seen only -inf keeps m = -inf; subtracting 0 instead makes its p 0, not NaN.
    const float m_use = m_new == neg_inf ? 0.0f : m_new;
    alignas(64) float lane[kLanes];
    S::store(lane, S::exp2(S::set1(m_old - m_use)));
    s.alpha[a] = lane[0];
    F sum = S::mul(S::load(s.l + qi * kLanes), S::set1(lane[0]));
    for (int v = 0; v < nv; ++v) {
      const F pr = S::exp2(S::sub(x[v], S::set1(m_use)));
      sum = S::add(sum, pr);
      S::store(row + v * kLanes, p.dropout_p > 0 ? dropped(s, qi, j0 + v * kLanes, pr) : pr);
    }
    S::store(s.l + qi * kLanes, sum);
    s.m[qi] = m_new;
  }

  // O += P V for the n rows accrow[0..n) (scaled first by alpha) over nc value rows vp[0..nc),
  // the probabilities of row r at prob + r * stride.
  template <class L = AsF32>
  void accumulate_rows(const Scratch& s, int64_t n, const float* prob, int64_t stride, int nc,
                       const typename L::E* const* vp) const {
    const int vecs_v = static_cast<int>(dv() / kLanes);
    for_row_blocks(n, [&](auto r, int64_t r0) {
      int c = 0;
      if constexpr (r() <= 2)  // a row's 4 vectors (a cache line each) at once, read whole
        for (; c + 4 <= vecs_v; c += 4)
          accumulate_values<r(), 4, L>(s.accrow + r0, prob + r0 * stride, stride, s.alpha + r0, vp, nc, c * kLanes);
      for (; c + kBlockVecs <= vecs_v; c += kBlockVecs)
        accumulate_values<r(), kBlockVecs, L>(s.accrow + r0, prob + r0 * stride, stride, s.alpha + r0, vp, nc, c * kLanes);
      // Two vectors left (Dv = 128 on AVX-512) in one block: one vector at a time, each
      // probability's broadcast served a single multiply-add (dv=128 rows ran 1.25x slower per vector).
      if constexpr (kBlockVecs > 2)
        if (c + 2 == vecs_v)
          accumulate_values<r(), 2, L>(s.accrow + r0, prob + r0 * stride, stride, s.alpha + r0, vp, nc, c * kLanes), c += 2;
      for (; c < vecs_v; ++c)
        accumulate_values<r(), 1, L>(s.accrow + r0, prob + r0 * stride, stride, s.alpha + r0, vp, nc, c * kLanes);
    });
  }

  // Dropout after the softmax, with the mask of core/dropout.hpp (a function of seed, row and key,
  // so every kernel and the reference draw the same): probabilities pr of keys [j, j + kLanes) of
  // row qi kept and scaled by 1 / (1 - p), or zeroed. The row's sum is taken before, from pr: the
  // softmax normalises over every key, and dropout acts on its result (as the weights returned show).
  F dropped(const Scratch& s, int64_t qi, int64_t j, F pr) const {
    const U bits = T::dropout_bits(T::lane_indices(j), S::set1_u(s.key_lo[qi]), S::set1_u(s.key_hi[qi]));
    const M keep = S::ge_u(bits, S::set1_u(dropout_threshold(p.dropout_p)));
    return S::select(keep, S::mul(pr, S::set1(static_cast<float>(1.0 / (1.0 - p.dropout_p)))), S::zero());
  }

  // Row qi's queries (scaled; with pair products, the bfloat16 row in place, unscaled), zero O and
  // sums, m = -inf and its key limit, for rows [r_begin, r_end) of key/value head (b, hk) over keys
  // [j_begin, j_end); returns the end of the keys any row sees.
  int64_t start_rows(Scratch& s, int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t j_begin,
                     int64_t j_end, bool pairs = false) const {
    const float qscale = static_cast<float>(p.scale) * p.key_descale(b, hk) * kLog2e;
    int64_t key_end = j_begin;
    for (int64_t qi = 0; qi < r_end - r_begin; ++qi) {
      const int64_t h = hk * group() + (r_begin + qi) / p.len_q, i = (r_begin + qi) % p.len_q;
      const int64_t offset = b * p.q.strides[0] + h * p.q.strides[1] + i * p.q.strides[2];
      if (pairs) {
        s.qw_row[qi] = reinterpret_cast<const uint32_t*>(p.q.data_as<const uint16_t>() + offset);
      } else {
        float* q = s.q + qi * dk();
        if (p.q.dtype == DType::f32) std::memcpy(q, p.q.data_as<float>() + offset, sizeof(float) * p.dim_qk);
        else T::widen(p.q.dtype, element_address(p.q.data, p.q.dtype, offset), q, p.dim_qk);
        for (int64_t d = 0; d < p.dim_qk; ++d) q[d] *= qscale;
        if (const float unscale = key_unscale(); unscale != 1.0f)
          for (int64_t d = 0; d < p.dim_qk; ++d) q[d] *= unscale;
        std::fill(q + p.dim_qk, q + dk(), 0.0f);
      }
      std::fill(s.acc + qi * dv(), s.acc + (qi + 1) * dv(), 0.0f);
      std::fill(s.l + qi * kLanes, s.l + (qi + 1) * kLanes, 0.0f);
      s.m[qi] = -std::numeric_limits<float>::infinity();
      s.lim[qi] = std::min(p.causal_end(i), j_end);
      if (p.dropout_p > 0) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
        s.key_lo[qi] = key.lo, s.key_hi[qi] = key.hi;
      }
      key_end = std::max(key_end, s.lim[qi]);
    }
    return key_end;
  }

  int64_t key_blocks() const { return (p.len_k + kKeys - 1) / kKeys; }

  // Whether every row of rows [r_begin, r_end) of key/value head (b, hk) has key block kb (keys
  // from kb * kKeys) excluded by some mask term, or swamped where all the head's rows see an
  // ordinary key. The rows of a head share its maps: a map covers every query of a slice.
  bool block_excluded(int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t kb) const {
    const int64_t h_end = hk * group() + (r_end - 1) / p.len_q + 1;
    for (int64_t h = hk * group() + r_begin / p.len_q; h < h_end; ++h) {
      bool any = false;
      for (int t = 0; t < p.num_masks && !any; ++t) {
        const uint8_t* map = excluded.maps[t];
        const uint8_t what = map ? map[mask_slice(p.masks[t], p.heads_q, b, h) * key_blocks() + kb] : kKept;
        any = what == kExcluded || (what == kSwamped && excluded.ordinary.all(b, h, 0, p.len_q));
      }
      if (!any) return false;
    }
    return true;
  }

  // s.skipped for the blocks of keys [j_begin, key_end) (j_begin a multiple of kKeys).
  void mark_skipped(Scratch& s, int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t j_begin,
                    int64_t key_end) const {
    const bool maps = std::any_of(excluded.maps.begin(), excluded.maps.end(), [](const uint8_t* m) { return m; });
    for (int64_t j0 = j_begin; j0 < key_end; j0 += kKeys)
      s.skipped[(j0 - j_begin) / kKeys] = maps && block_excluded(b, hk, r_begin, r_end, j0 / kKeys);
  }

  // The maps of ExcludedBlocks, in `storage`. A term that does not vary along the queries (or
  // with one query per head) is scanned per key block; others per block over all the queries.
  ExcludedBlocks excluded_blocks(int threads, std::vector<Tensor>& storage) const {
    ExcludedBlocks blocks;
    blocks.done = true;
    for (int t = 0; t < p.num_masks; ++t) {
      MaskTerm m = p.masks[t];
      if (p.len_q == 1) m.strides[2] = 0;  // (query 0 only: the same term)
      blocks.maps[t] = m.strides[2] == 0 ? excluded_key_blocks<S>(p, m, kKeys, threads, storage, true)
                                         : excluded_tiles<S>(p, m, p.len_q, kKeys, threads, storage, true);
    }
    blocks.ordinary = ordinary_rows(p, threads, storage);
    return blocks;
  }

  // The rows that see a key of the block at j0 (causality), packed: their indices, accumulators
  // and queries (the scaled float32 copies, or with pair products the rows in place); returns
  // their count.
  int64_t active_rows(Scratch& s, int64_t rows, int64_t j0, bool pairs) const {
    int64_t n = 0;
    for (int64_t qi = 0; qi < rows; ++qi) {
      if (j0 >= s.lim[qi]) continue;
      s.active[n] = qi;
      if (pairs) s.qw[n] = s.qw_row[qi];
      else s.qrow[n] = s.q + qi * dk();
      s.accrow[n++] = s.acc + qi * dv();
    }
    return n;
  }

  // The panel schedule's keys and values of the block after j0 (unless it is past key_end or
  // skipped) asked for ahead, where prefetches() says so.
  void prefetch_next_block(const Scratch& s, int64_t b, int64_t hk, int64_t j0, int64_t j_begin, int64_t key_end) const {
    const int64_t next = j0 + kKeys;
    if (!prefetches() || next >= key_end || s.skipped[(next - j_begin) / kKeys]) return;
    prefetch_rows(p.k, b, hk, next, std::min<int64_t>(kKeys, key_end - next));
    prefetch_rows(p.v, b, hk, next, std::min<int64_t>(kKeys, key_end - next));
  }

  // Keys [j_begin, j_end) for rows [r_begin, r_end) of key/value head (b, hk). Leaves O, m and the
  // lane sums of each row in the scratch, indexed from r_begin.
  void run_keys(Scratch& s, int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t j_begin,
                int64_t j_end) const {
    if (scores_by_dot()) return run_keys_by_dot(s, b, hk, r_begin, r_end, j_begin, j_end);
    if constexpr (kPairs)
      if (takes_pairs(p)) return run_keys_by_pairs(s, b, hk, r_begin, r_end, j_begin, j_end);
    const int64_t rows = r_end - r_begin;
    const int64_t key_end = start_rows(s, b, hk, r_begin, r_end, j_begin, j_end);
    mark_skipped(s, b, hk, r_begin, r_end, j_begin, key_end);
    const bool v_in_place = values_in_place();
    for (int64_t j0 = j_begin; j0 < key_end; j0 += kKeys) {
      if (s.skipped[(j0 - j_begin) / kKeys]) continue;
      const int nc = static_cast<int>(std::min<int64_t>(kKeys, key_end - j0));
      const int64_t n = active_rows(s, rows, j0, false);
      prefetch_next_block(s, b, hk, j0, j_begin, key_end);
      transpose_keys(s, b, hk, j0, nc);
      for (int c = 0; c < nc; ++c) s.vp[c] = key_row(p.v, b, hk, j0 + c, p.dim_v, dv(), v_in_place, s.vbuf + c * dv());
      const int vecs = T::round_up(T::vecs_for(nc), kBlockVecs);  // (whole register blocks: s.scores is kKeys wide)
      for_row_blocks(n, [&](auto r, int64_t r0) {
        for (int c0 = 0; c0 < vecs; c0 += kBlockVecs)
          T::template dot_rows_block<r()>(s.scores + r0 * kKeys, s.qrow + r0, s.kt, p.dim_qk, c0);
      });
      for (int64_t a = 0; a < n; ++a) {
        const int64_t row = r_begin + s.active[a];
        softmax_row(s, a, s.active[a], b, hk * group() + row / p.len_q, row % p.len_q, j0, nc);
      }
      // O = alpha O + P V: every key of the block, a zero weight too (0 x inf is NaN, as in P @ V).
      accumulate_rows(s, n, s.scores, kKeys, nc, s.vp);
    }
  }

  // The panel schedule over bfloat16 pairs (takes_pairs). Per block of 48 keys: K^T as pairs of
  // dims per key (16 x 16 word transposes of the rows in place, or of a copy where the block
  // crosses pages), each query row read in place as pairs of dims and broadcast against it, the
  // sums times the scale (a scaled bfloat16 would round again); the float32 softmax of
  // softmax_row; P rounded to bfloat16 over its own row, so that pairs of keys are words, each
  // broadcast against the block's values copied as pairs of keys per column. Half the products'
  // instructions of the float32 schedule, and no widening of the keys and values. P rounded to
  // bfloat16 (2^-9) is what the tile kernel's pair products and the AMX kernel round too: the
  // outputs are within bfloat16 rounding of the float32 schedule's, not its bits. Streaming a
  // cache from memory it ran at 1.75x its time in L3 (32 rows, d=128, Zen 5): the transposes read
  // 16 rows at a time in 32-byte pieces, which the hardware prefetchers do not follow, and the next
  // block's prefetches (to L1 or L2, one to three blocks ahead, spread or not) recovered little.
  void run_keys_by_pairs(Scratch& s, int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t j_begin,
                         int64_t j_end) const {
    const int64_t rows = r_end - r_begin;
    const int64_t key_end = start_rows(s, b, hk, r_begin, r_end, j_begin, j_end, true);
    mark_skipped(s, b, hk, r_begin, r_end, j_begin, key_end);
    const int64_t words = p.dim_qk / 2;
    const F qk_scale = S::set1(static_cast<float>(p.scale) * p.key_descale(b, hk) * kLog2e);
    auto* kt = reinterpret_cast<uint32_t*>(s.kt);           // [words][kKeys] (dk8 >= words)
    auto* values = reinterpret_cast<uint32_t*>(s.vbuf);     // [kKeys / 2][dv] pairs of keys per column
    for (int64_t j0 = j_begin; j0 < key_end; j0 += kKeys) {
      if (s.skipped[(j0 - j_begin) / kKeys]) continue;
      const int nc = static_cast<int>(std::min<int64_t>(kKeys, key_end - j0));
      const int64_t n = active_rows(s, rows, j0, true);
      prefetch_next_block(s, b, hk, j0, j_begin, key_end);
      transpose_key_pairs(s, b, hk, j0, nc, kt, kKeys);
      const int pairs = (nc + 1) / 2;  // (an odd block's last pair: its second key zero, its p zero)
      for (int r = 0; r < pairs; ++r) {
        const uint16_t* first = low_row<uint16_t>(p.v, b, hk, j0 + 2 * r);
        const uint16_t* second = 2 * r + 1 < nc ? low_row<uint16_t>(p.v, b, hk, j0 + 2 * r + 1) : nullptr;
        for (int64_t d = 0; d < dv(); d += kLanes) S::store_w(values + r * dv() + d, S::interleave_rows(first, second, d, p.dim_v));
      }
      const int vecs = T::round_up(T::vecs_for(nc), kBlockVecs);  // (whole register blocks: s.scores is kKeys wide)
      for_row_blocks(n, [&](auto r, int64_t r0) {
        for (int c0 = 0; c0 < vecs; c0 += kBlockVecs)
          T::template dot_rows_block<r(), kBlockVecs, uint32_t>(s.scores + r0 * kKeys, s.qw + r0, kt, words, c0, qk_scale);
      });
      for (int64_t a = 0; a < n; ++a) {
        const int64_t row = r_begin + s.active[a];
        softmax_row(s, a, s.active[a], b, hk * group() + row / p.len_q, row % p.len_q, j0, nc);
        S::narrow_in_place(s.scores + a * kKeys, T::vecs_for(nc));  // (keys past nc: p = 0)
      }
      // O = alpha O + P V over pairs of keys: every key of the block, a zero weight too.
      accumulate_pairs(s, n, reinterpret_cast<const uint32_t*>(s.scores), kKeys, pairs, values);
    }
  }

  // Keys [j0, j0 + nc) of head (b, hk) as pairs of dims: kt[w * width + c] = word w of key j0 + c
  // (zero from nc to width, a multiple of 16), from the rows in place where they are evenly spaced,
  // else (a block across pages) from copies in s.kbuf.
  void transpose_key_pairs(Scratch& s, int64_t b, int64_t hk, int64_t j0, int nc, uint32_t* kt, int64_t width) const {
    const int64_t words = p.dim_qk / 2;
    if (p.key_rows_evenly_spaced(j0, nc)) {
      S::transpose_pairs(low_row<uint16_t>(p.k, b, hk, j0), p.k.strides[2], nc, words, kt, width);
      return;
    }
    auto* copied = reinterpret_cast<uint16_t*>(s.kbuf);  // [kKeys][Dk] a block's key rows across pages
    for (int c = 0; c < nc; ++c) std::memcpy(copied + c * p.dim_qk, low_row<uint16_t>(p.k, b, hk, j0 + c), 2 * p.dim_qk);
    S::transpose_pairs(copied, p.dim_qk, nc, words, kt, width);
  }

  // O = alpha O + P V for the n rows accrow[0..n) (scaled first by alpha), over `pairs` pairs of
  // keys: P's as words (row r's at prob + r * stride), the values' as rows of dv() words (pairs of
  // keys per column). Register blocks as accumulate_rows'.
  void accumulate_pairs(const Scratch& s, int64_t n, const uint32_t* prob, int64_t stride, int pairs,
                        const uint32_t* values) const {
    const int vecs_v = static_cast<int>(dv() / kLanes);
    for_row_blocks(n, [&](auto r, int64_t r0) {
      auto block = [&](auto v, int c) {
        constexpr int V = decltype(v)::value;
        value_pairs<r(), V>(s.accrow + r0, prob + r0 * stride, stride, s.alpha + r0, pairs, c * kLanes,
                            [&](int j, int64_t c0, typename S::W* w) {
                              for (int i = 0; i < V; ++i) w[i] = S::load_w(values + j * dv() + c0 + i * kLanes);
                            });
      };
      int c = 0;
      if constexpr (r() <= 2)
        for (; c + 4 <= vecs_v; c += 4) block(std::integral_constant<int, 4>{}, c);
      for (; c + kBlockVecs <= vecs_v; c += kBlockVecs) block(std::integral_constant<int, kBlockVecs>{}, c);
      if constexpr (kBlockVecs > 2)
        if (c + 2 == vecs_v) block(std::integral_constant<int, 2>{}, c), c += 2;
      for (; c < vecs_v; ++c) block(std::integral_constant<int, 1>{}, c);
    });
  }

  // O += P V for the n rows accrow[0..n) over `count` bfloat16 value rows vrows[0..count), read in
  // place: each pair of rows interleaved in registers (pairs of keys per word) for each register
  // block of rows, P's as words (row r's at prob + r * stride, a zero past count). Dot mode's
  // pass (its alpha is 1). Even vectors per block, as the interleaves give them in twos.
  void accumulate_pairs_in_place(const Scratch& s, int64_t n, const uint32_t* prob, int64_t stride, int count,
                                 const uint16_t* const* vrows) const {
    const int vecs_v = static_cast<int>(dv() / kLanes);
    for_row_blocks(n, [&](auto r, int64_t r0) {
      auto block = [&](auto v, int c) {
        constexpr int V = decltype(v)::value;
        static_assert(V == 1 || V % 2 == 0, "interleaves come in twos");
        value_pairs<r(), V>(s.accrow + r0, prob + r0 * stride, stride, nullptr, (count + 1) / 2, c * kLanes,
                            [&](int j, int64_t c0, typename S::W* w) {
                              const uint16_t* first = vrows[2 * j];
                              const uint16_t* second = 2 * j + 1 < count ? vrows[2 * j + 1] : nullptr;  // (its p is 0)
                              if constexpr (V == 1) {
                                w[0] = S::interleave_rows(first, second, c0, p.dim_v);
                              } else {
                                for (int i = 0; i < V; i += 2)
                                  S::interleave_rows(first, second, c0 + i * kLanes, p.dim_v, &w[i], &w[i + 1]);
                              }
                            });
      };
      constexpr int kVecs = r() <= 4 ? 4 : 2;  // (R x V accumulators, V pairs and a broadcast in 32 registers)
      int c = 0;
      for (; c + kVecs <= vecs_v; c += kVecs) block(std::integral_constant<int, kVecs>{}, c);
      if (c + 2 <= vecs_v) block(std::integral_constant<int, 2>{}, c), c += 2;
      if (c < vecs_v) block(std::integral_constant<int, 1>{}, c);
    });
  }

  // The register block of both: O = alpha O + P V for R rows (alpha null: 1) and V vectors of
  // columns from c0, over `pairs` pairs of keys (at least one), pair j's value words from
  // pair_words(j, c0, w).
  template <int R, int V, class PairWords>
  void value_pairs(float* const* acc, const uint32_t* prob, int64_t stride, const float* alpha, int pairs, int64_t c0,
                   PairWords pair_words) const {
    F a[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) a[r][v] = S::load(acc[r] + c0 + v * kLanes);
    if (alpha)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) a[r][v] = S::mul(a[r][v], S::set1(alpha[r]));
    int j = 0;
    do {
      typename S::W w[V];
      pair_words(j, c0, w);
      for (int r = 0; r < R; ++r) {
        const auto x = S::broadcast_w(prob + r * stride + j);
        for (int v = 0; v < V; ++v) a[r][v] = S::dot_pairs(x, w[v], a[r][v]);
      }
    } while (++j < pairs);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) S::store(acc[r] + c0 + v * kLanes, a[r][v]);
  }

  // Dot mode: up to kDotRows rows, each score a dot product of whole rows, in passes over the run
  // rather than an online softmax per block: every score of the run, then per row its masks, max,
  // probabilities and sum, then O = P V with the accumulators held across each slice of value
  // rows. With so few rows the per-block rescaling and reductions cost more than the products.
  void run_keys_by_dot(Scratch& s, int64_t b, int64_t hk, int64_t r_begin, int64_t r_end, int64_t j_begin,
                       int64_t j_end) const {
    run_heads_by_dot(&s, 1, b, hk, r_begin, r_end, j_begin, j_end);
  }

  // Keys of one head per step of a sweep over heads that lie side by side at each key ([B, S, H,
  // D] caches, paged ones too): about 2 KiB of its rows (4, 8 or 16 keys; the whole block where
  // kScoreRows is 1), then the next head's, with the rows ahead asked for in address order (prefetch_share),
  // from rows of 256 bytes. A head's whole block of 16 keys at a time (16 rows a head-stride
  // apart, prefetched head by head) took 1.19x the time of a packed cache's step (Zen 5, bf16 B=8
  // H=32/8 S=4096 d=128, one page per sequence), 1.39x with pages of 16. Against that, one decoding
  // step at S=4096, Hkv=8, pages of 16 (medians of 5 alternating runs): bf16 d=128 0.83x the time
  // (one page per sequence 0.86x), d=256 0.76x,
  // 8 rows per head 0.97x, MHA 0.74x; fp32 d=64 0.90x, d=128 0.70x. Rows of 128 bytes (bf16
  // d=64) took 1.1x the time in steps of 16 keys prefetched in address order: they keep whole
  // blocks, prefetched head by head.
  int sweep_keys(const TensorView& t) const {
    if constexpr (kScoreRows == 1) return kLanes;
    const int64_t row_bytes = t.shape[3] * dtype_size(t.dtype);
    return row_bytes >= 512 ? 4 : row_bytes >= 256 ? 8 : kLanes;
  }

  // fn(sh[h], h, j0, nc, c0, c1) for the blocks of kLanes keys from j_begin, blocks outer and
  // heads inner, for every head h whose rows see keys of the block (nc of them: keys [j_begin,
  // j_begin + sh[h].seen)): keys [j0 + c0, j0 + c1) of it at a time, sweep_keys(t) over heads side
  // by side (c0 perhaps past nc), else the whole block (c0 = 0, c1 = kLanes). The rows of `t` (k
  // or v) `ahead` keys on are prefetched, unless skipped there: head by head, or, over heads side
  // by side, in address order, a share of the block's rows at each step (`adjacent`, below).
  template <class Fn>
  void sweep(Scratch* sh, int64_t heads, int64_t b, int64_t hk0, int64_t j_begin, int64_t key_end_all, int64_t ahead,
             const TensorView& t, Fn fn) const {
    // (the task's heads one run of memory at each key)
    const bool side_by_side = heads > 1 && t.strides[1] == t.shape[3];
    const int step = side_by_side ? sweep_keys(t) : kLanes;
    // Rows ahead asked for in address order where the step is less than a block, and on layers
    // that score a block per row (AVX2, portable), whose step is always the block: there pages of
    // 16 took 0.79-0.94x the time of head-by-head prefetches (Zen 3, B=8 H=32/8 S=4096, bf16 d=64
    // and 128, six alternating runs; float32 d=128 0.74-0.95x, one head per key/value head
    // 0.85-0.99x), where AVX-512's whole blocks of 128-byte rows took 1.1x (sweep_keys).
    const bool adjacent = side_by_side && (step < kLanes || kScoreRows == 1);
    const int64_t shares = kLanes / step * heads;
    for (int64_t j0 = j_begin; j0 < key_end_all; j0 += kLanes) {
      bool ahead_read = false;  // whether some head reads the block `ahead` keys on
      if (adjacent && j0 + ahead < key_end_all)
        for (int64_t h = 0; h < heads && !ahead_read; ++h)
          ahead_read = j0 + ahead < j_begin + sh[h].seen && !sh[h].skipped[(j0 + ahead - j_begin) / kKeys];
      for (int c0 = 0; c0 < kLanes; c0 += step) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t key_end = j_begin + sh[h].seen;
          if (ahead_read)
            prefetch_share(t, b, hk0, heads, j0 + ahead, std::min<int64_t>(kLanes, key_end_all - j0 - ahead),
                           c0 / step * heads + h, shares);
          if (j0 >= key_end) continue;
          if (!adjacent && c0 == 0 && j0 + ahead < key_end && !sh[h].skipped[(j0 + ahead - j_begin) / kKeys])
            prefetch_rows(t, b, hk0 + h, j0 + ahead, std::min<int64_t>(kLanes, key_end - j0 - ahead));
          fn(sh[h], h, j0, static_cast<int>(std::min<int64_t>(kLanes, key_end - j0)), c0, c0 + step);
        }
      }
    }
  }

  // Dot mode over `heads` key/value heads from hk0 of batch entry b, rows [r_begin, r_end) of each
  // in its own scratch sh[h] (head_rows): each pass sweeps the keys in order, every head's rows of
  // a key block before the next block, so that a cache whose heads lie side by side at each
  // position ([B, S, H, D], vLLM's and FlashAttention's paged layout) is read in order. Each row's
  // arithmetic is that of a task of its head alone.
  void run_heads_by_dot(Scratch* sh, int64_t heads, int64_t b, int64_t hk0, int64_t r_begin, int64_t r_end,
                        int64_t j_begin, int64_t j_end) const {
    const int64_t rows = r_end - r_begin, stride = kKeysPerRun;
    int64_t key_end_all = j_begin;
    const bool pairs = pair_scores(p);  // (query rows then stay in place, as words)
    const bool panel_scores = pairs && scores_by_panel();
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t key_end = start_rows(sh[h], b, hk0 + h, r_begin, r_end, j_begin, j_end, pairs);
      sh[h].seen = key_end - j_begin;
      if (key_end > j_begin) mark_skipped(sh[h], b, hk0 + h, r_begin, r_end, j_begin, key_end);
      key_end_all = std::max(key_end_all, key_end);
    }
    if (key_end_all == j_begin) return;
    // Whether head h's keys at j (a multiple of kLanes) are in a skipped block: -inf scores, no values read.
    auto skipped = [&](int64_t h, int64_t j) { return sh[h].skipped[(j - j_begin) / kKeys]; };
    auto excluded_scores = [&](Scratch& s, int64_t j0) {  // a skipped block's: -inf, its keys unread
      const F neg_inf = S::set1(-std::numeric_limits<float>::infinity());
      for (int64_t qi = 0; qi < rows; ++qi) S::store(s.scores + qi * stride + (j0 - j_begin), neg_inf);
    };
    // (the same bytes ahead whatever the heads: a sweep of 16 heads reads 16 rows per position)
    const int64_t ahead = std::max<int64_t>(kLanes, kDotPrefetchKeys / heads / kLanes * kLanes);
    const void* zero_bits = sh[0].zero;  // as many zero bits as dk and dv need (+0 in every dtype)
    const bool k_in_place = keys_in_place();  // (out of the loop: it divides, twice)
    if constexpr (kPairs) {
      if (pairs) {
        sweep(sh, heads, b, hk0, j_begin, key_end_all, ahead, p.k,
              [&](Scratch& s, int64_t h, int64_t j0, int nc, int c0, int c1) {
                const int64_t hk = hk0 + h;
                if (skipped(h, j0)) return c0 == 0 ? excluded_scores(s, j0) : void();
                const float qk_scale = static_cast<float>(p.scale) * p.key_descale(b, hk) * kLog2e;
                if (panel_scores) {  // (c0 = 0, c1 = kLanes: rows of at most 128 bytes)
                  auto* kt = reinterpret_cast<uint32_t*>(s.kt);  // [words][kLanes]
                  transpose_key_pairs(s, b, hk, j0, nc, kt, kLanes);
                  panel_pair_scores(s.qw_row, rows, kt, p.dim_qk / 2, qk_scale, s.scores + (j0 - j_begin), stride);
                  return;
                }
                const uint16_t** rows_in_place = s.template keys_of<uint16_t>();
                for (int c = c0; c < c1; ++c)
                  rows_in_place[c] = c < nc ? low_row<uint16_t>(p.k, b, hk, j0 + c) : static_cast<const uint16_t*>(zero_bits);
                dot_pair_scores_all(rows_in_place, s.qw_row, p.dim_qk / 2, qk_scale, rows, s.scores + (j0 - j_begin),
                                    stride, c0, c1);
              });
      }
    }
    if (!pairs) with_loader(p.k.dtype, reads_in_place(p.k.dtype, p.dim_qk), [&](auto loader) {
      using L = decltype(loader);
      sweep(sh, heads, b, hk0, j_begin, key_end_all, ahead, p.k, [&](Scratch& s, int64_t h, int64_t j0, int nc, int c0, int c1) {
        const int64_t hk = hk0 + h;
        if (skipped(h, j0)) return c0 == 0 ? excluded_scores(s, j0) : void();
        const typename L::E* const* kp;
        if constexpr (std::is_same_v<L, AsF32>) {
          for (int c = c0; c < c1; ++c)
            s.kp[c] = c < nc ? key_row(p.k, b, hk, j0 + c, p.dim_qk, dk(), k_in_place, s.kbuf + c * dk()) : s.zero;
          kp = s.kp;
        } else {
          using E = typename L::E;
          const E** rows_in_place = s.template keys_of<E>();
          for (int c = c0; c < c1; ++c)
            rows_in_place[c] = c < nc ? low_row<E>(p.k, b, hk, j0 + c) : static_cast<const E*>(zero_bits);
          kp = rows_in_place;
        }
        float* out = s.scores + (j0 - j_begin);
        if constexpr (std::is_same_v<L, AsF8>) {
          if (S::f8_rows_free_of_nan(kp + c0, c1 - c0, dk())) {
            dot_scores_all<AsF8Finite>(kp, s.q, dk(), dk(), rows, out, stride, c0, c1);
            return;
          }
        }
        dot_scores_all<L>(kp, s.q, dk(), dk(), rows, out, stride, c0, c1);
      });
    });
    for (int64_t h = 0; h < heads; ++h) {
      Scratch& s = sh[h];
      if (s.seen == 0) continue;
      for (int64_t qi = 0; qi < rows; ++qi) {
        const int64_t row = r_begin + qi;
        softmax_run(s, qi, b, (hk0 + h) * group() + row / p.len_q, row % p.len_q, j_begin, s.seen);
        if constexpr (kPairs)  // (past `seen`, up to its whole vector: p = 0)
          if (pairs) S::narrow_in_place(s.scores + qi * stride, static_cast<int>(T::round_up(s.seen, kLanes) / kLanes));
        s.accrow[qi] = s.acc + qi * dv();
        s.alpha[qi] = 1.0f;
      }
    }
    // O = P V over every key any row sees: a zero weight too (0 x inf is NaN, as in P @ V). In
    // slices of kLanes value rows, which stay in L1 while the row blocks sweep them a few vectors
    // at a time (slices of 48 rows took 1.1-1.2x the time on AVX2, of 32 1.05x).
    if constexpr (kPairs) {
      if (pairs) {  // P rounded to bfloat16 (above), the values as pairs of keys (accumulate_pairs_in_place)
        sweep(sh, heads, b, hk0, j_begin, key_end_all, ahead, p.v, [&](Scratch& s, int64_t h, int64_t j0, int nc, int c0, int c1) {
          const int64_t hk = hk0 + h;
          const int n = std::min(c1, nc) - c0;  // value rows [j0 + c0, j0 + c0 + n)
          if (skipped(h, j0) || n <= 0) return;
          const uint16_t** rows_in_place = s.template values_of<uint16_t>();
          for (int c = 0; c < n; ++c) rows_in_place[c] = low_row<uint16_t>(p.v, b, hk, j0 + c0 + c);
          // (row qi's probabilities as words from s.scores + qi * stride; c0 and j0 - j_begin are even)
          accumulate_pairs_in_place(s, rows, reinterpret_cast<const uint32_t*>(s.scores) + (j0 - j_begin + c0) / 2, stride,
                                    n, rows_in_place);
        });
        return;
      }
    }
    const bool v_in_place = values_in_place();
    with_loader(p.v.dtype, reads_in_place(p.v.dtype, p.dim_v), [&](auto loader) {
      using L = decltype(loader);
      sweep(sh, heads, b, hk0, j_begin, key_end_all, ahead, p.v, [&](Scratch& s, int64_t h, int64_t j0, int nc, int c0, int c1) {
        const int64_t hk = hk0 + h;
        const int n = std::min(c1, nc) - c0;  // value rows [j0 + c0, j0 + c0 + n)
        if (skipped(h, j0) || n <= 0) return;  // probabilities 0, or no key here
        const float* prob = s.scores + (j0 - j_begin) + c0;
        if constexpr (std::is_same_v<L, AsF32>) {
          for (int c = 0; c < n; ++c) s.vp[c] = key_row(p.v, b, hk, j0 + c0 + c, p.dim_v, dv(), v_in_place, s.vbuf + c * dv());
          accumulate_rows<L>(s, rows, prob, stride, n, s.vp);
        } else {
          using E = typename L::E;
          const E** rows_in_place = s.template values_of<E>();
          for (int c = 0; c < n; ++c) rows_in_place[c] = low_row<E>(p.v, b, hk, j0 + c0 + c);
          if constexpr (std::is_same_v<L, AsF8>) {
            if (S::f8_rows_free_of_nan(rows_in_place, n, dv())) {
              accumulate_rows<AsF8Finite>(s, rows, prob, stride, n, rows_in_place);
              return;
            }
          }
          accumulate_rows<L>(s, rows, prob, stride, n, rows_in_place);
        }
      });
    });
  }

  // The softmax of row qi (query i of head h) over a run's `count` scores from key j_begin: masks
  // added, keys past the row's limit at -inf; leaves the probabilities in the row, m and the lane sums.
  void softmax_run(Scratch& s, int64_t qi, int64_t b, int64_t h, int64_t i, int64_t j_begin, int64_t count) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    float* row = s.scores + qi * kKeysPerRun;
    const int64_t visible = std::max<int64_t>(0, s.lim[qi] - j_begin);
    bool nan = false;
    F top = S::set1(neg_inf);
    auto take_row = [&](auto capped) {
      for (int64_t c = 0; c < count; c += kLanes) {
        const int cols = static_cast<int>(std::min<int64_t>(kLanes, count - c));
        F x = S::load(row + c);
        if (!s.skipped[c / kKeys]) {  // (a skipped block's scores are -inf already)
          x = capped(x);
          for (int t = 0; t < p.num_masks; ++t) x = S::add(x, T::mask_row(p.masks[t], b, h, i, j_begin + c, cols));
        }
        const int64_t keep = std::clamp<int64_t>(visible - c, 0, kLanes);
        x = S::select(first_lanes(keep), x, S::set1(neg_inf));
        nan = nan || !S::all(S::eq(x, x));
        top = S::max(top, x);
        S::store(row + c, x);
      }
    };
    const Softcap<S> cap(p);
    if (!cap.on) {
      take_row([](F x) { return x; });
    } else {  // one map for the run's scores (no test per vector: cpu/softcap.hpp)
      F least = S::zero(), greatest = S::zero();  // (0 stands in for the lanes past count: under any cap)
      for (int64_t c = 0; c < count; c += kLanes) {
        if (s.skipped[c / kKeys]) continue;
        const int cols = static_cast<int>(std::min<int64_t>(kLanes, count - c));
        const F x = S::select(first_lanes(cols), S::load(row + c), S::zero());
        least = S::min(least, x), greatest = S::max(greatest, x);
      }
      cap.with_map(least, greatest, [&](auto map) { take_row([&](F x) { return map(x, nullptr); }); });
    }
    const float m = nan ? std::numeric_limits<float>::quiet_NaN() : S::reduce_max(top);
    const F m_use = S::set1(m == neg_inf ? 0.0f : m);  // a row that sees no key: p = 0, not NaN
    F sum = S::zero();
    const bool dropout = p.dropout_p > 0;
    for (int64_t c = 0; c < count; c += kLanes) {
      const F pr = S::exp2(S::sub(S::load(row + c), m_use));
      sum = S::add(sum, pr);
      S::store(row + c, dropout ? dropped(s, qi, j_begin + c, pr) : pr);
    }
    S::store(s.l + qi * kLanes, sum);
    s.m[qi] = m;
  }

  float lane_sum(const float* l) const {
    float sum = 0.0f;
    for (int c = 0; c < kLanes; ++c) sum += l[c];
    return sum;
  }

  // Row `row` of key/value head (b, hk) of the weights: its first element; columns o.weights_strides[3] apart.
  float* weights_row(int64_t b, int64_t hk, int64_t row) const {
    const int64_t h = hk * group() + row / p.len_q, i = row % p.len_q;
    return o.weights + b * o.weights_strides[0] + h * o.weights_strides[1] + i * o.weights_strides[2];
  }

  // Weights [j_begin, j_end) of a row, from dot mode's run: its probabilities (relative to the
  // run's max) times `factor` for the first `count` keys, zero past them (keys no row of the task
  // sees). One pass of writes: with one run the factor is 1/l; with several, 1 and the merge scales.
  void write_weights(int64_t b, int64_t hk, int64_t row, const float* prob, int64_t j_begin, int64_t count,
                     int64_t j_end, float factor) const {
    float* w = weights_row(b, hk, row);
    const int64_t sc = o.weights_strides[3];
    if (sc == 1) {  // the usual [B, H, Lq, Lk]: loops the compiler vectorises (a causal row is mostly zeros)
      for (int64_t j = 0; j < count; ++j) w[j_begin + j] = prob[j] * factor;
      std::fill(w + j_begin + count, w + j_end, 0.0f);
      return;
    }
    for (int64_t j = 0; j < count; ++j) w[(j_begin + j) * sc] = prob[j] * factor;
    for (int64_t j = j_begin + count; j < j_end; ++j) w[j * sc] = 0.0f;
  }

  // Weights [j_begin, j_end) of a row times `factor`: 2^(m_run - m) / l once the row's m and l are final.
  void scale_weights(int64_t b, int64_t hk, int64_t row, int64_t j_begin, int64_t j_end, float factor) const {
    float* w = weights_row(b, hk, row);
    const int64_t sc = o.weights_strides[3];
    if (sc == 1) {
      for (int64_t j = j_begin; j < j_end; ++j) w[j] *= factor;
      return;
    }
    for (int64_t j = j_begin; j < j_end; ++j) w[j * sc] *= factor;
  }

  // O / l into the output (in its dtype) and the log-sum-exp, for row `row` of key/value head (b, hk).
  void store(int64_t b, int64_t hk, int64_t row, const float* acc, float m, float l) const {
    const int64_t h = hk * group() + row / p.len_q, i = row % p.len_q;
    const float inv_l = (l > 0 ? 1.0f / l : 0.0f) * value_unscale() * p.value_descale(b, hk);
    const int64_t offset = b * o.out_strides[0] + h * o.out_strides[1] + i * o.out_strides[2];
    with_output_elements(o.out, o.out_dtype, offset, [&](auto* out, auto round) {
      for (int64_t d = 0; d < p.dim_v; ++d) out[d * o.out_strides[3]] = round(acc[d] * inv_l);
    });
    if (o.lse != nullptr) {
      o.lse[(b * p.heads_q + h) * p.len_q + i] =
          l > 0 ? (m + std::log2(l)) * kLn2 : std::numeric_limits<float>::infinity();
    }
  }

  // Key/value heads per task. One, unless dot mode reads a cache whose heads lie side by side at
  // each position (the head stride below the row stride: [B, S, H, D], vLLM's and FlashAttention's
  // paged layout): there a task takes several heads and sweeps their keys in order
  // (run_heads_by_dot), as many as leave two tasks per thread. Read one head at a time, such a
  // cache's rows lie a head-stride apart (4 KiB at 16 heads of 64 floats), and a step at B=4 H=16
  // S=2048 d=64 ran at about half the speed of the [B, H, S, D] cache's.
  int64_t heads_per_task(int threads) const {
    const bool side_by_side = p.k.strides[1] < p.k.strides[2] && p.v.strides[1] < p.v.strides[2];
    if (!scores_by_dot() || p.heads_kv < 2 || !side_by_side) return 1;
    const int64_t head_groups = std::clamp<int64_t>((2 * threads + p.batch * runs() - 1) / (p.batch * runs()), 1, p.heads_kv);
    return (p.heads_kv + head_groups - 1) / head_groups;
  }

  // The part of `all` (a scratch of several heads' rows, n per head) that holds head h's rows.
  Scratch head_rows(const Scratch& all, int64_t h, int64_t n) const {
    Scratch s = all;
    const int64_t r = h * n;
    s.q += r * dk(), s.acc += r * dv(), s.scores += r * score_stride(), s.l += r * kLanes;
    s.m += r, s.alpha += r, s.lim += r, s.key_lo += r, s.key_hi += r, s.active += r, s.qrow += r, s.accrow += r, s.qw_row += r, s.qw += r;
    return s;
  }

  void run() const {
    const int threads = resolve_threads(p.num_threads);
    if (p.num_masks > 0 && !excluded.done) {
      std::vector<Tensor> storage;
      FewQueries{p, o, excluded_blocks(threads, storage)}.run();
      return;
    }
    const int64_t groups = p.batch * p.heads_kv, n = queries(), r = runs();
    // Tasks: units of `per_task` key/value heads of one batch entry, by runs, by chunks of rows.
    const int64_t per_task = heads_per_task(threads), units_per_entry = (p.heads_kv + per_task - 1) / per_task;
    const int64_t units = p.batch * units_per_entry;
    // Rows of a key/value head split into chunks only where heads and runs alone leave threads idle:
    // each chunk reads the keys and values again.
    const int64_t wanted = per_task > 1 ? 1 : std::min((2 * threads + groups * r - 1) / (groups * r), (n + kBlockRows - 1) / kBlockRows);
    const int64_t chunk = T::round_up((n + wanted - 1) / wanted, kBlockRows), chunks = (n + chunk - 1) / chunk;
    auto rows_of = [&](int64_t c) { return std::pair{c * chunk, std::min(n, (c + 1) * chunk)}; };
    // Runs unit u's heads over keys [j_begin, j_end) for rows [r0, r1), then finish(g, qi, s) for
    // each head's group g (b * Hkv + hk) and row qi of the chunk, s the head's scratch.
    auto run_unit = [&](int64_t u, int64_t r0, int64_t r1, int64_t j_begin, int64_t j_end, auto finish) {
      const int64_t b = u / units_per_entry, hk0 = u % units_per_entry * per_task;
      const int64_t heads = std::min(per_task, p.heads_kv - hk0);
      Scratch all = allocate(heads * (r1 - r0));
      if (heads == 1) {
        run_keys(all, b, hk0, r0, r1, j_begin, j_end);
        for (int64_t qi = 0; qi < r1 - r0; ++qi) finish(b * p.heads_kv + hk0, qi, all);
        return;
      }
      std::vector<Scratch> sh;
      for (int64_t h = 0; h < heads; ++h) sh.push_back(head_rows(all, h, r1 - r0));
      run_heads_by_dot(sh.data(), heads, b, hk0, r0, r1, j_begin, j_end);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t qi = 0; qi < r1 - r0; ++qi) finish(b * p.heads_kv + hk0 + h, qi, sh[h]);
    };
    if (r == 1) {
      parallel_for(units * chunks, threads, [&](int64_t t, int) {
        const auto [r0, r1] = rows_of(t % chunks);
        run_unit(t / chunks, r0, r1, 0, p.len_k, [&, r0 = r0](int64_t g, int64_t qi, const Scratch& s) {
          const float l = lane_sum(s.l + qi * kLanes);
          store(g / p.heads_kv, g % p.heads_kv, r0 + qi, s.acc + qi * dv(), s.m[qi], l);
          if (o.weights != nullptr)
            write_weights(g / p.heads_kv, g % p.heads_kv, r0 + qi, s.scores + qi * kKeysPerRun, 0, s.seen, p.len_k,
                          l > 0 ? 1.0f / l : 0.0f);
        });
      });
      return;
    }
    // Runs of keys as tasks, each leaving its (O, m, l) per query; then each query's runs merged
    // in order: m the largest, and every run's O and l scaled by 2^(m_run - m).
    const Tensor states = Tensor::empty({groups, r, n, state_floats()});  // the count checked there
    float* st = states.data<float>();
    parallel_for(units * r * chunks, threads, [&](int64_t t, int) {
      const int64_t run = t / chunks % r;
      const auto [r0, r1] = rows_of(t % chunks);
      const int64_t j_begin = run * keys_per_run(), j_end = std::min(p.len_k, (run + 1) * keys_per_run());
      run_unit(t / (r * chunks), r0, r1, j_begin, j_end, [&, r0 = r0](int64_t g, int64_t qi, const Scratch& s) {
        float* state = st + ((g * r + run) * n + r0 + qi) * state_floats();
        std::memcpy(state, s.acc + qi * dv(), sizeof(float) * dv());
        state[dv()] = s.m[qi];
        state[dv() + 1] = lane_sum(s.l + qi * kLanes);
        state[dv() + 2] = static_cast<float>(s.seen);  // <= kKeysPerRun: exact
        if (o.weights != nullptr)
          write_weights(g / p.heads_kv, g % p.heads_kv, r0 + qi, s.scores + qi * kKeysPerRun, j_begin, s.seen, j_end, 1.0f);
      });
    });
    parallel_for(groups, threads, [&](int64_t g, int) {
      float* acc = static_cast<float*>(thread_scratch(sizeof(float) * static_cast<size_t>(dv())));
      for (int64_t qi = 0; qi < n; ++qi) {
        auto state = [&](int64_t run) { return st + ((g * r + run) * n + qi) * state_floats(); };
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t run = 0; run < r; ++run) m = std::max(m, state(run)[dv()]);
        const float m_use = m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
        float l = 0.0f;
        std::fill(acc, acc + dv(), 0.0f);
        for (int64_t run = 0; run < r; ++run) {
          const float* x = state(run);
          const float factor = std::exp2(x[dv()] - m_use);  // a run that saw no key: 2^-inf = 0
          l += x[dv() + 1] * factor;
          for (int64_t d = 0; d < dv(); ++d) acc[d] += x[d] * factor;
        }
        store(g / p.heads_kv, g % p.heads_kv, qi, acc, m, l);
        if (o.weights != nullptr) {
          const float inv_l = l > 0 ? 1.0f / l : 0.0f;
          for (int64_t run = 0; run < r; ++run) {  // only the keys its task saw: the rest are zeros
            const int64_t j_begin = run * keys_per_run(), seen = static_cast<int64_t>(state(run)[dv() + 2]);
            scale_weights(g / p.heads_kv, g % p.heads_kv, qi, j_begin, j_begin + seen,
                          std::exp2(state(run)[dv()] - m_use) * inv_l);
          }
        }
      }
    });
  }
};

}  // namespace
}  // namespace mha::detail
