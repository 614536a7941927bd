// The float64 exponential over an array, vectorised for AVX-512 (compiled with -mavx512f ...).
#include "cpu/vector_exp_f64.hpp"

namespace mha::detail {
void vector_exp_f64_avx512(double* x, int64_t n) { vector_exp_f64_of(x, n); }
}  // namespace mha::detail
