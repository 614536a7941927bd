// The float64 exponential over an array, without SIMD flags, and the choice between the ISAs'
// versions.
#include "cpu/vector_exp_f64.hpp"

namespace mha::detail {

void vector_exp_f64_portable(double* x, int64_t n) { vector_exp_f64_of(x, n); }

void vector_exp_f64(Isa isa, double* x, int64_t n) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: vector_exp_f64_avx512(x, n); break;
    case Isa::avx2: vector_exp_f64_avx2(x, n); break;
    case Isa::portable: vector_exp_f64_portable(x, n); break;
  }
}

}  // namespace mha::detail
