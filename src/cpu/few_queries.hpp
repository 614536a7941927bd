// Attention for a handful of queries per head: decoding (one new token against a key/value cache,
// or a few speculative ones). The tile kernel (flash_forward.hpp) puts queries in the lanes of a
// 48-wide panel; with one query per head, 15 of every 16 lanes (47 of 48 on AVX-512) compute
// nothing, and a decoding step ran at 0.2-0.6x PyTorch's. Here the lanes run over the head
// dimension instead: each score is a dot product of a query row and a key row, 16 keys at a time
// (their partial sums transposed in registers and added, one vector of 16 scores), and the output
// accumulates O += p V along value rows. The query heads that share a key/value head (GQA) are
// one task, so each key block is read once for all of them; long caches are split into shape-fixed
// runs of keys whose partial softmax states are merged in order afterwards, so the bits do not
// depend on the thread count. Internal linkage: each ISA's file compiles its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/attention_problem.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/tile_kernels.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {
namespace {

template <class S>
struct FewQueries {
  using F = typename S::F;
  using M = typename S::M;
  using T = Tiles<S>;
  static constexpr int kLanes = S::kLanes;
  static constexpr int kKeys = kLanes;  // keys per block: one vector of scores
  // Up to kFewQueriesPerHead (4) queries per head: at 4 a task does 4x the dot products of one,
  // while the tile kernel's cost does not move until 16 (AVX2) or 48 (AVX-512) queries.
  static constexpr int64_t kMaxQueriesPerHead = kFewQueriesPerHead;
  // Keys per run of a split cache: runs are tasks of their own (a cache of 4096 keys and 8
  // key/value heads makes 32), merged afterwards. Fixed, so the bits depend on the shape only.
  static constexpr int64_t kKeysPerRun = 1024;

  const AttentionProblem& p;
  const ForwardOutputs& o;

  // Dropout and the weights matrix stay with the tile kernel.
  static bool applies(const AttentionProblem& p, const ForwardOutputs& o) {
    return p.len_q <= kMaxQueriesPerHead && p.dropout_p == 0 && o.weights == nullptr && o.average_weights == nullptr;
  }

  static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
  int64_t group() const { return p.heads_q / p.heads_kv; }
  int64_t queries() const { return group() * p.len_q; }  // per task: query (h, i) is number (h % group) * Lq + i
  int64_t runs() const { return (p.len_k + kKeysPerRun - 1) / kKeysPerRun; }
  int64_t dk() const { return round_up(p.dim_qk, kLanes); }  // rows padded with zeros to whole vectors
  int64_t dv() const { return round_up(p.dim_v, kLanes); }
  int64_t state_floats() const { return dv() + 2; }  // a run's partial result per query: O, then m and l

  // Key and value rows are read in place when they are float32 of whole vectors; otherwise each
  // block is widened or copied into zero-padded rows.
  bool keys_in_place() const { return p.k.dtype == DType::f32 && p.dim_qk % kLanes == 0; }
  bool values_in_place() const { return p.v.dtype == DType::f32 && p.dim_v % kLanes == 0; }

  struct Scratch {
    float* q;       // [n][dk] queries, scaled by scale * log2(e)
    float* acc;     // [n][dv] O, unnormalised
    float* m;       // [n] running max (base 2)
    float* l;       // [n][kLanes] running sums, one per lane, added up at the end
    float* kbuf;    // [kKeys][dk]
    float* vbuf;    // [kKeys][dv]
    float* zero;    // [max(dk, dv)]
    float* sums;    // [kKeys][kLanes] partial dot products, then transposed
    float* turned;  // [kLanes][kKeys]
    float* prob;    // [kKeys]
    int64_t* lim;   // [n] keys [0, lim) visible to each query
    const float* kp[kKeys];
    const float* vp[kKeys];
  };

  Scratch allocate() const {
    const int64_t n = queries();
    const int64_t floats = n * (dk() + dv() + 1 + kLanes) + kKeys * (dk() + dv()) + std::max(dk(), dv()) +
                           2 * kKeys * kLanes + kKeys + 2 * n;  // the last: lim, as int64
    float* f = static_cast<float*>(thread_scratch(static_cast<size_t>(round_up(floats * 4, 64) + 64)));
    Scratch s;
    s.lim = reinterpret_cast<int64_t*>(f), f += 2 * n;  // first: the buffer's start is aligned for int64
    s.sums = f, f += kKeys * kLanes;
    s.turned = f, f += kKeys * kLanes;
    s.l = f, f += n * kLanes;
    s.q = f, f += n * dk();
    s.acc = f, f += n * dv();
    s.kbuf = f, f += kKeys * dk();
    s.vbuf = f, f += kKeys * dv();
    s.zero = f, f += std::max(dk(), dv());
    s.prob = f, f += kKeys;
    s.m = f;
    std::memset(s.zero, 0, sizeof(float) * std::max(dk(), dv()));
    return s;
  }

  // Row j of k (or v) of batch b, head hk, as float32 of `padded` elements: in place, or into dst.
  const float* key_row(const TensorView& t, int64_t b, int64_t hk, int64_t j, int64_t width, int64_t padded,
                       bool in_place, float* dst) const {
    const int64_t offset = b * t.strides[0] + hk * t.strides[1] + j * t.strides[2];
    if (in_place) return t.data_as<float>() + offset;
    if (t.dtype == DType::f32) std::memcpy(dst, t.data_as<float>() + offset, sizeof(float) * width);
    else T::widen(t.dtype, t.data_as<uint16_t>() + offset, dst, width);
    std::fill(dst + width, dst + padded, 0.0f);
    return dst;
  }

  // The scores of one query against the block's kKeys key rows: per key a vector of partial sums
  // over the head dimension, four keys at a time (independent chains), then transposed so that
  // adding the rows gives one score per lane.
  F scores(const Scratch& s, const float* q, int64_t d) const {
    for (int c = 0; c < kKeys; c += 4) {
      F a0 = S::zero(), a1 = S::zero(), a2 = S::zero(), a3 = S::zero();
      for (int64_t d0 = 0; d0 < d; d0 += kLanes) {
        const F x = S::load(q + d0);
        a0 = S::fmadd(S::load(s.kp[c] + d0), x, a0);
        a1 = S::fmadd(S::load(s.kp[c + 1] + d0), x, a1);
        a2 = S::fmadd(S::load(s.kp[c + 2] + d0), x, a2);
        a3 = S::fmadd(S::load(s.kp[c + 3] + d0), x, a3);
      }
      S::store(s.sums + c * kLanes, a0);
      S::store(s.sums + (c + 1) * kLanes, a1);
      S::store(s.sums + (c + 2) * kLanes, a2);
      S::store(s.sums + (c + 3) * kLanes, a3);
    }
    T::transpose_square(s.sums, s.turned);
    F total = S::load(s.turned);
    for (int r = 1; r < kLanes; ++r) total = S::add(total, S::load(s.turned + r * kLanes));
    return total;
  }

  // Keys [j_begin, j_end) for every query of key/value head (b, hk). Leaves O, m and the lane sums
  // of each query in the scratch.
  void run_keys(Scratch& s, int64_t b, int64_t hk, int64_t j_begin, int64_t j_end) const {
    const int64_t n = queries();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const float qscale = static_cast<float>(p.scale) * kLog2e;
    int64_t key_end = j_begin;
    for (int64_t qi = 0; qi < n; ++qi) {
      const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
      const int64_t offset = b * p.q.strides[0] + h * p.q.strides[1] + i * p.q.strides[2];
      float* q = s.q + qi * dk();
      if (p.q.dtype == DType::f32) std::memcpy(q, p.q.data_as<float>() + offset, sizeof(float) * p.dim_qk);
      else T::widen(p.q.dtype, p.q.data_as<uint16_t>() + offset, q, p.dim_qk);
      for (int64_t d = 0; d < p.dim_qk; ++d) q[d] *= qscale;
      std::fill(q + p.dim_qk, q + dk(), 0.0f);
      std::fill(s.acc + qi * dv(), s.acc + (qi + 1) * dv(), 0.0f);
      std::fill(s.l + qi * kLanes, s.l + (qi + 1) * kLanes, 0.0f);
      s.m[qi] = neg_inf;
      s.lim[qi] = std::min(p.causal_end(i), j_end);
      key_end = std::max(key_end, s.lim[qi]);
    }
    alignas(64) float lane[kLanes];
    const int64_t dkp = dk(), dvp = dv();
    const bool k_in_place = keys_in_place(), v_in_place = values_in_place();
    for (int64_t j0 = j_begin; j0 < key_end; j0 += kKeys) {
      const int nc = static_cast<int>(std::min<int64_t>(kKeys, key_end - j0));
      for (int c = 0; c < kKeys; ++c) {
        if (c >= nc) {
          s.kp[c] = s.vp[c] = s.zero;
          continue;
        }
        s.kp[c] = key_row(p.k, b, hk, j0 + c, p.dim_qk, dkp, k_in_place, s.kbuf + c * dkp);
        s.vp[c] = key_row(p.v, b, hk, j0 + c, p.dim_v, dvp, v_in_place, s.vbuf + c * dvp);
      }
      for (int64_t qi = 0; qi < n; ++qi) {
        if (j0 >= s.lim[qi]) continue;  // past causality for this query
        const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
        F x = scores(s, s.q + qi * dkp, dkp);
        for (int t = 0; t < p.num_masks; ++t) x = S::add(x, T::mask_row(p.masks[t], b, h, i, j0, nc));
        const int visible = static_cast<int>(std::min<int64_t>(nc, s.lim[qi] - j0));
        const M keep = static_cast<M>(visible >= kLanes ? (1u << kLanes) - 1 : (1u << visible) - 1);
        x = S::select(keep, x, S::set1(neg_inf));
        S::store(lane, x);
        const float m_old = s.m[qi];
        float m_new = m_old;
        for (int c = 0; c < kLanes; ++c) m_new = lane[c] > m_new || std::isnan(lane[c]) ? lane[c] : m_new;
        // A query that has seen only -inf keeps m = -inf; subtracting 0 instead makes its p 0, not NaN.
        const float m_use = m_new == neg_inf ? 0.0f : m_new;
        const F pr = S::exp2(S::sub(x, S::set1(m_use)));
        S::store(lane, S::exp2(S::set1(m_old - m_use)));
        const float alpha = lane[0];
        float* l = s.l + qi * kLanes;
        S::store(l, S::fmadd(S::load(l), S::set1(alpha), pr));
        s.m[qi] = m_new;
        // O = alpha O + sum_c p_c v_c: every key, a zero weight too (0 x inf is NaN, as in P @ V).
        S::store(s.prob, pr);
        accumulate_values(s, s.acc + qi * dvp, alpha, nc, dvp);
      }
    }
  }

  // acc = alpha acc + sum_{c < nc} prob[c] v_c over dv floats, four vectors of acc at a time held
  // in registers across the block's value rows (a row of up to 64 floats is then read whole, in
  // order); kept in memory between rows, the loads and stores of acc were half the work of a
  // decoding step whose cache sits in L3.
  void accumulate_values(const Scratch& s, float* acc, float alpha, int nc, int64_t dv) const {
    const F scale = S::set1(alpha);
    int64_t d0 = 0;
    for (; d0 + 4 * kLanes <= dv; d0 += 4 * kLanes) {
      F a0 = S::mul(S::load(acc + d0), scale), a1 = S::mul(S::load(acc + d0 + kLanes), scale);
      F a2 = S::mul(S::load(acc + d0 + 2 * kLanes), scale), a3 = S::mul(S::load(acc + d0 + 3 * kLanes), scale);
      for (int c = 0; c < nc; ++c) {
        const F w = S::set1(s.prob[c]);
        const float* v = s.vp[c] + d0;
        a0 = S::fmadd(w, S::load(v), a0);
        a1 = S::fmadd(w, S::load(v + kLanes), a1);
        a2 = S::fmadd(w, S::load(v + 2 * kLanes), a2);
        a3 = S::fmadd(w, S::load(v + 3 * kLanes), a3);
      }
      S::store(acc + d0, a0);
      S::store(acc + d0 + kLanes, a1);
      S::store(acc + d0 + 2 * kLanes, a2);
      S::store(acc + d0 + 3 * kLanes, a3);
    }
    for (; d0 < dv; d0 += kLanes) {
      F a = S::mul(S::load(acc + d0), scale);
      for (int c = 0; c < nc; ++c) a = S::fmadd(S::set1(s.prob[c]), S::load(s.vp[c] + d0), a);
      S::store(acc + d0, a);
    }
  }

  float lane_sum(const float* l) const {
    float sum = 0.0f;
    for (int c = 0; c < kLanes; ++c) sum += l[c];
    return sum;
  }

  // O / l into the output (in its dtype) and the log-sum-exp, for query qi of key/value head (b, hk).
  void store(int64_t b, int64_t hk, int64_t qi, const float* acc, float m, float l) const {
    const int64_t h = hk * group() + qi / p.len_q, i = qi % p.len_q;
    const float inv_l = l > 0 ? 1.0f / l : 0.0f;
    const int64_t offset = b * o.out_strides[0] + h * o.out_strides[1] + i * o.out_strides[2];
    with_output_elements(o.out, o.out_dtype, offset, [&](auto* out, auto round) {
      for (int64_t d = 0; d < p.dim_v; ++d) out[d * o.out_strides[3]] = round(acc[d] * inv_l);
    });
    if (o.lse != nullptr) {
      o.lse[(b * p.heads_q + h) * p.len_q + i] =
          l > 0 ? (m + std::log2(l)) * kLn2 : std::numeric_limits<float>::infinity();
    }
  }

  void run() const {
    const int threads = resolve_threads(p.num_threads);
    const int64_t groups = p.batch * p.heads_kv, n = queries(), r = runs();
    if (r == 1) {
      parallel_for(groups, threads, [&](int64_t g, int) {
        Scratch s = allocate();
        run_keys(s, g / p.heads_kv, g % p.heads_kv, 0, p.len_k);
        for (int64_t qi = 0; qi < n; ++qi)
          store(g / p.heads_kv, g % p.heads_kv, qi, s.acc + qi * dv(), s.m[qi], lane_sum(s.l + qi * kLanes));
      });
      return;
    }
    // Runs of keys as tasks, each leaving its (O, m, l) per query; then each query's runs merged
    // in order: m the largest, and every run's O and l scaled by 2^(m_run - m).
    const Tensor states = Tensor::empty({groups, r, n, state_floats()});  // the count checked there
    float* st = states.data<float>();
    parallel_for(groups * r, threads, [&](int64_t t, int) {
      const int64_t g = t / r, run = t % r;
      Scratch s = allocate();
      run_keys(s, g / p.heads_kv, g % p.heads_kv, run * kKeysPerRun, std::min(p.len_k, (run + 1) * kKeysPerRun));
      for (int64_t qi = 0; qi < n; ++qi) {
        float* state = st + (t * n + qi) * state_floats();
        std::memcpy(state, s.acc + qi * dv(), sizeof(float) * dv());
        state[dv()] = s.m[qi];
        state[dv() + 1] = lane_sum(s.l + qi * kLanes);
      }
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
      }
    });
  }
};

}  // namespace
}  // namespace mha::detail
