// `mha demo`: the first thing to run. Two module calls (self-attention with a causal mask,
// cross-attention with padded keys) checked against the float64 reference, a picture of every
// head's attention weights, and the fused kernel's speed against the naive reference.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "accuracy.hpp"
#include "commands.hpp"
#include "demo_timing.hpp"
#include "heatmap_grid.hpp"
#include "mha/mha.hpp"
#include "png_writer.hpp"

namespace mha::tools {
namespace {

constexpr double kTolerance = 1e-5;

// Position encodings have entries in [-1, 1]; with PyTorch's initialisation of the projections
// that gives scores so small that every head is nearly uniform. Scaling the input up sharpens
// the softmax so each head's preferences are visible in the picture.
constexpr float kSignalAmplitude = 5.0f;
constexpr float kNoiseStddev = 0.1f;

// [length, batch, width] (the module's default sequence-first layout). Feature 2i is
// sin(p / 10000^(2i / width)) and 2i+1 the matching cos, at position p = first + step * l: nearby
// positions get similar vectors, so even random projections yield heads that attend by relative
// position (bands near the diagonal) rather than noise. Each batch entry gets its own noise.
Tensor position_sequence(int64_t length, int64_t batch, int64_t width, double first, double step,
                         std::mt19937_64& rng) {
  Tensor t = Tensor::empty({length, batch, width});
  std::normal_distribution<float> noise(0.0f, kNoiseStddev);
  float* data = t.data<float>();
  for (int64_t l = 0; l < length; ++l) {
    const double position = first + step * static_cast<double>(l);
    for (int64_t n = 0; n < batch; ++n) {
      for (int64_t f = 0; f < width; ++f) {
        const double frequency = std::pow(10000.0, -static_cast<double>(f - f % 2) / static_cast<double>(width));
        const double angle = position * frequency;
        const double encoding = f % 2 == 0 ? std::sin(angle) : std::cos(angle);
        data[(l * batch + n) * width + f] = kSignalAmplitude * static_cast<float>(encoding) + noise(rng);
      }
    }
  }
  return t;
}

// Runs the module and the float64 reference on the same call, prints both errors, and returns
// the module's result along with the verdict.
struct CheckedCall {
  ForwardResult result;
  bool passed = false;
};

CheckedCall run_checked(const MultiheadAttention& attn, const Tensor& query, const Tensor& key, const Tensor& value,
                        const ForwardOptions& options) {
  CheckedCall c;
  c.result = attn(query, key, value, options);
  const ForwardResult ref = reference::multihead_attention(attn, query, key, value, options, /*training=*/false);
  const double output_error = max_relative_error(c.result.output, ref.output);
  const double weights_error = max_relative_error(*c.result.weights, *ref.weights);
  c.passed = output_error < kTolerance && weights_error < kTolerance;
  std::printf("      output %s, weights %s\n", c.result.output.shape_str().c_str(),
              c.result.weights->shape_str().c_str());
  std::printf("      max relative error vs float64 reference: output %.1e, weights %.1e  -> %s (tolerance %.0e)\n",
              output_error, weights_error, c.passed ? "PASS" : "FAIL", kTolerance);
  return c;
}

// One panel per head of batch entry `batch_index` from weights [N, H, L, S]; `hidden(i, j)` says
// which cells a mask excluded.
template <class Hidden>
std::vector<HeatmapPanel> head_panels(const Tensor& weights, int64_t batch_index, const std::string& prefix,
                                      Hidden hidden) {
  std::vector<HeatmapPanel> panels;
  const int64_t heads = weights.size(1), rows = weights.size(2), cols = weights.size(3);
  for (int64_t h = 0; h < heads; ++h) {
    HeatmapPanel p;
    p.title = prefix + " head " + std::to_string(h);
    p.rows = rows;
    p.cols = cols;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        p.values.push_back(weights.at({batch_index, h, i, j}));
        p.hidden.push_back(hidden(i, j));
      }
    }
    panels.push_back(std::move(p));
  }
  return panels;
}

struct Example {
  CheckedCall call;
  HeatmapRow picture;
};

// The demo's sizes are small ints, printed with %d.
Example self_attention_example(uint64_t seed) {
  const int embed_dim = 64, heads = 4, length = 48, batch = 2;
  std::printf("[1/4] Self-attention with a causal mask\n");
  std::printf("      MultiheadAttention(embed_dim=%d, num_heads=%d), parameters from seed %llu\n", embed_dim, heads,
              static_cast<unsigned long long>(seed));
  MultiheadAttention attn(embed_dim, heads, {.seed = seed});
  attn.eval();
  std::mt19937_64 rng(seed + 1);
  const Tensor x = position_sequence(length, batch, embed_dim, 0.0, 1.0, rng);
  std::printf("      x [L=%d, N=%d, E=%d]: %g x sinusoidal position encoding + N(0, %g^2) noise\n", length, batch,
              embed_dim, kSignalAmplitude, kNoiseStddev);
  std::printf("      attn(x, x, x, is_causal=true, need_weights=true, average_attn_weights=false)\n");
  Example e;
  e.call = run_checked(attn, x, x, x, {.need_weights = true, .average_attn_weights = false, .is_causal = true});
  e.picture.heading = "SELF-ATTENTION, CAUSAL (BATCH 0): ROWS = QUERIES, COLUMNS = KEYS";
  e.picture.panels = head_panels(*e.call.result.weights, 0, "self", [](int64_t i, int64_t j) { return j > i; });
  return e;
}

Example cross_attention_example(uint64_t seed) {
  const int embed_dim = 64, heads = 4, kdim = 48, vdim = 40;
  const int len_q = 24, len_kv = 40, batch = 2;
  const int padded = 8, padded_entry = 1;  // batch entry 1's last 8 keys are padding
  std::printf("[2/4] Cross-attention with padded keys\n");
  std::printf("      MultiheadAttention(embed_dim=%d, num_heads=%d, kdim=%d, vdim=%d), parameters from seed %llu\n",
              embed_dim, heads, kdim, vdim, static_cast<unsigned long long>(seed + 2));
  MultiheadAttention attn(embed_dim, heads, {.kdim = kdim, .vdim = vdim, .seed = seed + 2});
  attn.eval();
  std::mt19937_64 rng(seed + 3);
  // The query sequence runs at a different pace from the key/value sequence (step 40/24), the
  // way a decoder reads an encoder's output of another length.
  const Tensor query = position_sequence(len_q, batch, embed_dim, 0.0, static_cast<double>(len_kv) / len_q, rng);
  const Tensor key = position_sequence(len_kv, batch, kdim, 0.0, 1.0, rng);
  const Tensor value = position_sequence(len_kv, batch, vdim, 0.0, 1.0, rng);
  Tensor key_padding_mask = Tensor::zeros({batch, len_kv}, DType::boolean);  // true: ignore that key
  for (int s = len_kv - padded; s < len_kv; ++s) key_padding_mask.data<bool>()[padded_entry * len_kv + s] = true;
  std::printf("      query [L=%d, N=%d, %d], key [S=%d, N=%d, %d], value [S=%d, N=%d, %d]\n", len_q, batch, embed_dim,
              len_kv, batch, kdim, len_kv, batch, vdim);
  std::printf("      key_padding_mask hides the last %d keys of batch entry %d\n", padded, padded_entry);
  std::printf("      attn(query, key, value, key_padding_mask, need_weights=true, average_attn_weights=false)\n");
  Example e;
  e.call =
      run_checked(attn, query, key, value,
                  {.key_padding_mask = key_padding_mask.view(), .need_weights = true, .average_attn_weights = false});
  e.picture.heading = "CROSS-ATTENTION (BATCH " + std::to_string(padded_entry) + "): LAST " + std::to_string(padded) +
                      " KEYS ARE PADDING";
  e.picture.panels = head_panels(*e.call.result.weights, padded_entry, "cross",
                                 [&](int64_t, int64_t j) { return j >= len_kv - padded; });
  return e;
}

void write_picture(const std::vector<HeatmapRow>& rows, const std::string& path) {
  std::printf("[3/4] Picture of the attention weights, one panel per head\n");
  HeatmapStyle style;
  style.gamma = 0.5;  // a square-root scale shows the weaker preferences beside the strongest ones
  style.colour_bar_label = "ATTENTION WEIGHT (SQUARE-ROOT COLOUR SCALE)";
  style.notes = {"GREY: MASKED OUT (CAUSAL MASK OR KEY PADDING)"};
  write_png(render_heatmap_grid(rows, style), path);
  std::printf("      wrote %s\n", path.c_str());
  std::printf(
      "      rows are query positions, columns key positions; colour is the weight on a square-root\n"
      "      scale (viridis: dark purple 0 to yellow 1); grey cells are masked out\n");
}

}  // namespace

int run_demo(const DemoOptions& options) {
  if (options.threads) set_num_threads(*options.threads);
  std::printf("mha %s demo (ISA %s, threads: %d)\n\n", MHA_VERSION, cpu_isa().c_str(), get_num_threads());
  const Example self = self_attention_example(options.seed);
  std::printf("\n");
  const Example cross = cross_attention_example(options.seed);
  std::printf("\n");
  write_picture({self.picture, cross.picture}, options.out_png);
  std::printf("\n");
  if (!options.skip_timing) {
    std::printf("[4/4] Timing\n");
    print_timing_table(options.seed);
  } else {
    std::printf("[4/4] Timing skipped (--no-timing)\n");
  }
  const bool passed = self.call.passed && cross.call.passed;
  std::printf("\n%s; picture: %s\n", passed ? "All checks passed" : "A CHECK FAILED",
              std::filesystem::absolute(options.out_png).c_str());
  return passed ? 0 : 1;
}

}  // namespace mha::tools
