// Reads fuzzer bytes as a stream of small decisions (sizes, flags, values).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

struct FuzzInput {
  const uint8_t* data;
  size_t size;
  uint8_t byte() { return size ? (--size, *data++) : 0; }
  bool flag() { return byte() & 1; }
  int64_t small(int64_t max) { return byte() % (max + 1); }  // [0, max]
  // A size that is usually small, sometimes 0, sometimes absurd (up to 2^62).
  int64_t dim() {
    const uint8_t b = byte();
    if (b < 200) return b % 9;
    if (b < 230) return b % 70;
    return int64_t{1} << (b % 63);
  }
  float value() {
    uint16_t bits = static_cast<uint16_t>(byte() | byte() << 8);
    return static_cast<float>(static_cast<int16_t>(bits)) / 4096.0f;  // finite, within +-8
  }
};
