// Building a module from a state dict alone (a PyTorch checkpoint): the options that the names
// and shapes determine are read off them.
#include "mha/io.hpp"

namespace mha {

MultiheadAttention module_from_state_dict(const TensorMap& state, int64_t num_heads, bool add_zero_attn,
                                          bool batch_first) {
  auto find = [&](const std::string& name) -> const Tensor* {
    auto it = state.find(name);
    return it == state.end() ? nullptr : &it->second;
  };
  const Tensor* out_w = find("out_proj.weight");
  if (out_w == nullptr || out_w->ndim() != 2) {
    throw Error("state dict: expected 'out_proj.weight' of shape [E, E] (a torch.nn.MultiheadAttention state dict)");
  }
  MultiheadAttentionOptions o;
  const int64_t E = out_w->size(0);
  if (const Tensor* k = find("k_proj_weight")) {
    if (k->ndim() != 2) throw Error("state dict: 'k_proj_weight' must have 2 dimensions, got " + k->shape_str());
    o.kdim = k->size(1);
    const Tensor* v = find("v_proj_weight");
    if (v == nullptr || v->ndim() != 2) throw Error("state dict: 'k_proj_weight' present but 'v_proj_weight' missing");
    o.vdim = v->size(1);
  }
  o.bias = find("in_proj_bias") != nullptr;
  o.add_bias_kv = find("bias_k") != nullptr;
  o.add_zero_attn = add_zero_attn;
  o.batch_first = batch_first;
  // A bfloat16, float16 or float64 checkpoint makes a module of that dtype, as the module it was
  // saved from; anything else float32.
  const DType stored = out_w->dtype();
  o.dtype = stored == DType::bf16 || stored == DType::f16 || stored == DType::f64 ? stored : DType::f32;
  MultiheadAttention m(E, num_heads, o);
  m.load_state_dict(views_of(state), /*strict=*/true);
  return m;
}

}  // namespace mha
