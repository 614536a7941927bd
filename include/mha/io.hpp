// Reading and writing tensors: safetensors (PyTorch checkpoints saved with the `safetensors`
// package) and numpy's .npy. Files are untrusted input: every length, offset, dtype and shape is
// checked, and anything malformed is an mha::Error, never a crash or an out-of-bounds read.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <unordered_map>

#include "mha/multihead_attention.hpp"
#include "mha/tensor.hpp"

namespace mha {

// Tensors by name, in name order. Values own their (contiguous) storage.
using TensorMap = std::map<std::string, Tensor>;

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map
};

// dtypes read: F32, F64, BF16, F16, BOOL; any other is an mha::Error naming it.
SafetensorsFile load_safetensors(const std::string& path);
SafetensorsFile parse_safetensors(const void* data, size_t size);  // the same, from memory
// Writes views of any strides (stored contiguous, in name order), with optional metadata.
void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// .npy versions 1.0 to 3.0; dtypes <f4, <f8, <f2, |b1; C or Fortran order (returned C-contiguous).
Tensor load_npy(const std::string& path);
Tensor parse_npy(const void* data, size_t size);
void save_npy(const std::string& path, const TensorView& tensor);

// Views of a map's tensors, the form load_state_dict takes.
std::unordered_map<std::string, TensorView> views_of(const TensorMap& tensors);

// A module whose options are read off a state dict's names and shapes (embed_dim, kdim, vdim,
// bias, add_bias_kv, and the dtype: bfloat16, float16 or float64 weights make a module of that
// dtype, any other float32) plus what a state dict cannot tell, with its weights loaded.
MultiheadAttention module_from_state_dict(const TensorMap& state, int64_t num_heads, bool add_zero_attn = false,
                                          bool batch_first = false);

}  // namespace mha
