// Logit soft-capping in the float32 kernels (Gemma 2, Grok; FlashAttention's softcap): a score s
// becomes c tanh(s / c) before the masks are added. The kernels hold scores in base 2 (q pre-scaled
// by scale * log2(e)), where the same map is c' tanh(s' / c') with c' = c log2(e), so it applies to
// their tiles as they are. The backward multiplies dS by the map's derivative, 1 - tanh^2.
#pragma once

#include <cstdint>

#include "core/attention_problem.hpp"

namespace mha::detail {

template <class S>
struct Softcap {
  using F = typename S::F;
  using M = typename S::M;
  static constexpr int kLanes = S::kLanes;

  bool on = false;
  F cap{}, inv_cap{};

  Softcap() = default;
  // For the kernels' base-2 scores of problem p (off without soft-capping).
  explicit Softcap(const AttentionProblem& p, double unit = 1.4426950408889634) : on(p.softcap > 0) {
    if (!on) return;
    cap = S::set1(static_cast<float>(p.softcap * unit));
    inv_cap = S::set1(static_cast<float>(1.0 / (p.softcap * unit)));
  }

  // tanh(y), and 1 - tanh^2(y) in *slope where not null. Below |y| = 0.4 the Taylor polynomial to
  // y^11 (its remainder under 2.4e-8 there); above, (1 - e) / (1 + e) with e = exp(-2 |y|), whose
  // 1 - e keeps its relative accuracy from 0.4 up, and the slope as 4 e / (1 + e)^2, which keeps
  // its own where tanh rounds to 1. Maximum relative error of tanh 2.1e-7 (just above 0.4), of
  // the slope under 2e-7 (1 + |y|) (tests/test_exp2.cpp); both tails exact (+-1, slope 0), NaN kept.
  static F tanh(F y, F* slope = nullptr) {
    const F zero = S::zero(), one = S::set1(1.0f);
    const F a = S::max(y, S::sub(zero, y));
    const F y2 = S::mul(y, y);
    F poly = S::set1(-1382.0f / 155925.0f);
    poly = S::fmadd(poly, y2, S::set1(62.0f / 2835.0f));
    poly = S::fmadd(poly, y2, S::set1(-17.0f / 315.0f));
    poly = S::fmadd(poly, y2, S::set1(2.0f / 15.0f));
    poly = S::fmadd(poly, y2, S::set1(-1.0f / 3.0f));
    const F small = S::fmadd(S::mul(poly, y2), y, y);
    const M is_small = S::gt(S::set1(0.4f), a);
    if (S::all(is_small)) {  // (Gemma 2's cap of 50 over scores of a few units: the usual case)
      if (slope) *slope = S::sub(one, S::mul(small, small));
      return small;
    }
    const F e = S::exp2(S::mul(a, S::set1(-2.8853900817779268f)));  // exp(-2|y|) = 2^(-2 log2(e) |y|)
    const F denom = S::add(one, e);
    const F large_abs = S::div(S::sub(one, e), denom);
    const F large = S::select(S::gt(zero, y), S::sub(zero, large_abs), large_abs);
    if (slope) {
      const F large_slope = S::div(S::mul(S::set1(4.0f), e), S::mul(denom, denom));
      *slope = S::select(is_small, S::sub(one, S::mul(small, small)), large_slope);
    }
    return S::select(is_small, small, large);
  }

  // c tanh(x / c), and its derivative in *slope where not null.
  F apply(F x, F* slope = nullptr) const { return S::mul(cap, tanh(S::mul(x, inv_cap), slope)); }

  // The first `vecs` vectors of `rows` rows of a score tile (rows `stride` floats apart) capped in
  // place; the derivatives into `slope` (the same layout) where not null.
  void rows(float* tile, int64_t rows, int64_t stride, int vecs, float* slope = nullptr) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < vecs; ++c) {
        float* at = tile + r * stride + c * kLanes;
        F d;
        S::store(at, apply(S::load(at), slope ? &d : nullptr));
        if (slope) S::store(slope + r * stride + c * kLanes, d);
      }
  }

  // dS (rows of a tile, as in rows()) times the slopes rows() left: q.k's share of the gradient.
  static void chain(float* ds, const float* slope, int64_t rows, int64_t stride, int vecs) {
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < vecs; ++c) {
        float* at = ds + r * stride + c * kLanes;
        S::store(at, S::mul(S::load(at), S::load(slope + r * stride + c * kLanes)));
      }
  }
};

}  // namespace mha::detail
