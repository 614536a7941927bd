// The problem as the GPU kernels see it (kernel_params.hpp).
#include "cuda/kernel_params.hpp"

#include <cstdint>

namespace mha::detail::gpu {

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(message);
}

void copy_strides(const TensorView& t, const char* name, long long* strides) {
  require(t.shape[3] <= 1 || t.strides[3] == 1,
          std::string(name) + ": the GPU kernel needs unit stride along the head dimension, got stride " +
              std::to_string(t.strides[3]));
  require(reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
          std::string(name) + ": the GPU kernel needs 16-byte aligned data");
  for (int d = 0; d < 3; ++d) {
    require(t.strides[d] % 8 == 0 || t.shape[d] == 1,
            std::string(name) + ": the GPU kernel needs strides that are multiples of 8 elements, got " +
                std::to_string(t.strides[d]) + " in dimension " + std::to_string(d));
    strides[d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
}

void check_supported(const AttentionProblem& p) {
  const DType dt = p.q.dtype;
  require(dt == DType::bf16 || dt == DType::f16,
          "query: the GPU kernel takes bfloat16 or float16, got " + std::string(dtype_name(dt)));
  require(p.dim_qk == p.dim_v, "value: the GPU kernel needs the value head dim equal to the query's (" +
                                   std::to_string(p.dim_qk) + "), got " + std::to_string(p.dim_v));
  require(p.dim_qk == 64 || p.dim_qk == 128 || p.dim_qk == 256,
          "query: the GPU kernel takes head dims 64, 128 or 256, got " + std::to_string(p.dim_qk));
  require(p.dropout_p == 0.0, "dropout_p: dropout is not implemented in the GPU kernel, got " +
                                  std::to_string(p.dropout_p));
  require(p.len_q < (int64_t{1} << 31) && p.len_k < (int64_t{1} << 31) && p.heads_q <= 65535 && p.batch <= 65535,
          "query: the GPU kernel takes sequence lengths below 2^31 and at most 65535 heads and batch entries, got "
          "shape [" + std::to_string(p.batch) + ", " + std::to_string(p.heads_q) + ", " + std::to_string(p.len_q) +
              ", " + std::to_string(p.dim_qk) + "]");
}

Params kernel_params(const AttentionProblem& p) {
  Params params{};
  params.q = p.q.data;
  params.k = p.k.data;
  params.v = p.v.data;
  copy_strides(p.q, "query", params.q_strides);
  copy_strides(p.k, "key", params.k_strides);
  copy_strides(p.v, "value", params.v_strides);
  params.heads_q = static_cast<int>(p.heads_q);
  params.group = static_cast<int>(p.group());
  params.len_q = static_cast<int>(p.len_q);
  params.len_k = static_cast<int>(p.len_k);
  params.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  params.causal = p.causal ? 1 : 0;
  params.causal_offset = p.causal_offset;
  params.num_masks = p.num_masks;
  for (int m = 0; m < p.num_masks; ++m) {
    params.masks[m].data = p.masks[m].data;
    params.masks[m].kind = p.masks[m].kind == MaskKind::additive       ? 0
                           : p.masks[m].kind == MaskKind::keep_if_true ? 1
                                                                        : 2;
    for (int d = 0; d < 4; ++d) params.masks[m].strides[d] = p.masks[m].strides[d];
  }
  return params;
}

}  // namespace mha::detail::gpu
