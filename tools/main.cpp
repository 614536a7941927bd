// `mha`: the command line of the library. Subcommands: demo (what to run first), bench, run, train-demo, info.
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <exception>
#include <string>

#include "commands.hpp"
#include "run_command.hpp"
#include "train_demo.hpp"
#include "mha/error.hpp"

namespace {

using mha::tools::BenchOptions;
using mha::tools::DemoOptions;

// A whole number >= `min`. (CLI11's PositiveNumber reports its range as "0 to 1.8e308".)
CLI::Validator at_least(long long min) {
  // Shown in --help after the type, in CLI11's own words where it has them: "INT:POSITIVE".
  std::string name = ">=" + std::to_string(min);
  if (min == 0) name = "NONNEGATIVE";
  if (min == 1) name = "POSITIVE";
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        long long value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error != std::errc() || end != text.data() + text.size() || value < min) {
          return "expected a whole number >= " + std::to_string(min) + ", got '" + text + "'";
        }
        return {};
      },
      name);
}

void add_demo(CLI::App& app, DemoOptions& o) {
  CLI::App* demo =
      app.add_subcommand("demo",
                         "Self- and cross-attention examples checked against the float64 reference, a PNG of every "
                         "head's attention weights, and a timing table");
  demo->add_option("--out", o.out_png, "Where to write the PNG")->capture_default_str();
  demo->add_option("--seed", o.seed, "Seed of the module parameters and inputs")->capture_default_str();
  demo->add_option("--threads", o.threads, "Worker threads (default: the library's setting)")->check(at_least(1));
  demo->add_flag("--no-timing", o.skip_timing, "Skip the timing table");
}

void add_bench(CLI::App& app, BenchOptions& o) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Time one attention forward call (SDPA, or the module with --module) or SDPA backward call "
      "(--backward) on random inputs");
  bench->add_option("-b,--batch", o.batch, "Batch size B")->capture_default_str()->check(at_least(1));
  bench->add_option("--lq", o.len_q, "Query length")->capture_default_str()->check(at_least(1));
  bench->add_option("--lk", o.len_k, "Key/value length (default: --lq)")->check(at_least(1));
  bench->add_option("--heads", o.heads, "Query heads")->capture_default_str()->check(at_least(1));
  bench->add_option("--kv-heads", o.kv_heads, "Key/value heads (default: --heads; fewer is grouped-query attention)")
      ->check(at_least(1));
  bench->add_option("--dim", o.dim, "Head dimension of queries and keys")->capture_default_str()->check(at_least(1));
  bench->add_option("--dim-v", o.dim_v, "Head dimension of values (default: --dim)")->check(at_least(1));
  bench->add_flag("--causal", o.causal, "Causal mask");
  bench->add_option("--align", o.align, "Diagonal of the causal mask when Lq != Lk")
      ->capture_default_str()
      ->check(CLI::IsMember({"top-left", "bottom-right"}));
  bench->add_option("--window-left", o.window_left,
                    "Sliding window: keys before each query's diagonal it sees (-1: unbounded)")
      ->capture_default_str()
      ->check(at_least(-1));
  bench->add_option("--window-right", o.window_right,
                    "Sliding window: keys after each query's diagonal it sees (-1: unbounded)")
      ->capture_default_str()
      ->check(at_least(-1));
  bench->add_flag("--alibi", o.alibi, "ALiBi biases with BLOOM's slopes 2^(-8 h / H) per head h = 1..H");
  bench->add_flag("--sinks", o.sinks, "attention sinks (gpt-oss's), one logit per head");
  bench->add_option("--softcap", o.softcap, "Logit soft-capping, softcap * tanh(score / softcap) (Gemma 2's 50; 0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e30));
  bench->add_option("--page-size", o.page_size,
                    "Keys and values in a paged cache (FlashAttention's [pages, page_size, Hkv, d] layout, each "
                    "sequence's pages shuffled over the pool) of pages this long: paged_attention")
      ->check(at_least(1));
  bench->add_option("--threads", o.threads, "Worker threads (default: the library's setting)")->check(at_least(1));
  bench->add_option("--reps", o.reps, "Timed calls")->capture_default_str()->check(at_least(1));
  bench->add_option("--warmup", o.warmup, "Untimed calls before timing")->capture_default_str()->check(at_least(0));
  bench->add_flag("--module", o.module, "Time MultiheadAttention.forward (embed_dim = heads * dim) instead of SDPA");
  bench->add_flag("--backward", o.backward,
                  "Time the SDPA backward (gradients of q, k and v from the training forward's output and "
                  "log-sum-exp); FLOPs are 2.5x the forward's");
  bench->add_option("--grads", o.grads,
                    "With --backward: the gradients to compute, letters of q, k and v (the others' products are "
                    "skipped; FLOPs are still counted as the whole backward's, so compare times)")
      ->capture_default_str();
  bench->add_flag("--weights", o.weights, "Also return the attention weights (materialises Lq x Lk per head)");
  bench->add_option("--dropout", o.dropout, "Dropout probability on the attention weights (the module in training mode)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  bench->add_flag("--json", o.json, "Print one JSON object on stdout instead of text");
  bench->add_option("--seed", o.seed, "Seed of the random inputs")->capture_default_str();
  bench->add_option("--dtype", o.dtype, "Input dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "float64", "bfloat16", "float16"}));
  bench->add_option("--kv-dtype", o.kv_dtype,
                    "Keys' and values' dtype (default: --dtype): float8_e4m3fn or float8_e5m2 hold them in 8 "
                    "bits, a quantized cache (SDPA and --page-size forwards on the host)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}));
  bench->add_option("--device", o.device, "cpu, or cuda[:N] for the GPU kernel (SDPA only; bfloat16 or float16)")
      ->capture_default_str();
}

void add_run(CLI::App& app, mha::tools::RunOptions& o) {
  CLI::App* run = app.add_subcommand(
      "run", "Apply a MultiheadAttention from a checkpoint (.safetensors state dict, e.g. PyTorch's) to inputs "
             "from .npy or .safetensors files");
  run->add_option("--weights", o.weights, "The .safetensors state dict")->required()->check(CLI::ExistingFile);
  run->add_option("--num-heads", o.num_heads, "Heads (default: the checkpoint's num_heads metadata)")
      ->check(at_least(1));
  run->add_option("--prefix", o.prefix, "Prefix of the module's tensor names in the checkpoint, e.g. 'layer.attn.'");
  run->add_flag("--batch-first", o.batch_first, "Inputs are [N, L, E] instead of [L, N, E]");
  run->add_flag("--add-zero-attn", o.add_zero_attn, "The module was built with add_zero_attn=True");
  run->add_option("--inputs", o.inputs, "A .safetensors file with query (and key, value, attn_mask, key_padding_mask)")
      ->check(CLI::ExistingFile);
  run->add_option("--query", o.query, ".npy query")->check(CLI::ExistingFile);
  run->add_option("--key", o.key, ".npy key (default: the query)")->check(CLI::ExistingFile);
  run->add_option("--value", o.value, ".npy value (default: the key)")->check(CLI::ExistingFile);
  run->add_option("--attn-mask", o.attn_mask, ".npy attn_mask (bool: True is masked out; or float)")
      ->check(CLI::ExistingFile);
  run->add_option("--key-padding-mask", o.key_padding_mask, ".npy key_padding_mask")->check(CLI::ExistingFile);
  run->add_flag("--need-weights", o.need_weights, "Also compute the attention weights");
  run->add_flag("!--no-average", o.average_attn_weights, "Per-head weights instead of their mean");
  run->add_flag("--causal", o.is_causal, "Apply a causal mask");
  run->add_option("--out", o.out, "Output: .npy (the output) or .safetensors (output and weights)")->required();
  run->add_option("--weights-out", o.weights_out, ".npy for the weights when --out is .npy");
  run->add_option("--threads", o.threads, "Worker threads (default: the library's setting)")->check(at_least(1));
}

void add_train_demo(CLI::App& app, mha::tools::TrainDemoOptions& o) {
  CLI::App* t = app.add_subcommand(
      "train-demo", "Train a one-layer attention model to reverse token sequences (forward, backward, Adam in C++)");
  t->add_option("--steps", o.steps, "Adam steps")->capture_default_str()->check(at_least(1));
  t->add_option("--lr", o.learning_rate, "Learning rate")->capture_default_str();
  t->add_option("--length", o.length, "Sequence length")->capture_default_str()->check(at_least(2));
  t->add_option("--vocab", o.vocab, "Tokens")->capture_default_str()->check(at_least(2));
  t->add_option("--batch", o.batch, "Sequences per step")->capture_default_str()->check(at_least(1));
  t->add_option("--seed", o.seed, "Seed")->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mha: multi-head attention on the CPU (PyTorch semantics, fused kernels)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MHA_VERSION);
  DemoOptions demo_options;
  BenchOptions bench_options;
  add_demo(app, demo_options);
  add_bench(app, bench_options);
  mha::tools::RunOptions run_options;
  add_run(app, run_options);
  mha::tools::TrainDemoOptions train_options;
  add_train_demo(app, train_options);
  app.add_subcommand("info", "Version, instruction set and thread count");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (app.got_subcommand("demo")) return mha::tools::run_demo(demo_options);
    if (app.got_subcommand("bench")) return mha::tools::run_bench(bench_options);
    if (app.got_subcommand("run")) return mha::tools::run_run(run_options);
    if (app.got_subcommand("train-demo")) return mha::tools::run_train_demo(train_options);
    return mha::tools::run_info();
  } catch (const mha::Error& e) {  // the library rejected an argument
    std::fprintf(stderr, "mha: error: %s\n", e.what());
    return 2;
  } catch (const mha::tools::UsageError& e) {
    std::fprintf(stderr, "mha: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha: failed: %s\n", e.what());
    return 1;
  }
}
