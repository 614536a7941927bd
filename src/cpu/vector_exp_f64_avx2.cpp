// The float64 exponential over an array, vectorised for AVX2 (its region; cpu/isa_region.hpp).
#include "cpu/kernel_prelude.hpp"
#include "cpu/isa_region.hpp"

MHA_ISA_BEGIN(MHA_ISA_AVX2)
#include "cpu/vector_exp_f64.hpp"

namespace mha::detail {
void vector_exp_f64_avx2(double* x, int64_t n) { vector_exp_f64_of(x, n); }
}  // namespace mha::detail
MHA_ISA_END
