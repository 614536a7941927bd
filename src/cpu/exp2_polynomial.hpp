// 2^f for f in [-0.5, 0.5], the reduced argument of every SIMD layer's exp2 (x
// = n + f, n the nearest integer, 2^n from exponent bits): the degree-6
// polynomial of least maximum relative error (Remez exchange in 40-digit
// arithmetic), 1.86e-9 in exact arithmetic, so float rounding of the Horner
// steps dominates (tests/test_exp2.cpp bounds the whole by 2^-23). One degree
// fewer than the Taylor polynomial of the same accuracy: one FMA less per
// vector of scores on the ports the score products use. kExp2Poly[i] is the coefficient
// of f^i.
#pragma once

namespace mha::detail {

inline constexpr float kExp2Poly[7] = {
    1.0000000005541663f,     0.6931472057372526f,   0.24022646890639573f,
    0.055503287769976636f,   0.009618488956522791f, 0.001339993120947414f,
    0.00015345812158740183f,
};

// The degree-3 polynomial of least maximum relative error for 2^f on [-0.5, 0.5]: 7.48e-5
// (Remez exchange), for probabilities rounded to bfloat16 (relative 2^-9 = 1.95e-3) before
// they are used: the AMX kernel's exp2_bf16.
inline constexpr float kExp2PolyBf16[4] = {0.9999280735404956f, 0.6932609854573362f, 0.2426111221943308f,
                                           0.055171669074864f};

// kExp2Poly at f by Horner's rule, for any vector type: fmadd(a, b, c) = a * b + c, set1(x) a
// vector of x. Evaluated the same way on every ISA, so the layers differ only in their rounding
// of the reduced argument and the scaling by 2^n.
template <class V, class Fmadd, class Set1>
inline V exp2_polynomial(V f, Fmadd fmadd, Set1 set1) {
  V p = set1(kExp2Poly[6]);
  for (int i = 5; i >= 0; --i) p = fmadd(p, f, set1(kExp2Poly[i]));
  return p;
}

} // namespace mha::detail
