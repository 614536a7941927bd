// The entry points of the x86 kernels (*_avx2.cpp, *_avx512.cpp, *_avx512bf16.cpp, *_amx.cpp)
// on processors that have none (64-bit Arm, say), where CMakeLists.txt builds this file instead
// of those. supported_isas() lists only the portable level there, so dispatch never calls them;
// should a bug reach one, it is an mha::Error naming it rather than a link error or a jump into
// instructions the CPU lacks.
#include <cstdint>
#include <string>

#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/backward_delta.hpp"
#include "cpu/convert_16bit.hpp"
#include "cpu/few_rows_gemm.hpp"
#include "cpu/vector_exp2.hpp"
#include "cpu/vector_exp_f64.hpp"
#include "cpu/weight_packing.hpp"
#include "mha/error.hpp"

namespace mha::detail {
namespace {
[[noreturn]] void absent(const char* kernel) {
  throw Error(std::string("internal error: ") + kernel + " is an x86 kernel, and this build is for another processor");
}
}  // namespace

void flash_forward_avx2(const AttentionProblem&, const ForwardOutputs&) { absent("flash_forward_avx2"); }
void flash_forward_avx512(const AttentionProblem&, const ForwardOutputs&) { absent("flash_forward_avx512"); }
void flash_forward_avx512bf16(const AttentionProblem&, const ForwardOutputs&) { absent("flash_forward_avx512bf16"); }
bool bf16_pairs_take_few_queries(const AttentionProblem&, const ForwardOutputs&) { return false; }
void exp2_bf16_of(const float*, float*, int64_t) { absent("exp2_bf16_of"); }

void flash_backward_avx2(const AttentionProblem&, const BackwardInputs&, const BackwardOutputs&) {
  absent("flash_backward_avx2");
}
void flash_backward_avx512(const AttentionProblem&, const BackwardInputs&, const BackwardOutputs&) {
  absent("flash_backward_avx512");
}
void flash_backward_avx512bf16(const AttentionProblem&, const BackwardInputs&, const BackwardOutputs&) {
  absent("flash_backward_avx512bf16");
}
void backward_delta_avx2(const AttentionProblem&, const BackwardInputs&, float*) { absent("backward_delta_avx2"); }
void backward_delta_avx512(const AttentionProblem&, const BackwardInputs&, float*) { absent("backward_delta_avx512"); }

void amx_bf16_forward(const AttentionProblem&, const AmxOutputs&) { absent("amx_bf16_forward"); }
void amx_bf16_backward(const AttentionProblem&, const BackwardInputs&, const BackwardOutputs&) {
  absent("amx_bf16_backward");
}

void few_rows_gemm_avx2(const FewRowsGemm&, int64_t, int64_t) { absent("few_rows_gemm_avx2"); }
void few_rows_gemm_avx512(const FewRowsGemm&, int64_t, int64_t) { absent("few_rows_gemm_avx512"); }

void vector_exp2_avx2(const float*, float*, int64_t) { absent("vector_exp2_avx2"); }
void vector_exp2_avx512(const float*, float*, int64_t) { absent("vector_exp2_avx512"); }
void vector_tanh_avx2(const float*, float*, float*, int64_t) { absent("vector_tanh_avx2"); }
void vector_tanh_avx512(const float*, float*, float*, int64_t) { absent("vector_tanh_avx512"); }
void vector_softcap_avx2(double, const float*, float*, float*, int64_t) { absent("vector_softcap_avx2"); }
void vector_softcap_avx512(double, const float*, float*, float*, int64_t) { absent("vector_softcap_avx512"); }
void vector_exp_f64_avx2(double*, int64_t) { absent("vector_exp_f64_avx2"); }
void vector_exp_f64_avx512(double*, int64_t) { absent("vector_exp_f64_avx512"); }

void widen_f16_avx2(const void*, void*, int64_t) { absent("widen_f16_avx2"); }
void narrow_f16_avx2(const void*, void*, int64_t) { absent("narrow_f16_avx2"); }
void narrow_bf16_avx2(const void*, void*, int64_t) { absent("narrow_bf16_avx2"); }

void pack_bf16_weight_slice(const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {
  absent("pack_bf16_weight_slice");
}
void pack_f32_weight_slice(const float*, int64_t, int64_t, int64_t, int64_t, float*) {
  absent("pack_f32_weight_slice");
}

}  // namespace mha::detail
