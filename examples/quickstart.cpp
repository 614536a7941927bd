// The README's example, complete: a self-attention and a cross-attention call on the module, a
// state dict round trip, SDPA on [B, L, H, D] storage through transposed views, and sequences of
// different lengths packed without padding.
#include <mha/mha.hpp>

#include <cstdio>
#include <random>
#include <unordered_map>
#include <vector>

namespace {

mha::Tensor random_tensor(const mha::Shape& shape, std::mt19937_64& rng) {
  mha::Tensor t = mha::Tensor::empty(shape);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(rng);
  return t;
}

}  // namespace

int main() {
  std::mt19937_64 rng(1);

  // Module: torch.nn.MultiheadAttention(embed_dim=512, num_heads=8, dropout=0.1, batch_first=True)
  mha::MultiheadAttention attn(512, 8, {.dropout = 0.1, .batch_first = true, .seed = 42});
  attn.eval();  // no dropout, like module.eval()

  const mha::Tensor x = random_tensor({4, 100, 512}, rng);    // [N, L, E]
  const mha::Tensor mem = random_tensor({4, 60, 512}, rng);   // another sequence: cross-attention
  mha::Tensor pad = mha::Tensor::zeros({4, 60}, mha::DType::boolean);
  for (int64_t s = 50; s < 60; ++s) pad.data<bool>()[s] = true;  // batch 0: the last 10 keys are padding

  const auto self = attn(x, x, x, {.need_weights = false, .is_causal = true});
  const auto cross = attn(x, mem, mem, {.key_padding_mask = pad.view()});
  std::printf("self-attention output %s, cross-attention output %s, weights %s\n", self.output.shape_str().c_str(),
              cross.output.shape_str().c_str(), cross.weights->shape_str().c_str());

  // Parameters by PyTorch's names: a state_dict maps onto the module name for name.
  std::unordered_map<std::string, mha::TensorView> state;
  std::vector<mha::Tensor> keep_alive;
  for (const auto& [name, t] : attn.named_parameters()) {
    keep_alive.push_back(t.clone());
    state[name] = keep_alive.back().view();
  }
  attn.load_state_dict(state);

  // Functional SDPA on [B, L, H, D] storage, with grouped-query attention (8 query heads, 2 KV heads).
  const int64_t B = 2, L = 128, Hq = 8, Hkv = 2, D = 64;
  const mha::Tensor q = random_tensor({B, L, Hq, D}, rng);
  const mha::Tensor k = random_tensor({B, L, Hkv, D}, rng);
  const mha::Tensor v = random_tensor({B, L, Hkv, D}, rng);
  const mha::Tensor out = mha::scaled_dot_product_attention(
      q.view().transpose(1, 2), k.view().transpose(1, 2), v.view().transpose(1, 2),  // [B, H, L, D] views
      {.is_causal = true, .enable_gqa = true});
  std::printf("SDPA output %s (ISA %s, %d threads)\n", out.shape_str().c_str(), mha::cpu_isa().c_str(),
              mha::get_num_threads());
  // The same with a sliding window: each query sees its 32 most recent keys (itself included).
  const mha::Tensor local = mha::scaled_dot_product_attention(
      q.view().transpose(1, 2), k.view().transpose(1, 2), v.view().transpose(1, 2),
      {.is_causal = true, .window_left = 31, .enable_gqa = true});
  std::printf("sliding-window output %s\n", local.shape_str().c_str());

  // Sequences of different lengths, packed without padding: [T, H, D] rows and their offsets.
  const std::vector<int64_t> cu_seqlens{0, 37, 128, 141};  // three sequences: 37, 91 and 13 tokens
  const mha::Tensor packed_q = random_tensor({141, Hq, D}, rng);
  const mha::Tensor packed_kv = random_tensor({141, Hkv, D}, rng);
  const mha::Tensor ragged = mha::scaled_dot_product_attention_varlen(
      packed_q, packed_kv, packed_kv, cu_seqlens, cu_seqlens, {.is_causal = true, .enable_gqa = true});
  std::printf("varlen output %s for %zu sequences\n", ragged.shape_str().c_str(), cu_seqlens.size() - 1);
  return 0;
}
