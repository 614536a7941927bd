// The subcommands of the `mha` program. main.cpp parses the command line into these options;
// each run_* function does the work and returns the process exit code.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace mha::tools {

// A combination of options that the command line cannot express as a single option's check,
// e.g. --kv-heads with --module. main() reports it like a parse error.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct DemoOptions {
  std::string out_png = "out/attention_heads.png";
  uint64_t seed = 2024;
  std::optional<int> threads;
  bool skip_timing = false;
};
int run_demo(const DemoOptions& options);

struct BenchOptions {
  int64_t batch = 4;
  int64_t len_q = 2048;
  std::optional<int64_t> len_k;  // default: len_q
  int64_t heads = 16;
  std::optional<int64_t> kv_heads;  // default: heads; fewer is grouped-query attention
  int64_t dim = 64;
  std::optional<int64_t> dim_v;  // default: dim
  bool causal = false;
  std::string align = "top-left";  // or "bottom-right"
  int64_t window_left = -1, window_right = -1;  // a sliding window (-1: unbounded on that side)
  bool alibi = false;                           // ALiBi with BLOOM's slopes 2^(-8 h / H)
  bool sinks = false;                           // attention sinks, one per head
  double softcap = 0.0;                         // logit soft-capping (0: none)
  int64_t page_size = 0;  // > 0: keys and values in a paged cache of pages this long (paged_attention)
  std::optional<int> threads;
  int reps = 5;
  int warmup = 1;
  bool module = false;   // time MultiheadAttention.forward with embed_dim = heads * dim
  bool backward = false;  // time the SDPA backward (the gradients of q, k, v) instead of the forward
  std::string grads = "qkv";  // with backward: which gradients (letters of q, k, v)
  bool weights = false;  // also return the attention weights
  double dropout = 0.0;  // dropout probability on the weights (the module in training mode)
  bool json = false;
  uint64_t seed = 1;
  std::string dtype = "float32";  // or bfloat16, float16 (the GPU kernel takes these two)
  std::string kv_dtype;           // keys' and values' dtype: empty for --dtype's, or a float8 format
  std::string device = "cpu";     // or cuda, cuda:N
};
int run_bench(const BenchOptions& options);

int run_info();

}  // namespace mha::tools
