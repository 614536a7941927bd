// The vectorised 2^x of each SIMD layer (S::exp2, the exponential of every softmax), over an
// array: what the tests hold to its stated accuracy and edge cases on every ISA the CPU runs.
#pragma once

#include <cstdint>

#include "cpu/dispatch.hpp"

namespace mha::detail {

// y[i] = 2^x[i] for i < n, with the exponential of `isa`'s SIMD layer (amx: the AVX-512 one).
void vector_exp2(Isa isa, const float* x, float* y, int64_t n);

void vector_exp2_portable(const float* x, float* y, int64_t n);
void vector_exp2_avx2(const float* x, float* y, int64_t n);
void vector_exp2_avx512(const float* x, float* y, int64_t n);

// The body each ISA's file instantiates with its layer; a last partial vector goes through a
// zero-padded copy.
template <class S>
void vector_exp2_of(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + S::kLanes <= n; i += S::kLanes) S::store(y + i, S::exp2(S::load(x + i)));
  if (i == n) return;
  alignas(64) float in[S::kLanes] = {}, out[S::kLanes];
  for (int64_t j = i; j < n; ++j) in[j - i] = x[j];
  S::store(out, S::exp2(S::load(in)));
  for (int64_t j = i; j < n; ++j) y[j] = out[j - i];
}

}  // namespace mha::detail
