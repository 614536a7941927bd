// Logit soft-capping in the float32 kernels (Gemma 2, Grok; FlashAttention's softcap): a score s
// becomes c tanh(s / c) before the masks are added. The kernels hold scores in base 2 (q pre-scaled
// by scale * log2(e)), where the same map is c' tanh(s' / c') with c' = c log2(e), so it applies to
// their tiles as they are. The backward multiplies dS by the map's derivative, 1 - tanh^2.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/attention_problem.hpp"

namespace mha::detail {

template <class S>
struct Softcap {
  using F = typename S::F;
  using M = typename S::M;
  static constexpr int kLanes = S::kLanes;

  // tanh(y) / y = 1 + kTaylor[0] y^2 + ... + kTaylor[4] y^10 + O(y^12).
  static constexpr double kTaylor[5] = {-1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835, -1382.0 / 155925};

  bool on = false;
  F cap{}, inv_cap{};
  // Below 0.4 c, c tanh(x / c) = x R(x^2) with R(u) = 1 + a[0] u + ... + a[4] u^5: the Taylor
  // series of tanh(y) / y to y^10 with its coefficients divided by c^2k, so that the map needs
  // no division by c nor multiplication by it. `folded` where they and u^5 are floats (c from
  // 1e-3 to 1e3; past that the cap is far above any score, and the map takes x / c first).
  F a[5]{};
  bool folded = false;

  Softcap() = default;
  // For the kernels' base-2 scores of problem p (off without soft-capping).
  explicit Softcap(const AttentionProblem& p, double unit = 1.4426950408889634) : Softcap(p.softcap * unit) {}
  // For scores capped at c (0: off).
  explicit Softcap(double c) : on(c > 0) {
    if (!on) return;
    cap = S::set1(static_cast<float>(c));
    inv_cap = S::set1(static_cast<float>(1.0 / c));
    folded = c > 1e-3 && c < 1e3;
    const double inv_square = 1 / (c * c);  // (one division: the decoding kernels make a Softcap per row)
    double scale = 1;
    for (int k = 0; k < 5 && folded; ++k) {
      scale *= inv_square;
      a[k] = S::set1(static_cast<float>(kTaylor[k] * scale));
    }
  }

  // tanh(y), and 1 - tanh^2(y) in *slope where not null. Below |y| = 0.4 the Taylor polynomial to
  // y^11 (its remainder under 2.4e-8 there); above, (1 - e) / (1 + e) with e = exp(-2 |y|), whose
  // 1 - e keeps its relative accuracy from 0.4 up, and the slope as 4 e / (1 + e)^2, which keeps
  // its own where tanh rounds to 1. Maximum relative error of tanh 2.1e-7 (just above 0.4), of
  // the slope under 2e-7 (1 + |y|) (tests/test_exp2.cpp); both tails exact (+-1, slope 0), NaN kept.
  // Both forms are computed for every lane and selected (no branch: see rows()). The maps are
  // always inlined: called per vector, the AVX2 layer's 16 lanes (two ymm in a struct) went to
  // memory and back around each call.
  [[gnu::always_inline]] static F tanh(F y, F* slope = nullptr) {
    const F zero = S::zero(), one = S::set1(1.0f);
    const F t = S::mul(y, y);
    const F small = S::fmadd(y, taylor_tail(t), y);
    const M is_small = S::gt(S::set1(0.16f), t);  // |y| < 0.4
    const F a = S::max(y, S::sub(zero, y));
    const F e = S::exp2(S::mul(a, S::set1(-2.8853900817779268f)));  // exp(-2|y|) = 2^(-2 log2(e) |y|)
    const F denom = S::add(one, e);
    const F large_abs = S::div(S::sub(one, e), denom);
    const F large = S::select(S::gt(zero, y), S::sub(zero, large_abs), large_abs);
    if (slope) {
      const F large_slope = S::div(S::mul(S::set1(4.0f), e), S::mul(denom, denom));
      *slope = S::select(is_small, one_minus_square(small), large_slope);
    }
    return S::select(is_small, small, large);
  }

  // Where the scores of a column of a tile (one vector of queries over its rows), from `least`
  // to `greatest` in each lane, lie against the cap: each range takes its own map, every
  // vector of the column the same.
  enum class Range { near, unbent, bent };  // under 0.1 of the cap, under 0.4, anywhere
  Range range(F least, F greatest) const {
    const F y_low = S::mul(least, inv_cap), y_high = S::mul(greatest, inv_cap);
    const F t = S::max(S::mul(y_low, y_low), S::mul(y_high, y_high));  // (NaN and infinities fail both tests)
    if (!S::all(S::gt(S::set1(0.16f), t))) return Range::bent;
    return S::all(S::gt(S::set1(0.01f), t)) ? Range::near : Range::unbent;
  }

  // Under 0.4 of the cap: x R(x^2), 7 operations (the terms left out under 2.4e-8 relative).
  [[gnu::always_inline]] F unbent(F x, F* slope = nullptr) const {
    if (!folded) {  // (Taylor's tail from x / c)
      const F y = S::mul(x, inv_cap);
      const F tail = taylor_tail(S::mul(y, y));
      if (slope) *slope = one_minus_square(S::fmadd(y, tail, y));
      return S::fmadd(x, tail, x);
    }
    const F u = S::mul(x, x);
    F r = S::fmadd(a[4], u, a[3]);
    r = S::fmadd(r, u, a[2]);
    r = S::fmadd(r, u, a[1]);
    r = S::fmadd(r, u, a[0]);
    return finish_folded(x, S::fmadd(r, u, S::set1(1.0f)), slope);
  }
  // Under 0.1 of the cap: R to u^3, 5 operations (the terms left out under 2.2e-10 relative).
  [[gnu::always_inline]] F near(F x, F* slope = nullptr) const {
    if (!folded) return unbent(x, slope);
    const F u = S::mul(x, x);
    F r = S::fmadd(a[2], u, a[1]);
    r = S::fmadd(r, u, a[0]);
    return finish_folded(x, S::fmadd(r, u, S::set1(1.0f)), slope);
  }
  // Anywhere: tanh(), both of its forms for every lane.
  [[gnu::always_inline]] F bent(F x, F* slope = nullptr) const { return S::mul(cap, tanh(S::mul(x, inv_cap), slope)); }

  // The first `vecs` vectors of `rows` rows of a score tile (rows `stride` floats apart) capped in
  // place; the derivatives into `slope` (the same layout) where not null. Each column is first
  // scanned for its least and greatest scores, which pick its map (range()). A test per vector
  // instead, where some vectors of a tile bent and some did not, mispredicted often enough to make
  // the forward 1.27x slower (bf16, B=4 H=16 L=2048 d=64, a cap of 5 over scores of about 1: 148
  // ms against 117; float32 1.16x, the backward 1.07-1.10x); and below the bend the polynomial alone
  // costs 5 or 7 operations a vector, against 13 for the tested tanh and the scaling around it.
  void rows(float* tile, int64_t rows, int64_t stride, int vecs, float* slope = nullptr) const {
    for (int c = 0; c < vecs; ++c) {
      float* const column = tile + c * kLanes;
      float* const slope_column = slope ? slope + c * kLanes : nullptr;
      F least = S::set1(std::numeric_limits<float>::infinity()), greatest = S::sub(S::zero(), least);
      for (int64_t r = 0; r < rows; ++r) {
        const F x = S::load(column + r * stride);
        least = S::min(least, x), greatest = S::max(greatest, x);
      }
      with_map(least, greatest, [&](auto map) {
        for (int64_t r = 0; r < rows; ++r) {
          F d;
          S::store(column + r * stride, map(S::load(column + r * stride), slope_column ? &d : nullptr));
          if (slope_column) S::store(slope_column + r * stride, d);
        }
      });
    }
  }

  // fn(map) with the map (near, unbent or bent, as a callable (x, slope)) that range() picks for
  // scores from `least` to `greatest`.
  template <class Fn>
  void with_map(F least, F greatest, Fn fn) const {
    switch (range(least, greatest)) {
      case Range::near: fn([this](F x, F* d) { return near(x, d); }); break;
      case Range::unbent: fn([this](F x, F* d) { return unbent(x, d); }); break;
      case Range::bent: fn([this](F x, F* d) { return bent(x, d); }); break;
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

  // tanh(y) / y - 1 = t Q(t) for t = y^2: Taylor's series to y^11, Horner's scheme in t.
  [[gnu::always_inline]] static F taylor_tail(F t) {
    F q = S::set1(static_cast<float>(kTaylor[4]));
    for (int k = 3; k >= 0; --k) q = S::fmadd(q, t, S::set1(static_cast<float>(kTaylor[k])));
    return S::mul(q, t);
  }
  // 1 - th^2 in one rounding.
  [[gnu::always_inline]] static F one_minus_square(F th) { return S::fmadd(S::sub(S::zero(), th), th, S::set1(1.0f)); }
  // x R, and the slope 1 - (x R / c)^2 where wanted.
  [[gnu::always_inline]] F finish_folded(F x, F r, F* slope) const {
    const F capped = S::mul(x, r);
    if (slope) *slope = one_minus_square(S::mul(capped, inv_cap));
    return capped;
  }
};

}  // namespace mha::detail
