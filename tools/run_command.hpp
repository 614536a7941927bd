// `mha run`: a MultiheadAttention from a checkpoint (.safetensors, e.g. a PyTorch state_dict saved
// with the safetensors package) applied to inputs from .npy or .safetensors files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mha::tools {

struct RunOptions {
  std::string weights;    // .safetensors state dict
  std::string prefix;     // stripped from tensor names, e.g. "encoder.self_attn."
  int64_t num_heads = 0;  // 0: the checkpoint's "num_heads" metadata
  bool batch_first = false;
  bool add_zero_attn = false;
  std::string inputs;             // .safetensors holding query/key/value/attn_mask/key_padding_mask
  std::string query, key, value;  // or one .npy each (key/value default to query)
  std::string attn_mask, key_padding_mask;
  bool need_weights = false;
  bool average_attn_weights = true;
  bool is_causal = false;
  std::string out;          // .npy (output) or .safetensors ("output" and "weights")
  std::string weights_out;  // .npy for the weights, with --out .npy
  std::optional<int> threads;
};

int run_run(const RunOptions& options);

}  // namespace mha::tools
