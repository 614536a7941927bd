// Option and shape validation of SDPA and MultiheadAttention: random ranks, sizes (including
// absurd ones), strides (including 0), dtypes, masks and flags. Every call must succeed or throw
// mha::Error. Buffers are real (sized from the strides) when small, null when huge, so that
// validation is exercised on absurd sizes without allocating them.
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_input.hpp"
#include "mha/mha.hpp"

namespace {

constexpr int64_t kMaxElements = 1 << 14;

struct Arg {
  std::vector<float> storage;  // enough for any float dtype (bytes / 4, rounded up)
  mha::TensorView view;
};

// A view with fuzzed rank, sizes, strides and dtype over a real buffer when it is small.
Arg make(FuzzInput& in, int max_rank) {
  Arg a;
  const int rank = static_cast<int>(in.small(max_rank));
  mha::Shape shape(rank), strides(rank);
  int64_t span = 1;
  bool huge = false;
  for (int d = rank - 1; d >= 0; --d) {
    shape[d] = in.dim();
    strides[d] = in.flag() ? span : in.small(3) == 0 ? 0 : in.dim();
    if (shape[d] > 0 && strides[d] > 0 && (__builtin_mul_overflow(shape[d], strides[d], &span) || span > kMaxElements)) {
      huge = true;
      span = 1;
    } else if (strides[d] > 0) {
      span = std::max<int64_t>(span, shape[d] * strides[d]);
    }
  }
  static const mha::DType dtypes[] = {mha::DType::f32, mha::DType::f32, mha::DType::bf16, mha::DType::f16,
                                      mha::DType::boolean, mha::DType::f64};
  const mha::DType dtype = dtypes[in.small(5)];
  try {
    if (!huge) {
      int64_t max_offset = 0;
      for (int d = 0; d < rank; ++d) max_offset += (shape[d] > 0 ? shape[d] - 1 : 0) * strides[d];
      a.storage.assign(static_cast<size_t>((max_offset + 1) * mha::dtype_size(dtype) / 4 + 1), 0.5f);
      a.view = mha::TensorView(a.storage.data(), dtype, shape, strides);
    } else {
      a.view = mha::TensorView(nullptr, dtype, shape, strides);
    }
  } catch (const mha::Error&) {  // the view itself refused (e.g. offsets overflow): fall back to empty
    a.view = mha::TensorView(a.storage.data(), mha::DType::f32, {0});
  }
  return a;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  try {
    if (in.flag()) {
      Arg q = make(in, 5), k = make(in, 5), v = make(in, 5), mask = make(in, 5);
      mha::SdpaOptions o;
      if (in.flag()) o.attn_mask = mask.view;
      o.is_causal = in.flag();
      o.causal_alignment = in.flag() ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
      if (in.flag()) o.scale = in.value();
      o.enable_gqa = in.flag();
      o.dropout_p = in.small(4) == 0 ? in.value() : 0.0;
      o.num_threads = static_cast<int>(in.small(3));
      if (in.flag()) {
        mha::scaled_dot_product_attention(q.view, k.view, v.view, o);
      } else {
        mha::scaled_dot_product_attention_with_weights(q.view, k.view, v.view, o);
      }
    } else {
      const int64_t heads = in.dim(), embed = in.dim();
      mha::MultiheadAttentionOptions mo;
      mo.bias = in.flag();
      mo.add_bias_kv = in.flag();
      mo.add_zero_attn = in.flag();
      if (in.flag()) mo.kdim = in.dim();
      if (in.flag()) mo.vdim = in.dim();
      mo.batch_first = in.flag();
      const int64_t widest = std::max({embed, mo.kdim.value_or(0), mo.vdim.value_or(0)});
      if (widest > 256) {
        // Weights this large either cannot be allocated (from 2^21: an mha::Error) or would only
        // slow the fuzzer down; construct only the former.
        if (widest >= (int64_t{1} << 21)) mha::MultiheadAttention(embed, heads, mo);
        return 0;
      }
      mha::MultiheadAttention m(embed, heads, mo);
      Arg q = make(in, 4), k = make(in, 4), v = make(in, 4), mask = make(in, 4), kpm = make(in, 3);
      mha::ForwardOptions f;
      if (in.flag()) f.attn_mask = mask.view;
      if (in.flag()) f.key_padding_mask = kpm.view;
      f.need_weights = in.flag();
      f.average_attn_weights = in.flag();
      f.is_causal = in.flag();
      m.eval();
      m.forward(q.view, in.flag() ? q.view : k.view, in.flag() ? q.view : v.view, f);
    }
  } catch (const mha::Error&) {
  }
  return 0;
}
