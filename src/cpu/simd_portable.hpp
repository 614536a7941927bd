// 16 float "lanes" as a plain array: the portable fallback of the Avx512 layer, with the same
// operations, written so that any compiler vectorises it for the baseline ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "mha/dtype.hpp"

namespace mha::detail::simd {

struct Portable {
  static constexpr int kLanes = 16;
  // Register block of the tile products (tile_kernels.hpp): as AVX2: the compiler's vectors are at most that wide here.
  static constexpr int kBlockRows = 4, kBlockVecs = 1, kRowsPerTile = 8;
  struct F {
    float v[kLanes];
  };
  struct U {
    uint32_t v[kLanes];
  };
  using M = uint32_t;  // bit i: lane i

#define MHA_LANES for (int i = 0; i < kLanes; ++i)
  static F load(const float* p) { F r; MHA_LANES r.v[i] = p[i]; return r; }
  static void store(float* p, F a) { MHA_LANES p[i] = a.v[i]; }
  static F set1(float x) { F r; MHA_LANES r.v[i] = x; return r; }
  static F zero() { return set1(0.0f); }
  static F fmadd(F a, F b, F c) { F r; MHA_LANES r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  static F add(F a, F b) { F r; MHA_LANES r.v[i] = a.v[i] + b.v[i]; return r; }
  static F sub(F a, F b) { F r; MHA_LANES r.v[i] = a.v[i] - b.v[i]; return r; }
  static F mul(F a, F b) { F r; MHA_LANES r.v[i] = a.v[i] * b.v[i]; return r; }
  static F div(F a, F b) { F r; MHA_LANES r.v[i] = a.v[i] / b.v[i]; return r; }
  static F max(F a, F b) { F r; MHA_LANES r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
  // The lanes in reverse order (lane i takes lane 15 - i).
  static F reverse(F a) { F r; MHA_LANES r.v[i] = a.v[kLanes - 1 - i]; return r; }
  // a * b where a is finite kept finite (saturated at +-FLT_MAX rather than overflowing to inf);
  // an infinite or NaN a as multiplied.
  static F mul_saturated(F a, F b) {
    constexpr float big = std::numeric_limits<float>::max();
    F r;
    MHA_LANES r.v[i] = std::isfinite(a.v[i]) ? std::clamp(a.v[i] * b.v[i], -big, big) : a.v[i] * b.v[i];
    return r;
  }
  static F select(M m, F t, F f) { F r; MHA_LANES r.v[i] = (m >> i) & 1u ? t.v[i] : f.v[i]; return r; }
  static M eq(F a, F b) { M m = 0; MHA_LANES m |= static_cast<M>(a.v[i] == b.v[i]) << i; return m; }
  static M gt(F a, F b) { M m = 0; MHA_LANES m |= static_cast<M>(a.v[i] > b.v[i]) << i; return m; }
  static bool all(M m) { return m == 0xffffu; }
  // 2^x; below 2^-100 flushed to zero, as in the AVX-512 layer.
  static F exp2(F x) { F r; MHA_LANES r.v[i] = x.v[i] < -100.0f ? 0.0f : std::exp2(x.v[i]); return r; }
  static float reduce_max(F a) { float m = a.v[0]; MHA_LANES m = a.v[i] > m ? a.v[i] : m; return m; }

  static U load_u(const uint32_t* p) { U r; MHA_LANES r.v[i] = p[i]; return r; }
  static U set1_u(uint32_t x) { U r; MHA_LANES r.v[i] = x; return r; }
  static U xor_u(U a, U b) { U r; MHA_LANES r.v[i] = a.v[i] ^ b.v[i]; return r; }
  static U add_u(U a, U b) { U r; MHA_LANES r.v[i] = a.v[i] + b.v[i]; return r; }
  static U mullo_u(U a, U b) { U r; MHA_LANES r.v[i] = a.v[i] * b.v[i]; return r; }
  template <int n> static U shr_u(U a) { U r; MHA_LANES r.v[i] = a.v[i] >> n; return r; }
  static M ge_u(U a, U b) { M m = 0; MHA_LANES m |= static_cast<M>(a.v[i] >= b.v[i]) << i; return m; }
  static M lt_i(U a, U b) {
    M m = 0;
    MHA_LANES m |= static_cast<M>(static_cast<int32_t>(a.v[i]) < static_cast<int32_t>(b.v[i])) << i;
    return m;
  }
#undef MHA_LANES

  // kLanes bfloat16 / float16 values (as bits) into a register, exactly.
  static F load_bf16(const uint16_t* p) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(bfloat16::from_bits(p[i]));
    return r;
  }
  static F load_f16(const uint16_t* p) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(float16::from_bits(p[i]));
    return r;
  }

  // kLanes float8 e4m3 values (as bits) into a register, exactly.
  static F load_f8(const uint8_t* p) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(float8_e4m3::from_bits(p[i]));
    return r;
  }
  // The values times 2^-8, exactly (for callers that fold the 2^8 elsewhere).
  static F load_f8_over_256(const uint8_t* p) {
    F r = load_f8(p);
    for (int i = 0; i < kLanes; ++i) r.v[i] *= 0.00390625f;
    return r;
  }
  // (The scalar conversion takes NaN bytes as they come: no test per block of rows.)
  static F load_f8_over_256_finite(const uint8_t* p) { return load_f8_over_256(p); }
  static bool f8_rows_free_of_nan(const uint8_t* const*, int, int64_t) { return false; }
  // kLanes float8 e5m2 values (as bits), exactly.
  static F load_f8e5m2(const uint8_t* p) {
    F r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(float8_e5m2::from_bits(p[i]));
    return r;
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

}  // namespace mha::detail::simd
