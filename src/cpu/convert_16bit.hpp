// Conversions between float32 and the 16-bit types in vectors, for the copies of Tensor
// (copy_of, copy_into): AVX2 with F16C, entered where active_isa() is avx2 or above. They give
// the bits of the scalar conversions of mha/dtype.hpp, NaN payloads included; element by element
// in portable code, a float16 rounding took 4% of a float16 module's forward.
#pragma once

#include <cstdint>

namespace mha::detail {

void widen_f16_avx2(const void* src, void* dst, int64_t n);   // float16 -> float32
void narrow_f16_avx2(const void* src, void* dst, int64_t n);  // float32 -> float16
void narrow_bf16_avx2(const void* src, void* dst, int64_t n); // float32 -> bfloat16

}  // namespace mha::detail
