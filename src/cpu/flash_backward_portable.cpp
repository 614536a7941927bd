// The fused backward for any CPU: the same body over 16-float arrays.
#include "cpu/backward_delta.hpp"
#include "cpu/flash_backward.hpp"
#include "cpu/simd_portable.hpp"

namespace mha::detail {
void flash_backward_portable(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  FlashBackward<simd::Portable>{p, in, out}.run();
}
void backward_delta_portable(const AttentionProblem& p, const BackwardInputs& in, float* delta) {
  backward_delta_all<simd::Portable>(p, in, delta);
}
void backward_delta(Isa isa, const AttentionProblem& p, const BackwardInputs& in, float* delta) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: backward_delta_avx512(p, in, delta); break;
    case Isa::avx2: backward_delta_avx2(p, in, delta); break;
    case Isa::portable: backward_delta_portable(p, in, delta); break;
  }
}
}  // namespace mha::detail
