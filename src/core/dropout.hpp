// Dropout on attention weights as a pure function of (seed, row, key): no state, no stored mask.
// The fused kernels, the reference and a future backward all regenerate the same mask, on any
// thread count. A row is one (batch, head, query) triple: row = (b * Hq + h) * Lq + i.
#pragma once

// Functions are `static inline`: the AVX-512 kernel file includes this header too, and internal
// linkage keeps its AVX-512 copies from being picked by the linker for the portable code.

#include <cstdint>

namespace mha::detail {

static inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A 32-bit finaliser with good avalanche ("lowbias32"); 32-bit so that it vectorises.
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

struct DropoutRowKey {
  uint32_t lo, hi;
};

static inline DropoutRowKey dropout_row_key(uint64_t seed, uint64_t row) {
  const uint64_t k = splitmix64(seed ^ splitmix64(row));
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// Uniform 32 random bits for key j of a row.
static inline uint32_t dropout_bits(DropoutRowKey key, uint32_t j) { return mix32(mix32(j ^ key.lo) + key.hi); }

// A weight is kept when its bits are >= this threshold, so P(drop) = threshold / 2^32 ~ p.
// Valid for p in [0, 1); p == 1 drops everything and is handled before any kernel runs.
static inline uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

}  // namespace mha::detail
