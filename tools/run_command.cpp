#include "run_command.hpp"

#include <cstdio>
#include <map>
#include <string>

#include "mha/mha.hpp"

namespace mha::tools {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Inputs in the module's dtype (numpy writes float64 by default and has no bfloat16: a float32 or
// float64 file feeds a module of any dtype).
Tensor as_input(const Tensor& t, DType module_dtype) {
  return t.dtype() == module_dtype ? t : Tensor::copy_of(t, module_dtype);
}
// Masks: bool as they are; a float mask as float32 or the module's dtype, which the module takes.
Tensor as_mask(const Tensor& t, DType module_dtype) {
  const DType d = t.dtype();
  return d == DType::boolean || d == DType::f32 || d == module_dtype ? t : Tensor::copy_of(t, DType::f32);
}
// What a .npy file can hold: bfloat16 results (numpy has no bfloat16) are written as float32.
Tensor for_npy(const Tensor& t) { return t.dtype() == DType::bf16 ? Tensor::copy_of(t, DType::f32) : t; }

}  // namespace

int run_run(const RunOptions& o) {
  SafetensorsFile checkpoint = load_safetensors(o.weights);
  TensorMap state;
  for (auto& [name, t] : checkpoint.tensors) {
    if (name.compare(0, o.prefix.size(), o.prefix) == 0) state.emplace(name.substr(o.prefix.size()), t);
  }
  int64_t num_heads = o.num_heads;
  if (num_heads == 0) {
    auto it = checkpoint.metadata.find("num_heads");
    if (it == checkpoint.metadata.end()) {
      throw Error("--num-heads: the checkpoint has no 'num_heads' metadata, so pass --num-heads");
    }
    num_heads = std::stoll(it->second);
  }
  MultiheadAttention module = module_from_state_dict(state, num_heads, o.add_zero_attn, o.batch_first);
  module.eval();

  TensorMap inputs;
  if (!o.inputs.empty()) {
    for (auto& [name, t] : load_safetensors(o.inputs).tensors) inputs.emplace(name, t);
  }
  const std::pair<const char*, const std::string*> files[] = {{"query", &o.query},
                                                              {"key", &o.key},
                                                              {"value", &o.value},
                                                              {"attn_mask", &o.attn_mask},
                                                              {"key_padding_mask", &o.key_padding_mask}};
  for (const auto& [name, path] : files) {
    if (!path->empty()) inputs.insert_or_assign(name, load_npy(*path));
  }
  if (!inputs.count("query")) throw Error("--query or --inputs: no 'query' tensor given");
  const DType dtype = module.dtype();
  const Tensor query = as_input(inputs.at("query"), dtype);
  const Tensor key = inputs.count("key") ? as_input(inputs.at("key"), dtype) : query;
  const Tensor value = inputs.count("value") ? as_input(inputs.at("value"), dtype) : key;

  ForwardOptions f;
  Tensor attn_mask, padding;
  if (inputs.count("attn_mask")) {
    attn_mask = as_mask(inputs.at("attn_mask"), dtype);
    f.attn_mask = attn_mask.view();
  }
  if (inputs.count("key_padding_mask")) {
    padding = as_mask(inputs.at("key_padding_mask"), dtype);
    f.key_padding_mask = padding.view();
  }
  f.need_weights = o.need_weights;
  f.average_attn_weights = o.average_attn_weights;
  f.is_causal = o.is_causal;
  if (o.threads) f.num_threads = *o.threads;
  const ForwardResult r = module.forward(query, key, value, f);

  if (ends_with(o.out, ".safetensors")) {
    std::map<std::string, TensorView> out{{"output", r.output.view()}};
    if (r.weights) out.emplace("weights", r.weights->view());
    save_safetensors(o.out, out);
  } else if (ends_with(o.out, ".npy")) {
    save_npy(o.out, for_npy(r.output));
    if (r.weights && !o.weights_out.empty()) save_npy(o.weights_out, for_npy(*r.weights));
  } else {
    throw Error("--out: expected a .npy or .safetensors path, got '" + o.out + "'");
  }
  std::fprintf(stderr, "mha run: %s (embed_dim %lld, %lld heads) -> output %s%s written to %s\n", o.weights.c_str(),
               static_cast<long long>(module.embed_dim()), static_cast<long long>(num_heads),
               r.output.shape_str().c_str(), r.weights ? (", weights " + r.weights->shape_str()).c_str() : "",
               o.out.c_str());
  return 0;
}

}  // namespace mha::tools
