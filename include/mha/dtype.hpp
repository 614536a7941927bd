// Element types: float32, bfloat16 and float16 for the kernels (fp32 accumulation throughout);
// float8 e4m3 and e5m2 (PyTorch's float8_e4m3fn and float8_e5m2) for keys and values held in 8
// bits (a quantized cache, widened exactly as it is read); bool for masks; float64 for the
// reference implementation.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace mha {

enum class DType : uint8_t { f32, f64, bf16, f16, boolean, f8e4m3, f8e5m2 };

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::boolean: return 1;
    case DType::f8e4m3: return 1;
    case DType::f8e5m2: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::boolean: return "bool";
    case DType::f8e4m3: return "float8_e4m3fn";
    case DType::f8e5m2: return "float8_e5m2";
  }
  return "?";
}

// The two float8 formats, which only keys and values take.
constexpr bool is_float8(DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; }

constexpr bool is_floating(DType t) { return t != DType::boolean; }

// bfloat16: the top 16 bits of an IEEE float32. Conversion rounds to nearest even; NaN stays NaN.
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  static bfloat16 from_bits(uint16_t b) {
    bfloat16 r;
    r.bits = b;
    return r;
  }
  explicit bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// IEEE binary16, converted in software (round to nearest even, subnormals and infinities kept).
struct float16 {
  uint16_t bits = 0;
  float16() = default;
  static float16 from_bits(uint16_t b) {
    float16 r;
    r.bits = b;
    return r;
  }
  explicit float16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) {  // NaN
      bits = static_cast<uint16_t>(sign | 0x7e00u);
    } else if (abs >= 0x477ff000u) {  // rounds to >= 65520: infinity
      bits = static_cast<uint16_t>(sign | 0x7c00u);
    } else if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
      // Add 0.5 as a float so that the hardware's rounding does the work: the result's low
      // mantissa bits are the half-precision subnormal.
      float a;
      std::memcpy(&a, &abs, 4);
      a += 0.5f;
      uint32_t r;
      std::memcpy(&r, &a, 4);
      bits = static_cast<uint16_t>(sign | (r - 0x3f000000u));
    } else {
      const uint32_t odd = (abs >> 13) & 1u;
      const uint32_t rounded = abs + 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round
      bits = static_cast<uint16_t>(sign | (rounded >> 13));
    }
  }
  explicit operator float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1fu;
    const uint32_t man = bits & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
      u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      u = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
      float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// The magnitude of a float (its bits `abs`, finite and below the format's overflow) rounded to
// nearest even in a float8 format of kMan mantissa bits and exponent bias kBias: subnormals by
// adding a float whose ulp is the format's subnormal step (the hardware's rounding leaves the
// count of steps in the low bits; one past the last is the smallest normal's bits), normals by
// rebiasing the exponent and rounding the dropped mantissa bits.
template <int kMan, int kBias>
constexpr uint8_t round_float8_magnitude(uint32_t abs) {
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr uint32_t kStepUlp = static_cast<uint32_t>(127 + 1 - kBias - kMan + 23) << 23;
  constexpr int kDropped = 23 - kMan;
  if (abs < kMinNormal) {
    float a = std::bit_cast<float>(abs) + std::bit_cast<float>(kStepUlp);
    return static_cast<uint8_t>(std::bit_cast<uint32_t>(a) - kStepUlp);
  }
  const uint32_t odd = (abs >> kDropped) & 1u;
  const uint32_t rebiased = abs - (static_cast<uint32_t>(127 - kBias) << 23);
  return static_cast<uint8_t>((rebiased + (1u << (kDropped - 1)) - 1u + odd) >> kDropped);
}

// float8 e4m3 as PyTorch's float8_e4m3fn (OCP FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
// no infinities, one NaN pattern per sign (0x7f / 0xff), largest finite 448, subnormals down to
// 2^-9. Conversion from float rounds to nearest even and saturates: beyond 448 (infinities too)
// gives 448 with the sign, NaN stays NaN, as PyTorch's `.to(torch.float8_e4m3fn)` gives.
struct float8_e4m3 {
  uint8_t bits = 0;
  float8_e4m3() = default;
  static float8_e4m3 from_bits(uint8_t b) {
    float8_e4m3 r;
    r.bits = b;
    return r;
  }
  explicit float8_e4m3(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) {  // NaN
      bits = static_cast<uint8_t>(sign | 0x7fu);
    } else if (abs > 0x43e00000u) {  // beyond 448, infinities included: saturated
      bits = static_cast<uint8_t>(sign | 0x7eu);
    } else {
      bits = static_cast<uint8_t>(sign | round_float8_magnitude<3, 7>(abs));
    }
  }
  explicit operator float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
    const uint32_t exp = (bits >> 3) & 0xfu, man = bits & 0x7u;
    uint32_t u;
    if ((bits & 0x7fu) == 0x7fu) {
      u = sign | 0x7fc00000u;
    } else if (exp != 0) {
      u = sign | ((exp + 120u) << 23) | (man << 20);
    } else {
      float f = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// float8 e5m2 as PyTorch's float8_e5m2: the top byte of an IEEE half (1 sign, 5 exponent bits
// with bias 15, 2 mantissa bits), infinities and NaN included; largest finite 57344, subnormals
// down to 2^-16. Conversion from float rounds to nearest even; what rounds beyond 57344 becomes
// infinity, NaN stays NaN, as PyTorch's `.to(torch.float8_e5m2)` gives. Widening is exact: the
// byte shifted up is the half.
struct float8_e5m2 {
  uint8_t bits = 0;
  float8_e5m2() = default;
  static float8_e5m2 from_bits(uint8_t b) {
    float8_e5m2 r;
    r.bits = b;
    return r;
  }
  explicit float8_e5m2(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) {  // NaN
      bits = static_cast<uint8_t>(sign | 0x7fu);
    } else if (abs >= 0x47800000u) {  // 65536 and beyond, infinities: infinity
      bits = static_cast<uint8_t>(sign | 0x7cu);
    } else {  // (rounding past 57344 gives 0x7c: infinity)
      bits = static_cast<uint8_t>(sign | round_float8_magnitude<2, 15>(abs));
    }
  }
  explicit operator float() const { return static_cast<float>(float16::from_bits(static_cast<uint16_t>(bits << 8))); }
};

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bfloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<float16>() { return DType::f16; }
template <> constexpr DType dtype_of<bool>() { return DType::boolean; }
template <> constexpr DType dtype_of<float8_e4m3>() { return DType::f8e4m3; }
template <> constexpr DType dtype_of<float8_e5m2>() { return DType::f8e5m2; }

}  // namespace mha
