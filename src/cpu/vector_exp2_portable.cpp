// S::exp2 and the soft-capping tanh of the portable layer over arrays, and the choice between the ISAs' versions.
#include "cpu/simd_portable.hpp"
#include "cpu/vector_exp2.hpp"

namespace mha::detail {

void vector_exp2_portable(const float* x, float* y, int64_t n) { vector_exp2_of<simd::Portable>(x, y, n); }
void vector_tanh_portable(const float* x, float* y, float* slope, int64_t n) { vector_tanh_of<simd::Portable>(x, y, slope, n); }
void vector_softcap_portable(double c, const float* x, float* y, float* slope, int64_t n) {
  vector_softcap_of<simd::Portable>(c, x, y, slope, n);
}

void vector_exp2(Isa isa, const float* x, float* y, int64_t n) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: vector_exp2_avx512(x, y, n); break;
    case Isa::avx2: vector_exp2_avx2(x, y, n); break;
    case Isa::portable: vector_exp2_portable(x, y, n); break;
  }
}

void vector_tanh(Isa isa, const float* x, float* y, float* slope, int64_t n) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: vector_tanh_avx512(x, y, slope, n); break;
    case Isa::avx2: vector_tanh_avx2(x, y, slope, n); break;
    case Isa::portable: vector_tanh_portable(x, y, slope, n); break;
  }
}

void vector_softcap(Isa isa, double c, const float* x, float* y, float* slope, int64_t n) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: vector_softcap_avx512(c, x, y, slope, n); break;
    case Isa::avx2: vector_softcap_avx2(c, x, y, slope, n); break;
    case Isa::portable: vector_softcap_portable(c, x, y, slope, n); break;
  }
}

}  // namespace mha::detail
