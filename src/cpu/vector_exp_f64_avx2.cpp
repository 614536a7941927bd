// The float64 exponential over an array, vectorised for AVX2 (compiled with -mavx2 -mfma).
#include "cpu/vector_exp_f64.hpp"

namespace mha::detail {
void vector_exp_f64_avx2(double* x, int64_t n) { vector_exp_f64_of(x, n); }
}  // namespace mha::detail
