// A bfloat16 module's inference forward in bfloat16 products, rounded where PyTorch's bf16 module
// rounds: each projection is a bfloat16 Linear (float32 sums with the bias, rounded once: oneDNN's
// AMX or AVX512-BF16 matmul), the attention runs the AMX kernel (or, on the avx512_bf16 ISA, the
// fused kernel's bfloat16 pair products) on those bfloat16 heads, and its output, rounded to
// bfloat16, is the out-projection's input. Against the float32 module on widened copies (what
// the other bf16 calls run), this rounds three more times and runs several times faster; the
// error stays within a few bfloat16 units (tests/test_module_low_precision.cpp).
//
// Taken only where everything runs in bfloat16 products and nothing is kept for a backward: no
// context, no weights returned, no dropout, no bias_k/bias_v or zero-attention rows, head dims
// the kernel takes (AMX: at least 16; pairs: even), more than a few queries (decoding keeps the
// few-rows path).
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/dispatch.hpp"
#include "module/onednn_matmul.hpp"
#include "module/linear.hpp"
#include "module/module_bf16_forward.hpp"
#include "module/module_call.hpp"

namespace mha::detail {
namespace {

TensorView parameter(const std::vector<std::pair<std::string, TensorView>>& parameters, const std::string& name) {
  for (const auto& [n, v] : parameters)
    if (n == name) return v;
  throw Error("internal error: the module has no parameter " + name);
}

// A weight with unit-stride rows, as the matmul reads it (a copy where the given view is not).
TensorView with_unit_rows(const TensorView& w, std::vector<Tensor>& storage) {
  if (w.strides[1] == 1 || w.shape[1] <= 1) return w;
  storage.push_back(Tensor::copy_of(w));
  return storage.back().view();
}

}  // namespace

std::vector<float> widened_bias(const TensorView& bias, int64_t first, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  const auto* bits = static_cast<const uint16_t*>(bias.data);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[(first + i) * bias.strides[0]]) << 16;
    std::memcpy(&out[static_cast<size_t>(i)], &u, 4);
  }
  return out;
}

namespace {
// Where the attention of such a call runs: the tile unit, or the fused kernel's pair products.
bool on_tiles(int64_t len_q, int64_t len_k, int64_t head_dim) {
  return amx_usable() && amx_bf16_takes_shape(len_q, len_k, head_dim, head_dim);
}
bool on_pairs(int64_t len_q, int64_t head_dim) {
  return active_isa() == Isa::avx512_bf16 && bf16_pairs_take_shape(len_q, head_dim);
}
}  // namespace

bool bf16_inference_forward_takes(const MultiheadAttention& m, const ForwardOptions& options, int64_t len_q,
                                  int64_t len_k, bool with_context) {
  const MultiheadAttentionOptions& o = m.options();
  return o.dtype == DType::bf16 && !with_context && !options.need_weights && !o.add_bias_kv && !o.add_zero_attn &&
         !(m.is_training() && o.dropout > 0) &&
         (on_tiles(len_q, len_k, m.head_dim()) || on_pairs(len_q, m.head_dim())) && bf16_matmul_available();
}

std::optional<ForwardResult> bf16_inference_forward(const MultiheadAttention& m,
                                               const std::vector<std::pair<std::string, TensorView>>& parameters,
                                               const TensorView& query, const TensorView& key, const TensorView& value,
                                               const ForwardOptions& options, ForwardContext* context) {
  const ModuleCall c = validate_module_call(m, query, key, value, options);
  if (!bf16_inference_forward_takes(m, options, c.len_q, c.len_k, context != nullptr)) return std::nullopt;
  const int threads = resolve_threads(options.num_threads);
  const int64_t E = m.embed_dim(), H = m.num_heads(), L = c.len_q, S = c.len_k;
  const bool bias = m.options().bias;
  std::vector<Tensor> storage;

  // 1. Projections, rounded to bfloat16, each into rows of its own. (Self-attention's packed
  //    [3E, E] weight as one product wrote [N, L, 3E] rows in column parts, each through a
  //    dense buffer copied into place: 1.5-2 ms more at E = 1024, B = 4, L = 512.)
  TensorView wq, wk, wv;
  if (m.qkv_same_embed_dim()) {
    const TensorView w = with_unit_rows(parameter(parameters, "in_proj_weight"), storage);
    wq = w.slice(0, 0, E), wk = w.slice(0, E, 2 * E), wv = w.slice(0, 2 * E, 3 * E);
  } else {
    wq = with_unit_rows(parameter(parameters, "q_proj_weight"), storage);
    wk = with_unit_rows(parameter(parameters, "k_proj_weight"), storage);
    wv = with_unit_rows(parameter(parameters, "v_proj_weight"), storage);
  }
  std::vector<float> bq, bk, bv;
  if (bias) {
    const TensorView b = parameter(parameters, "in_proj_bias");
    bq = widened_bias(b, 0, E), bk = widened_bias(b, E, E), bv = widened_bias(b, 2 * E, E);
  }
  const RowBuffer q_buf = rows_like(c.query, L, E, DType::bf16), k_buf = rows_like(c.key, S, E, DType::bf16),
                  v_buf = rows_like(c.value, S, E, DType::bf16);
  const TensorView q = q_buf.view, k = k_buf.view, v = v_buf.view;
  linear_bf16({{c.query, wq, bias ? bq.data() : nullptr, q}, {c.key, wk, bias ? bk.data() : nullptr, k},
               {c.value, wv, bias ? bv.data() : nullptr, v}},
              threads);

  // 2. The attention in bfloat16 products, written into a buffer laid out like the output.
  ForwardResult result;
  result.output = Tensor::empty(module_output_shape(c, m, m.options().batch_first), DType::bf16);
  auto as_nle = [&](const TensorView& t) {
    if (!c.batched) return t.unsqueeze(0);
    return m.options().batch_first ? t : t.transpose(0, 1);
  };
  const Tensor attn = Tensor::empty(result.output.sizes(), DType::bf16);
  const MaskTerms masks = module_mask_terms(c, H);
  const AttentionProblem p = module_attention_problem(c, masks, H, q, k, v, threads);
  const TensorView heads_out = as_nle(attn.view()).split_dim(2, H).transpose(1, 2);
  if (on_tiles(L, S, m.head_dim())) {
    if (!amx_bf16_supports(p)) throw Error("internal error: the AMX kernel refuses a module call it was meant to take");
    AmxOutputs o;
    o.out = heads_out.data;
    for (int d = 0; d < 4; ++d) o.out_strides[d] = heads_out.strides[d];
    amx_bf16_forward(p, o);
  } else {
    if (!bf16_pairs_supports(p)) throw Error("internal error: the pair kernel refuses a module call it was meant to take");
    ForwardOutputs o;
    o.out = heads_out.data;
    o.out_dtype = DType::bf16;
    for (int d = 0; d < 4; ++d) o.out_strides[d] = heads_out.strides[d];
    run_attention(p, o);
  }

  // 3. The output projection, rounded to bfloat16.
  const TensorView wo = with_unit_rows(parameter(parameters, "out_proj.weight"), storage);
  const std::vector<float> bo = bias ? widened_bias(parameter(parameters, "out_proj.bias"), 0, E) : std::vector<float>();
  linear_bf16(as_nle(attn.view()), wo, bias ? bo.data() : nullptr, as_nle(result.output.view()), threads);
  return result;
}

}  // namespace mha::detail
