// Reads fuzzer bytes as a stream of small decisions (sizes, flags, values).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

struct FuzzInput {
  const uint8_t* data;
  size_t size;
  uint8_t byte() { return size ? (--size, *data++) : 0; }
  // A byte from the end of the input: for decisions added after inputs were kept as regressions,
  // which then read the front of the stream as before (they are longer than what it consumes).
  uint8_t tail_byte() { return size ? data[--size] : 0; }
  bool flag() { return byte() & 1; }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | byte();
    return v;
  }
  // [0, max] (max up to the int64 limit: an absurd size's)
  int64_t small(int64_t max) { return static_cast<int64_t>(byte() % (static_cast<uint64_t>(max) + 1)); }
  // A size that is usually small, sometimes 0, sometimes large or absurd: 2^k - 1, 2^k, 2^k + 1
  // for k up to 62, or within 5 of the int64 limit.
  int64_t dim() {
    const uint8_t b = byte();
    if (b < 200) return b % 9;
    if (b < 225) return b % 70;
    if (b < 250) return (int64_t{1} << (byte() % 63)) + b % 3 - 1;
    return std::numeric_limits<int64_t>::max() - (b - 250);
  }
  float value() {
    uint16_t bits = static_cast<uint16_t>(byte() | byte() << 8);
    return static_cast<float>(static_cast<int16_t>(bits)) / 4096.0f;  // finite, within +-8
  }
};
