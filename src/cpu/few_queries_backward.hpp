// The attention backward for a handful of query rows per key/value head (attention pooling with a
// few learned queries, a class token over a sequence, decoding-style training steps). The tile
// backward (flash_backward.hpp) puts queries in the lanes of 48-wide panels and transposes every
// key and value block into them; with one query per head 47 of 48 lanes compute nothing and the
// transposes, not the products, take the time. Here the rows are queries and the lanes run over
// keys, as in the forward's dot mode (few_queries.hpp): per block of kLanes keys and per row,
//   S = q K^T (dot products of whole rows), P = 2^(S - lse), dP = dO V^T, dS = P (dPd - D)
// then each key's dV = sum_r Pd_r dO_r and dK = scale sum_r dS_r q_r over the group's rows (the
// key's only writer), and dQ_r += dS_r K. Keys, values and their gradients are read and written
// once, in rows. Long sequences split into shape-fixed chunks of keys whose dQ partial sums are
// added in order afterwards, so the bits depend on the shape only, not on the thread count. A mask
// gradient (dscores) is each row's dS, stored as it is formed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/attention_problem.hpp"
#include "core/dropout.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/few_queries.hpp"
#include "cpu/softcap.hpp"
#include "cpu/tile_kernels.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {
namespace {

template <class S>
struct FewQueriesBackward {
  using F = typename S::F;
  using U = typename S::U;
  using M = typename S::M;
  using T = Tiles<S>;
  using Dot = FewQueries<S>;
  static constexpr int kLanes = S::kLanes;
  // Rows per key/value head. A task computes 5 products of rows x keys x d for 2 reads and 2
  // writes of each key's rows; the tile backward's panels pay for their transposes with more rows
  // (one thread, B=4 H=16 Lk=512 d=64: 0.48x the tile backward's time at 2 rows, 0.72x at 8, 0.97x
  // at 16, 1.28x at 32; Lk=2048 d=128 at 16 rows 0.9x).
  static constexpr int64_t kMaxRows = kFewQueryRowsBackward;
  static constexpr int64_t kKeysPerChunk = 64 * kLanes;  // 1024: a task's keys, whatever the thread count

  const AttentionProblem& p;
  const BackwardInputs& in;
  const BackwardOutputs& out;
  // dK and dV rows are stored past the caches where the call's key and value rows and their
  // gradients take at least kMinBytesToStream: a store that misses the caches first reads its
  // line (the stores took 30% of a one-query backward). Smaller calls stay in the last-level
  // cache, where the stores hit and a consumer of the gradients finds them. Zen 5 (32 MiB L3), B x
  // H=12, Lk=197, d=64, one query, float32: level at B=4 (4.8 MB) and B=8 (9.7 MB), 0.53x the time
  // at B=16 (19 MB), 0.71x at B=32 (39 MB); bfloat16 and float16 (16-bit gradients): level at B=16
  // (19 MB), 0.85x at B=32 (AVX2: 0.9x).
  static constexpr int64_t kMinBytesToStream = int64_t{16} << 20;
  const bool stream_rows = p.batch * p.heads_kv * p.len_k * (p.dim_qk + p.dim_v) *
                               (dtype_size(p.k.dtype) + dtype_size(out.grad_dtype)) >= kMinBytesToStream;

  static bool applies(const AttentionProblem& p) {
    return p.heads_q / p.heads_kv * p.len_q <= kMaxRows;
  }

  int64_t group() const { return p.heads_q / p.heads_kv; }
  int64_t rows() const { return group() * p.len_q; }  // row (h % group) * Lq + i of a key/value head
  int64_t chunks() const { return (p.len_k + kKeysPerChunk - 1) / kKeysPerChunk; }
  int64_t dk() const { return T::round_up(p.dim_qk, kLanes); }  // rows padded with zeros to whole vectors
  int64_t dv() const { return T::round_up(p.dim_v, kLanes); }

  struct Scratch {
    float* qs;       // [rows][dk] q * scale * log2(e): the scores in base 2
    float* q;        // [rows][dk] q
    float* go;       // [rows][dv] dO
    float* dq;       // [rows][dk] sum of dS K over the chunk
    float* prob;     // [rows][kLanes] Pd of the block
    float* grad;     // [rows][kLanes] dS of the block
    float* kbuf;     // [kLanes][dk] key rows copied or widened
    float* vbuf;     // [kLanes][dv]
    float* row;      // [max(dk, dv)] one gradient row before it is stored
    float* zero;     // [max(dk, dv)]
    float* lse2;     // [rows] log-sum-exp in base 2
    float* p_scale;  // [rows] 1 but in rows of mask values alone (backward_rows.hpp)
    float* delta;    // [rows] D = rowsum(dO O)
    int64_t* lim;    // [rows] keys [0, lim) visible
    uint32_t* key_lo;  // [rows] dropout row keys
    uint32_t* key_hi;
  };

  Scratch allocate() const {
    const int64_t n = rows(), widest = std::max(dk(), dv());
    const int64_t floats = n * (3 * dk() + dv() + 2 * kLanes + 3 + 4) + 1 + kLanes * (dk() + dv()) + 2 * widest;
    float* f = static_cast<float*>(thread_scratch(static_cast<size_t>(T::round_up(floats * 4, 64) + 64)));
    Scratch s;  // whole vectors first, so that they stay 64-byte aligned; lim last, at a multiple of 16 bytes
    s.qs = f, f += n * dk();
    s.q = f, f += n * dk();
    s.go = f, f += n * dv();
    s.dq = f, f += n * dk();
    s.prob = f, f += n * kLanes;
    s.grad = f, f += n * kLanes;
    s.kbuf = f, f += kLanes * dk();
    s.vbuf = f, f += kLanes * dv();
    s.row = f, f += widest;
    s.zero = f, f += widest;
    s.lse2 = f, f += n;
    s.delta = f, f += n;
    s.p_scale = f, f += n + n % 2;  // (an even count keeps lim 8-byte aligned)
    s.key_lo = reinterpret_cast<uint32_t*>(f), f += n;
    s.key_hi = reinterpret_cast<uint32_t*>(f), f += n;
    s.lim = reinterpret_cast<int64_t*>(f);
    std::memset(s.zero, 0, sizeof(float) * widest);
    return s;
  }

  // Row l of head (b, h) of an input of `dtype` (strides over b, h, l; unit stride within the
  // row) as float32 of `padded` elements: in place where it is float32 of whole vectors, else
  // copied or widened into dst and padded with zeros.
  static const float* input_row(const void* data, DType dtype, const int64_t* strides, int64_t b, int64_t h, int64_t l,
                                int64_t width, int64_t padded, float* dst) {
    const int64_t offset = b * strides[0] + h * strides[1] + l * strides[2];
    if (dtype == DType::f32) {
      const float* r = static_cast<const float*>(data) + offset;
      if (width == padded) return r;
      std::memcpy(dst, r, sizeof(float) * width);
    } else {
      T::widen(dtype, static_cast<const uint16_t*>(data) + offset, dst, width);
    }
    std::fill(dst + width, dst + padded, 0.0f);
    return dst;
  }

  // Row l of head (b, h) of a gradient: scale * src[0, width), in the gradients' dtype.
  void store_row(void* base, const int64_t* strides, int64_t b, int64_t h, int64_t l, const float* src, int64_t width,
                 float scale) const {
    const int64_t offset = b * strides[0] + h * strides[1] + l * strides[2], step = strides[3];
    if (out.grad_dtype == DType::f32 && step == 1) {  // (element by element: 27% of a one-query backward)
      float* dst = static_cast<float*>(base) + offset;
      const F factor = S::set1(scale);
      int64_t d = 0;
      if constexpr (requires { S::stream(dst, factor); }) {
        if (stream_rows && width % kLanes == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
          for (; d < width; d += kLanes) S::stream(dst + d, S::mul(S::load(src + d), factor));
          return;
        }
      }
      for (; d + kLanes <= width; d += kLanes) S::store(dst + d, S::mul(S::load(src + d), factor));
      for (; d < width; ++d) dst[d] = src[d] * scale;
      return;
    }
    if constexpr (requires { S::store_16bit_row; }) {
      if (out.grad_dtype != DType::f32 && step == 1) {
        store_16bit_row(static_cast<uint16_t*>(base) + offset, src, width, scale);
        return;
      }
    }
    with_output_elements(base, out.grad_dtype, offset, [&](auto* dst, auto round) {
      for (int64_t d = 0; d < width; ++d) dst[d * step] = round(src[d] * scale);
    });
  }

  // A bfloat16 or float16 gradient row with unit stride. Kept out of store_row: inlined there,
  // the 16-bit roundings' vectors made every call of it (a float32 row's too) realign the stack
  // and save registers, 12% of a bf16 one-query backward (B=8 H=12 Lk=197 d=64).
  [[gnu::noinline]] void store_16bit_row(uint16_t* dst, const float* src, int64_t width, float scale) const {
    if (stream_rows && width % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0)
      S::stream_16bit_row(out.grad_dtype, src, scale, dst, width);
    else
      S::store_16bit_row(out.grad_dtype, src, scale, dst, width);
  }

  // dst[0, width) = sum over rows r of w[r * kLanes + c] * x[r][0, width): one key's gradient row.
  static void weighted_rows(float* dst, const float* w, int c, const float* x, int64_t n, int64_t width) {
    for (int64_t d0 = 0; d0 < width; d0 += kLanes) {
      F acc = S::mul(S::set1(w[c]), S::load(x + d0));
      for (int64_t r = 1; r < n; ++r) acc = S::fmadd(S::set1(w[r * kLanes + c]), S::load(x + r * width + d0), acc);
      S::store(dst + d0, acc);
    }
  }

  // The rows of key/value head (b, hk): queries, dO, statistics, zero dQ; returns the end of the
  // keys any row sees.
  int64_t start_rows(Scratch& s, int64_t b, int64_t hk) const {
    const float qscale = static_cast<float>(p.scale) * kLog2e;
    int64_t key_end = 0;
    for (int64_t qi = 0; qi < rows(); ++qi) {
      const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
      const int64_t r = (b * p.heads_q + h) * p.len_q + i;
      float* q = s.q + qi * dk();
      const float* qr = input_row(p.q.data, p.q.dtype, p.q.strides.data(), b, h, i, p.dim_qk, dk(), q);
      if (qr != q) std::memcpy(q, qr, sizeof(float) * dk());
      for (int64_t d = 0; d < dk(); ++d) s.qs[qi * dk() + d] = q[d] * qscale;
      float* go = s.go + qi * dv();
      const float* gr = input_row(in.grad_out, in.grad_out_dtype, in.grad_out_strides, b, h, i, p.dim_v, dv(), go);
      if (gr != go) std::memcpy(go, gr, sizeof(float) * dv());
      std::fill(s.dq + qi * dk(), s.dq + (qi + 1) * dk(), 0.0f);
      s.lse2[qi] = in.lse2[r];
      s.p_scale[qi] = in.p_scale[r];
      s.delta[qi] = in.delta[r];
      s.lim[qi] = p.causal_end(i);
      key_end = std::max(key_end, s.lim[qi]);
      if (p.dropout_p > 0) {
        const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>(r));
        s.key_lo[qi] = key.lo, s.key_hi[qi] = key.hi;
      }
    }
    return key_end;
  }

  // Pd and dS of every row against keys [j0, j0 + nc) (kp, vp: kLanes rows, zero past nc).
  void probabilities_and_score_gradients(Scratch& s, int64_t b, int64_t hk, int64_t j0, int nc, const float* const* kp,
                                         const float* const* vp) const {
    const U keys = T::lane_indices(j0);
    const bool dropout = p.dropout_p > 0;
    const U threshold = S::set1_u(dropout_threshold(p.dropout_p));
    const F keep_scale = S::set1(static_cast<float>(1.0 / (1.0 - p.dropout_p)));
    const F zero = S::zero();
    const Softcap<S> cap(p);
    // The block's scores first (into s.prob), then with a cap one map for all of them, chosen by
    // their least and greatest (as Softcap::rows; the slopes wait in s.grad until dS replaces them).
    F least = S::set1(std::numeric_limits<float>::infinity()), greatest = S::sub(zero, least);
    for (int64_t qi = 0; qi < rows(); ++qi) {
      const F x = Dot::template dot_scores<typename Dot::AsF32>(kp, s.qs + qi * dk(), dk());
      S::store(s.prob + qi * kLanes, x);
      least = S::min(least, x), greatest = S::max(greatest, x);
    }
    if (cap.on) {
      cap.with_map(least, greatest, [&](auto map) {
        for (int64_t qi = 0; qi < rows(); ++qi) {
          F slope;
          S::store(s.prob + qi * kLanes, map(S::load(s.prob + qi * kLanes), &slope));
          S::store(s.grad + qi * kLanes, slope);
        }
      });
    }
    for (int64_t qi = 0; qi < rows(); ++qi) {
      const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
      F x = S::load(s.prob + qi * kLanes);
      const F slope = cap.on ? S::load(s.grad + qi * kLanes) : zero;
      for (int t = 0; t < p.num_masks; ++t) x = S::add(x, T::mask_row(p.masks[t], b, h, i, j0, nc));
      // Keys past the row's limit (causality, the chunk's end or Lk) have P = 0.
      const U limit = S::set1_u(static_cast<uint32_t>(std::min<int64_t>(s.lim[qi], j0 + nc)));
      F pr = S::select(S::lt_i(keys, limit), S::exp2(S::sub(x, S::set1(s.lse2[qi]))), zero);
      if (s.p_scale[qi] != 1.0f) pr = S::mul(pr, S::set1(s.p_scale[qi]));  // (backward_rows.hpp)
      F dp = Dot::template dot_scores<typename Dot::AsF32>(vp, s.go + qi * dv(), dv());
      F pd = pr;
      if (dropout) {
        const M keep = S::ge_u(T::dropout_bits(keys, S::set1_u(s.key_lo[qi]), S::set1_u(s.key_hi[qi])), threshold);
        pd = S::select(keep, S::mul(pr, keep_scale), zero);
        dp = S::select(keep, S::mul(dp, keep_scale), zero);
      }
      S::store(s.prob + qi * kLanes, pd);
      S::store(s.grad + qi * kLanes, S::mul(pr, S::sub(dp, S::set1(s.delta[qi]))));
      if (out.dscores) store_score_gradients(b, h, i, j0, s.grad + qi * kLanes, nc);
      // q.k's share of dS passes through the cap (the masks' share, stored above, does not).
      if (cap.on) S::store(s.grad + qi * kLanes, S::mul(S::load(s.grad + qi * kLanes), slope));
    }
  }

  // dS of row (b, h, i) for keys [j0, j0 + n): what an additive mask receives (zeros for null `ds`).
  void store_score_gradients(int64_t b, int64_t h, int64_t i, int64_t j0, const float* ds, int64_t n) const {
    const int64_t* st = out.dscores_strides;
    float* row = out.dscores + b * st[0] + h * st[1] + i * st[2] + j0 * st[3];
    for (int64_t c = 0; c < n; ++c) row[c * st[3]] = ds ? ds[c] : 0.0f;
  }

  // Keys [j_begin, j_end) of key/value head (b, hk): their dK and dV rows stored, the rows' dQ
  // partial sums left in s.dq (unscaled).
  void run_keys(Scratch& s, int64_t b, int64_t hk, int64_t j_begin, int64_t j_end) const {
    const int64_t n = rows();
    const int64_t key_end = std::min(start_rows(s, b, hk), j_end);
    const float scale = static_cast<float>(p.scale);
    const float* kp[kLanes];
    const float* vp[kLanes];
    for (int64_t j0 = j_begin; j0 < key_end; j0 += kLanes) {
      const int nc = static_cast<int>(std::min<int64_t>(kLanes, key_end - j0));
      for (int c = 0; c < kLanes; ++c) {
        kp[c] = c < nc ? input_row(p.k.data, p.k.dtype, p.k.strides.data(), b, hk, j0 + c, p.dim_qk, dk(), s.kbuf + c * dk())
                       : s.zero;
        vp[c] = c < nc ? input_row(p.v.data, p.v.dtype, p.v.strides.data(), b, hk, j0 + c, p.dim_v, dv(), s.vbuf + c * dv())
                       : s.zero;
      }
      probabilities_and_score_gradients(s, b, hk, j0, nc, kp, vp);
      for (int c = 0; c < nc; ++c) {
        if (out.dv) {
          weighted_rows(s.row, s.prob, c, s.go, n, dv());  // dV_j = sum_r Pd_rj dO_r
          store_row(out.dv, out.dv_strides, b, hk, j0 + c, s.row, p.dim_v, 1.0f);
        }
        if (out.dk) {
          weighted_rows(s.row, s.grad, c, s.q, n, dk());  // dK_j = scale sum_r dS_rj q_r
          store_row(out.dk, out.dk_strides, b, hk, j0 + c, s.row, p.dim_qk, scale);
        }
      }
      for (int64_t qi = 0; out.dq && qi < n; ++qi) {  // dQ_r += sum_j dS_rj k_j
        float* dq = s.dq + qi * dk();
        const float* w = s.grad + qi * kLanes;
        for (int64_t d0 = 0; d0 < dk(); d0 += kLanes) {
          F acc = S::load(dq + d0);
          for (int c = 0; c < nc; ++c) acc = S::fmadd(S::set1(w[c]), S::load(kp[c] + d0), acc);
          S::store(dq + d0, acc);
        }
      }
    }
    // Keys no row sees get zero gradients.
    for (int64_t j = std::max(key_end, j_begin); j < j_end; ++j) {
      if (out.dv) store_row(out.dv, out.dv_strides, b, hk, j, s.zero, p.dim_v, 1.0f);
      if (out.dk) store_row(out.dk, out.dk_strides, b, hk, j, s.zero, p.dim_qk, 1.0f);
    }
    if (out.dscores && key_end < j_end) {
      const int64_t first = std::max(key_end, j_begin);
      for (int64_t qi = 0; qi < n; ++qi)
        store_score_gradients(b, hk * group() + qi / p.len_q, qi % p.len_q, first, nullptr, j_end - first);
    }
  }

  void store_dq(int64_t b, int64_t hk, int64_t qi, const float* dq) const {
    if (out.dq == nullptr) return;
    const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
    store_row(out.dq, out.dq_strides, b, h, i, dq, p.dim_qk, static_cast<float>(p.scale));
  }

  void run() const {
    const int threads = resolve_threads(p.num_threads);
    const int64_t groups = p.batch * p.heads_kv, nc = chunks(), n = rows();
    if (nc == 1) {
      parallel_for(groups, threads, [&](int64_t g, int) {
        Scratch s = allocate();
        run_keys(s, g / p.heads_kv, g % p.heads_kv, 0, p.len_k);
        for (int64_t qi = 0; qi < n; ++qi) store_dq(g / p.heads_kv, g % p.heads_kv, qi, s.dq + qi * dk());
        if constexpr (requires { S::stream_fence(); })
          if (stream_rows) S::stream_fence();  // (the rows streamed, visible to all)
      });
      return;
    }
    // Chunks of keys as tasks, each leaving its rows' dQ partial sums; then added in chunk order.
    const Tensor partial = out.dq ? Tensor::empty({groups, nc, n, dk()}) : Tensor();
    float* part = out.dq ? partial.data<float>() : nullptr;
    parallel_for(groups * nc, threads, [&](int64_t t, int) {
      const int64_t g = t / nc, c = t % nc;
      Scratch s = allocate();
      run_keys(s, g / p.heads_kv, g % p.heads_kv, c * kKeysPerChunk, std::min(p.len_k, (c + 1) * kKeysPerChunk));
      if (part) std::memcpy(part + t * n * dk(), s.dq, sizeof(float) * n * dk());
      if constexpr (requires { S::stream_fence(); })
        if (stream_rows) S::stream_fence();
    });
    parallel_for(part ? groups : 0, threads, [&](int64_t g, int) {
      float* sum = static_cast<float*>(thread_scratch(sizeof(float) * static_cast<size_t>(dk())));
      for (int64_t qi = 0; qi < n; ++qi) {
        std::fill(sum, sum + dk(), 0.0f);
        for (int64_t c = 0; c < nc; ++c) {
          const float* x = part + ((g * nc + c) * n + qi) * dk();
          for (int64_t d = 0; d < dk(); ++d) sum[d] += x[d];
        }
        store_dq(g / p.heads_kv, g % p.heads_kv, qi, sum);
      }
    });
  }
};

}  // namespace
}  // namespace mha::detail
