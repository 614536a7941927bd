// 2^f for f in [-0.5, 0.5], the reduced argument of the AVX2 and portable layers' exp2 (x
// = n + f, n the nearest integer, 2^n from exponent bits; AVX-512 takes f in [0, 1), below): the degree-6
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

// The same two polynomials moved to [0, 1), for 2^x = 2^floor(x) 2^(x - floor(x)) where one
// instruction gives the fraction (AVX-512's vreduceps) and another scales by 2^floor(x)
// (vscalefps takes x itself): sqrt(2) P(f - 1/2), expanded. 2^f = sqrt(2) 2^(f - 1/2), so the
// relative error is P's, 1.86e-9 and 7.48e-5 in exact arithmetic; every coefficient and f are
// positive, so Horner's rule adds no cancellation.
inline constexpr float kExp2PolyFrom0[7] = {
    1.0000000018557977f,   0.6931469838404386f,    0.24022983627589425f, 0.05548334197771016f,
    0.009678841007043672f, 0.0012439687747148747f, 0.0002170225568052031f,
};
inline constexpr float kExp2PolyBf16From0[4] = {0.9999252185640102f, 0.6958335405064476f, 0.22606715539312944f,
                                                0.07802452266443294f};

// The polynomial c (kExp2Poly unless given) at f by Horner's rule, for any vector type:
// fmadd(a, b, c) = a * b + c, set1(x) a vector of x. Evaluated the same way on every ISA, so the
// layers differ only in their reduction of the argument (and AVX-512's coefficients, for [0, 1))
// and the scaling by 2^n.
template <class V, class Fmadd, class Set1>
inline V exp2_polynomial(V f, Fmadd fmadd, Set1 set1, const float (&c)[7] = kExp2Poly) {
  V p = set1(c[6]);
  for (int i = 5; i >= 0; --i) p = fmadd(p, f, set1(c[i]));
  return p;
}

} // namespace mha::detail
