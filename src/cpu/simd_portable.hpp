// 16 float lanes as four GCC/Clang vectors of 4 (vector_size(16)): the portable fallback of the
// Avx512 layer, with the same operations. Each quarter is one register of the baseline ISA (SSE2 on
// x86-64, NEON on AArch64), so a register block of them stays in registers as the AVX2 layer's
// halves do: plain arrays of 16 floats were vectorised with shuffles and spills, and one vector of
// 16 (vector_size(64)) was kept in memory, a load and store per multiply-add (docs/PERFORMANCE.md,
// "The portable path": this layout takes a quarter of the first one's time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/exp2_polynomial.hpp"
#include "mha/dtype.hpp"

namespace mha::detail::simd {

namespace {  // internal linkage, one copy per instruction set's files (simd_avx2.hpp says why)

struct Portable {
  static constexpr int kLanes = 16;
  // Register block of the tile products (tile_kernels.hpp): 2 rows of 16 lanes are 8 SSE2
  // registers of accumulators, with the 4 of the weights and a broadcast inside x86-64's 16 (4
  // rows would need all 16 for the accumulators alone).
  static constexpr int kBlockRows = 2, kBlockVecs = 1, kRowsPerTile = 8;
  using V4 = float __attribute__((vector_size(16)));
  using U4 = uint32_t __attribute__((vector_size(16)));
  using I4 = int32_t __attribute__((vector_size(16)));  // (comparisons: 0 or -1 per lane)
  struct F {
    V4 q[4];
  };
  struct U {
    U4 q[4];
  };
  using M = uint32_t;  // bit i: lane i

  // op on each quarter (constant indices, so that the quarters can live in registers).
  template <class R, class A, class Op> static R map(const A& a, Op op) {
    return {{op(a.q[0]), op(a.q[1]), op(a.q[2]), op(a.q[3])}};
  }
  template <class R, class A, class B, class Op> static R map(const A& a, const B& b, Op op) {
    return {{op(a.q[0], b.q[0]), op(a.q[1], b.q[1]), op(a.q[2], b.q[2]), op(a.q[3], b.q[3])}};
  }
  // Bit i set where lane i of the four comparisons' results is -1.
  static M bits_of(I4 c0, I4 c1, I4 c2, I4 c3) {
    const I4 c[4] = {c0, c1, c2, c3};
    M m = 0;
    for (int i = 0; i < kLanes; ++i) m |= static_cast<M>(c[i / 4][i % 4] & 1) << i;
    return m;
  }
  template <class A, class Op> static M bits_of(const A& a, const A& b, Op op) {
    return bits_of(op(a.q[0], b.q[0]), op(a.q[1], b.q[1]), op(a.q[2], b.q[2]), op(a.q[3], b.q[3]));
  }

  // Loads and stores at any float's address, a quarter (16 bytes) at a time: one memcpy of all
  // 64 bytes went through a copy on the stack, and Clang does not lower a vector type's alignment.
  template <class V, class E> static V load_quarter(const E* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static F load(const float* p) {
    return {{load_quarter<V4>(p), load_quarter<V4>(p + 4), load_quarter<V4>(p + 8), load_quarter<V4>(p + 12)}};
  }
  static void store(float* p, F a) {
    for (int k = 0; k < 4; ++k) std::memcpy(p + 4 * k, &a.q[k], sizeof a.q[k]);
  }
  static F set1(float x) { const V4 v = x - V4{}; return {{v, v, v, v}}; }  // (x - 0 is x, -0 and NaN included)
  static F zero() { return {}; }
  static F fmadd(F a, F b, F c) {
    return {{a.q[0] * b.q[0] + c.q[0], a.q[1] * b.q[1] + c.q[1], a.q[2] * b.q[2] + c.q[2], a.q[3] * b.q[3] + c.q[3]}};
  }
  static F add(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x + y; }); }
  static F sub(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x - y; }); }
  static F mul(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x * y; }); }
  static F div(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x / y; }); }
  static F max(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x > y ? x : y; }); }
  static F min(F a, F b) { return map<F>(a, b, [](V4 x, V4 y) { return x < y ? x : y; }); }
  // The lanes in reverse order (lane i takes lane 15 - i).
  static F reverse(F a) {
    const auto r = [](V4 x) { return __builtin_shufflevector(x, x, 3, 2, 1, 0); };
    return {{r(a.q[3]), r(a.q[2]), r(a.q[1]), r(a.q[0])}};
  }
  // a * b where a is finite kept finite (saturated at +-FLT_MAX rather than overflowing to inf);
  // an infinite or NaN a as multiplied.
  static F mul_saturated(F a, F b) {
    constexpr float big = std::numeric_limits<float>::max();
    F r;
    for (int i = 0; i < kLanes; ++i) {
      const float x = a.q[i / 4][i % 4], y = x * b.q[i / 4][i % 4];
      r.q[i / 4][i % 4] = std::isfinite(x) ? std::clamp(y, -big, big) : y;
    }
    return r;
  }
  static F select(M m, F t, F f) {
    F r;
    for (int k = 0; k < 4; ++k) {
      const I4 lanes = ((static_cast<int32_t>(m >> (4 * k)) & I4{1, 2, 4, 8}) != 0);
      r.q[k] = lanes ? t.q[k] : f.q[k];
    }
    return r;
  }
  static M eq(F a, F b) { return bits_of(a, b, [](V4 x, V4 y) { return x == y; }); }
  static M gt(F a, F b) { return bits_of(a, b, [](V4 x, V4 y) { return x > y; }); }
  static bool all(M m) { return m == 0xffffu; }
  // 2^x with the AVX2 and AVX-512 layers' rules: below 2^-100 flushed to zero (so -inf gives 0),
  // NaN kept, kExp2Poly on f = x - n for n the nearest integer (ties to even: the sum with 1.5 2^23
  // rounds there, |x| <= 128), and 2^n from the exponent bits (n = 128 gives infinity).
  static V4 exp2_quarter(V4 x) {
    const V4 lo = -100.0f - V4{}, hi = 128.0f - V4{}, shift = 12582912.0f - V4{};
    V4 c = x < lo ? lo : x;  // (a NaN compares false and stays)
    c = c > hi ? hi : c;
    const V4 n = (c + shift) - shift;
    const V4 p = exp2_polynomial(c - n, [](V4 a, V4 b, V4 d) { return a * b + d; }, [](float k) { return k - V4{}; });
    const I4 e = (__builtin_convertvector(n == n ? n : V4{}, I4) + 127) << 23;  // (NaN: p is NaN)
    V4 two_n;
    std::memcpy(&two_n, &e, sizeof two_n);
    return x < lo ? V4{} : p * two_n;
  }
  static F exp2(F x) { return map<F>(x, exp2_quarter); }
  static float reduce_max(F a) {
    float m = a.q[0][0];
    for (int i = 1; i < kLanes; ++i) m = a.q[i / 4][i % 4] > m ? a.q[i / 4][i % 4] : m;
    return m;
  }

  static U load_u(const uint32_t* p) {
    return {{load_quarter<U4>(p), load_quarter<U4>(p + 4), load_quarter<U4>(p + 8), load_quarter<U4>(p + 12)}};
  }
  static U set1_u(uint32_t x) { const U4 v = x - U4{}; return {{v, v, v, v}}; }
  static U xor_u(U a, U b) { return map<U>(a, b, [](U4 x, U4 y) { return x ^ y; }); }
  static U add_u(U a, U b) { return map<U>(a, b, [](U4 x, U4 y) { return x + y; }); }
  static U mullo_u(U a, U b) { return map<U>(a, b, [](U4 x, U4 y) { return x * y; }); }
  template <int n> static U shr_u(U a) { return map<U>(a, [](U4 x) { return x >> n; }); }
  static M ge_u(U a, U b) { return bits_of(a, b, [](U4 x, U4 y) { return x >= y; }); }
  static M lt_i(U a, U b) {
    return bits_of(a, b, [](U4 x, U4 y) { return reinterpret_cast<I4>(x) < reinterpret_cast<I4>(y); });
  }

  // kLanes bfloat16 / float16 values (as bits) into a register, exactly.
  static F load_bf16(const uint16_t* p) {
    float x[kLanes];
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(bfloat16::from_bits(p[i]));
    return load(x);
  }
  static F load_f16(const uint16_t* p) {
    float x[kLanes];
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(float16::from_bits(p[i]));
    return load(x);
  }

  // kLanes float8 e4m3 values (as bits) into a register, exactly.
  static F load_f8(const uint8_t* p) {
    float x[kLanes];
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(float8_e4m3::from_bits(p[i]));
    return load(x);
  }
  // The values times 2^-8, exactly (for callers that fold the 2^8 elsewhere).
  static F load_f8_over_256(const uint8_t* p) {
    return mul(load_f8(p), set1(0.00390625f));
  }
  // (The scalar conversion takes NaN bytes as they come: no test per block of rows.)
  static F load_f8_over_256_finite(const uint8_t* p) { return load_f8_over_256(p); }
  static bool f8_rows_free_of_nan(const uint8_t* const*, int, int64_t) { return false; }
  // kLanes float8 e5m2 values (as bits), exactly.
  static F load_f8e5m2(const uint8_t* p) {
    float x[kLanes];
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(float8_e5m2::from_bits(p[i]));
    return load(x);
  }
  static void widen_f8e5m2(const uint8_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(float8_e5m2::from_bits(src[i]));
  }
  static void widen_f8(const uint8_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(float8_e4m3::from_bits(src[i]));
  }

  // n bfloat16 / float16 values (as bits) to float32, exactly.
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(bfloat16::from_bits(src[i]));
  }
  static void widen_f16(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(float16::from_bits(src[i]));
  }
};

}  // namespace

}  // namespace mha::detail::simd
