// The vectorised 2^x of each SIMD layer (S::exp2, the exponential of every softmax), the tanh
// of logit soft-capping and the cap as the kernels take it (cpu/softcap.hpp), over arrays: what
// the tests hold to their stated accuracy and edge cases on every ISA the CPU runs.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/dispatch.hpp"
#include "cpu/softcap.hpp"

namespace mha::detail {

// y[i] = 2^x[i] for i < n, with the exponential of `isa`'s SIMD layer (amx: the AVX-512 one).
void vector_exp2(Isa isa, const float* x, float* y, int64_t n);

void vector_exp2_portable(const float* x, float* y, int64_t n);
void vector_exp2_avx2(const float* x, float* y, int64_t n);
void vector_exp2_avx512(const float* x, float* y, int64_t n);

// y[i] = tanh(x[i]) and slope[i] = 1 - tanh^2(x[i]) for i < n, as `isa`'s kernels soft-cap scores.
void vector_tanh(Isa isa, const float* x, float* y, float* slope, int64_t n);
void vector_tanh_portable(const float* x, float* y, float* slope, int64_t n);
void vector_tanh_avx2(const float* x, float* y, float* slope, int64_t n);
void vector_tanh_avx512(const float* x, float* y, float* slope, int64_t n);

// y[i] = c tanh(x[i] / c) and slope[i] its derivative for i < n (a multiple of 16), as `isa`'s
// kernels cap scores: the array as one column of a tile, n / 16 rows of a vector (so one range of
// Softcap::rows for all of it).
void vector_softcap(Isa isa, double c, const float* x, float* y, float* slope, int64_t n);
void vector_softcap_portable(double c, const float* x, float* y, float* slope, int64_t n);
void vector_softcap_avx2(double c, const float* x, float* y, float* slope, int64_t n);
void vector_softcap_avx512(double c, const float* x, float* y, float* slope, int64_t n);

// The body each ISA's file instantiates with its layer; a last partial vector goes through a
// zero-padded copy.
template <class S, class Fn>
void vector_map(const float* x, float* y, float* y2, int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + S::kLanes <= n; i += S::kLanes) fn(x + i, y + i, y2 ? y2 + i : nullptr);
  if (i == n) return;
  alignas(64) float in[S::kLanes] = {}, out[S::kLanes], out2[S::kLanes];
  for (int64_t j = i; j < n; ++j) in[j - i] = x[j];
  fn(in, out, out2);
  for (int64_t j = i; j < n; ++j) y[j] = out[j - i];
  for (int64_t j = i; y2 && j < n; ++j) y2[j] = out2[j - i];
}
template <class S>
void vector_exp2_of(const float* x, float* y, int64_t n) {
  vector_map<S>(x, y, nullptr, n, [](const float* in, float* out, float*) { S::store(out, S::exp2(S::load(in))); });
}
template <class S>
void vector_tanh_of(const float* x, float* y, float* slope, int64_t n) {
  vector_map<S>(x, y, slope, n, [](const float* in, float* out, float* out2) {
    typename S::F d;
    S::store(out, Softcap<S>::tanh(S::load(in), &d));
    S::store(out2, d);
  });
}

template <class S>
void vector_softcap_of(double c, const float* x, float* y, float* slope, int64_t n) {
  static_assert(S::kLanes == 16);
  std::copy_n(x, n, y);
  Softcap<S>(c).rows(y, n / S::kLanes, S::kLanes, 1, slope);
}

}  // namespace mha::detail
