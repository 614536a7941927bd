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

} // namespace mha::detail
