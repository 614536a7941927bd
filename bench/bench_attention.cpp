// Google Benchmark timings of the fused SDPA kernels (forward and backward) and of the
// MultiheadAttention forward.
//
//   mha_bench [--threads=N] [Google Benchmark flags, e.g. --benchmark_filter=SDPA]
//
// Threads: --threads=N, else the MHA_NUM_THREADS environment variable, else every hardware
// thread (the library's default). Times are wall-clock (UseRealTime): the work runs on the
// library's thread pool, so the calling thread's CPU time would understate it. The FLOPS counter
// is the floating-point rate, e.g. "FLOPS=120G/s".
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mha/mha.hpp"
#include "random_tensor.hpp"

namespace {

using mha::tools::random_normal;

benchmark::Counter flops_counter(double flops_per_call) {
  return benchmark::Counter(flops_per_call, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

// Args: B, H, L (= Lq = Lk), d (= Dk = Dv), causal. Output is preallocated so that the
// kernel, not the allocator, is timed.
void sdpa_forward(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), len = state.range(2), dim = state.range(3);
  const bool causal = state.range(4) != 0;
  std::mt19937_64 rng(42);
  const mha::Tensor q = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor k = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor v = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor out = mha::Tensor::empty({batch, heads, len, dim});
  const mha::SdpaOptions options{.is_causal = causal};
  for (auto _ : state) {
    mha::scaled_dot_product_attention_into(q, k, v, out, options);
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = flops_counter(mha::attention_flops(batch, heads, len, len, dim, dim, causal));
}

// Args: B, H, L, d, W, mode. Causal self-attention over a sliding window of W keys (Mistral's
// local attention: is_causal, window_left = W - 1), mode 0 through the window option, 1 with the
// same band as a bool attn_mask [L, L], 2 over every earlier key (plain causal, the baseline).
// FLOPs count the pairs each call computes: the window's (L W - W (W - 1) / 2), or the causal ones.
void sdpa_window(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), len = state.range(2), dim = state.range(3);
  const int64_t window = state.range(4), mode = state.range(5);
  std::mt19937_64 rng(47);
  const mha::Tensor q = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor k = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor v = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor out = mha::Tensor::empty({batch, heads, len, dim});
  mha::Tensor band = mha::Tensor::empty({len, len}, mha::DType::boolean);
  for (int64_t i = 0; i < len; ++i)
    for (int64_t j = 0; j < len; ++j) band.data<uint8_t>()[i * len + j] = j <= i && j > i - window;
  mha::SdpaOptions options{.is_causal = mode != 1};
  if (mode == 0) options.window_left = window - 1;
  if (mode == 1) options.attn_mask = band.view();
  for (auto _ : state) {
    mha::scaled_dot_product_attention_into(q, k, v, out, options);
    benchmark::ClobberMemory();
  }
  const double w = static_cast<double>(std::min(window, len)), l = static_cast<double>(len);
  const double pairs = mode == 2 ? l * (l + 1) / 2 : l * w - w * (w - 1) / 2;
  state.counters["FLOPS"] = flops_counter(2.0 * pairs * 2.0 * static_cast<double>(dim * batch * heads));
}

// Args: B, H, L, d, causal, mode. Self-attention with ALiBi's biases (BLOOM's slopes 2^(-8 h / H)),
// mode 0 through alibi_slopes, 1 with the same biases as a float attn_mask [H, L, L] (what
// PyTorch's SDPA takes), 2 without biases (the baseline). FLOPs as SDPA_forward's.
void sdpa_alibi(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), len = state.range(2), dim = state.range(3);
  const bool causal = state.range(4) != 0;
  const int64_t mode = state.range(5);
  std::mt19937_64 rng(48);
  const mha::Tensor q = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor k = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor v = random_normal({batch, heads, len, dim}, rng);
  const mha::Tensor out = mha::Tensor::empty({batch, heads, len, dim});
  mha::Tensor slopes = mha::Tensor::empty({heads});
  for (int64_t h = 0; h < heads; ++h)
    slopes.data<float>()[h] = static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(heads)));
  mha::SdpaOptions options{.is_causal = causal};
  mha::Tensor biases;
  if (mode == 0) options.alibi_slopes = slopes.view();
  if (mode == 1) {
    biases = mha::Tensor::empty({heads, len, len});
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i)
        for (int64_t j = 0; j < len; ++j)
          biases.data<float>()[(h * len + i) * len + j] = -(slopes.data<float>()[h] * static_cast<float>(std::abs(i - j)));
    options.attn_mask = biases.view();
  }
  for (auto _ : state) {
    mha::scaled_dot_product_attention_into(q, k, v, out, options);
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = flops_counter(mha::attention_flops(batch, heads, len, len, dim, dim, causal));
}

// Args: B, H, L, d, causal, bf16 (0: float32 inputs). The backward alone (the forward's output
// and log-sum-exp are computed once, outside the loop); FLOPs are 2.5x the forward's, the usual
// convention.
void sdpa_backward(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), len = state.range(2), dim = state.range(3);
  const bool causal = state.range(4) != 0;
  const mha::DType dtype = state.range(5) != 0 ? mha::DType::bf16 : mha::DType::f32;
  std::mt19937_64 rng(44);
  auto input = [&] { return mha::Tensor::copy_of(random_normal({batch, heads, len, dim}, rng), dtype); };
  const mha::Tensor q = input(), k = input(), v = input(), grad = input();
  const mha::SdpaOptions options{.is_causal = causal};
  const mha::AttentionForTraining saved = mha::scaled_dot_product_attention_for_training(q, k, v, options);
  for (auto _ : state) {
    mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, options);
    benchmark::DoNotOptimize(g.query.view().data);
  }
  state.counters["FLOPS"] = flops_counter(2.5 * mha::attention_flops(batch, heads, len, len, dim, dim, causal));
}

// The timed loop of a decoding step, and its bytes counter: the key/value cache read per call.
void time_decode_steps(benchmark::State& state, const mha::Tensor& q, const mha::Tensor& k, const mha::Tensor& v,
                       const mha::Tensor& out, const mha::SdpaOptions& options) {
  for (auto _ : state) {
    mha::scaled_dot_product_attention_into(q, k, v, out, options);
    benchmark::ClobberMemory();
  }
  const double cache_bytes = static_cast<double>(k.numel() + v.numel()) * static_cast<double>(mha::dtype_size(k.dtype()));
  state.counters["bytes"] = benchmark::Counter(cache_bytes, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::kIs1024);
}

// Args: B, Hq, Hkv, S, d, Lq, dtype (0: float32, 1: bfloat16, 2 and 3: bfloat16 queries over a
// float8 e4m3 and e5m2 cache, half the bytes; 4: the e5m2 cache with k_descale and v_descale per
// batch entry and key/value head, against 3 the cost of the scales). A decoding step: Lq new queries per head against a cache of S keys
// and values (Hkv key/value heads; fewer than Hq is grouped-query attention), causal
// from the bottom right (each new token sees the cache and the tokens before it). A step reads the
// whole cache once, so the bytes counter (the cache's size per call) says more than the FLOPs.
void sdpa_decode(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), kv_heads = state.range(2), cache = state.range(3);
  const int64_t dim = state.range(4), queries = state.range(5);
  const mha::DType dtype = state.range(6) != 0 ? mha::DType::bf16 : mha::DType::f32;
  const mha::DType cache_dtype = state.range(6) == 2   ? mha::DType::f8e4m3
                                 : state.range(6) >= 3 ? mha::DType::f8e5m2
                                                       : dtype;
  std::mt19937_64 rng(45);
  auto input = [&](int64_t h, int64_t l, mha::DType t) {
    return mha::Tensor::copy_of(random_normal({batch, h, l, dim}, rng), t);
  };
  const mha::Tensor q = input(heads, queries, dtype), k = input(kv_heads, cache, cache_dtype);
  const mha::Tensor v = input(kv_heads, cache, cache_dtype);
  const mha::Tensor out = mha::Tensor::empty({batch, heads, queries, dim}, dtype);
  mha::SdpaOptions options{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight,
                           .enable_gqa = kv_heads != heads};
  mha::Tensor scales = mha::Tensor::empty({2, batch, kv_heads});
  for (int64_t i = 0; i < scales.numel(); ++i) scales.data<float>()[i] = 0.5f + static_cast<float>(i % 7) / 8.0f;
  if (state.range(6) == 4) options.k_descale = scales.view().select(0, 0), options.v_descale = scales.view().select(0, 1);
  time_decode_steps(state, q, k, v, out, options);
  state.counters["FLOPS"] = flops_counter(mha::attention_flops(batch, heads, queries, cache, dim, dim, true,
                                                               mha::CausalAlignment::BottomRight));
}

// Args: B, Hq, Hkv, S, d, Lq, page_size, layout. SDPA_decode's step (float32) over a paged cache:
// each sequence's S keys in pages of page_size rows, the pages of all sequences shuffled over the
// pool (as a server's cache ends up); layout 0 keeps a page's rows of one head together
// ([pages, Hkv, page_size, d]), layout 1 is vLLM's and FlashAttention's [pages, page_size, Hkv, d].
// Against SDPA_decode of the same shape, the cost of the indirection and of the scattered pages.
void sdpa_decode_paged(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), kv_heads = state.range(2), cache = state.range(3);
  const int64_t dim = state.range(4), queries = state.range(5), page_size = state.range(6);
  const bool flash_layout = state.range(7) != 0;
  std::mt19937_64 rng(48);
  const int64_t per_sequence = (cache + page_size - 1) / page_size, pages = batch * per_sequence;
  const mha::Tensor q = random_normal({batch, heads, queries, dim}, rng);
  const mha::Tensor k = random_normal(flash_layout ? mha::Shape{pages, page_size, kv_heads, dim}
                                                   : mha::Shape{pages, kv_heads, page_size, dim}, rng);
  const mha::Tensor v = random_normal(k.sizes(), rng);
  const mha::TensorView kc = flash_layout ? k.view().transpose(1, 2) : k.view();
  const mha::TensorView vc = flash_layout ? v.view().transpose(1, 2) : v.view();
  std::vector<int32_t> table(static_cast<size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const std::vector<int64_t> lens(static_cast<size_t>(batch), cache);
  const mha::SdpaOptions options{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight,
                                 .enable_gqa = kv_heads != heads};
  for (auto _ : state) {
    const mha::Tensor out = mha::paged_attention(q, kc, vc, table, lens, options);
    benchmark::DoNotOptimize(out.view().data);
  }
  const double cache_bytes = static_cast<double>(batch * kv_heads * cache * 2 * dim) * 4.0;
  state.counters["bytes"] = benchmark::Counter(cache_bytes, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::kIs1024);
}

// Args: B, Hq, Hkv, S, d, bf16, padded (percent). One token per head of a batch of generations with
// left padding: a bool mask [B, 1, 1, S] hides the first keys of each entry, from none (entry 0) to
// twice `padded` percent (the last), `padded` percent in all. Blocks of padding are skipped, so
// the time should fall with it; padded=0 (every key visible, the mask read all the same) is the
// baseline. The bytes counter is the cache's size, padding included.
void sdpa_decode_padded(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), kv_heads = state.range(2), cache = state.range(3);
  const int64_t dim = state.range(4), padded = state.range(6);
  const mha::DType dtype = state.range(5) != 0 ? mha::DType::bf16 : mha::DType::f32;
  std::mt19937_64 rng(46);
  auto input = [&](int64_t h, int64_t l) { return mha::Tensor::copy_of(random_normal({batch, h, l, dim}, rng), dtype); };
  const mha::Tensor q = input(heads, 1), k = input(kv_heads, cache), v = input(kv_heads, cache);
  const mha::Tensor out = mha::Tensor::empty({batch, heads, 1, dim}, dtype);
  mha::Tensor mask = mha::Tensor::empty({batch, 1, 1, cache}, mha::DType::boolean);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pad = batch == 1 ? cache * padded / 100 : cache * padded * 2 * b / (100 * (batch - 1));
    for (int64_t j = 0; j < cache; ++j) mask.data<uint8_t>()[b * cache + j] = j >= std::min(pad, cache - 1);
  }
  const mha::SdpaOptions options{.attn_mask = mask.view(), .enable_gqa = kv_heads != heads};
  time_decode_steps(state, q, k, v, out, options);
}

// Args: sequences, shortest, longest, causal. Variable-length self-attention, H=16, d=64: the
// lengths drawn once (fixed seed) between shortest and longest, packed; FLOPs count the pairs of
// the sequences themselves. Many short sequences show the per-sequence cost and the spreading of
// whole sequences over the threads; a few long ones, the tile kernel.
void sdpa_varlen(benchmark::State& state) {
  const int64_t sequences = state.range(0), shortest = state.range(1), longest = state.range(2);
  const bool causal = state.range(3) != 0;
  constexpr int64_t kHeads = 16, kDim = 64;
  std::mt19937_64 rng(47);
  std::vector<int64_t> cu{0};
  double flops = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t len = std::uniform_int_distribution<int64_t>(shortest, longest)(rng);
    cu.push_back(cu.back() + len);
    flops += mha::attention_flops(1, kHeads, len, len, kDim, kDim, causal);
  }
  const mha::Tensor q = random_normal({cu.back(), kHeads, kDim}, rng);
  const mha::Tensor k = random_normal({cu.back(), kHeads, kDim}, rng);
  const mha::Tensor v = random_normal({cu.back(), kHeads, kDim}, rng);
  for (auto _ : state) {
    const mha::Tensor out = mha::scaled_dot_product_attention_varlen(q, k, v, cu, cu, {.is_causal = causal});
    benchmark::DoNotOptimize(out.view().data);
  }
  state.counters["FLOPS"] = flops_counter(flops);
}

// Args: E, H, B, L. Self-attention without weights (need_weights=false), the fast path of a
// transformer layer; FLOPs include the four E x E projections.
void module_forward(benchmark::State& state) {
  const int64_t embed_dim = state.range(0), heads = state.range(1), batch = state.range(2), len = state.range(3);
  mha::MultiheadAttention attn(embed_dim, heads, {.seed = 7});
  attn.eval();
  std::mt19937_64 rng(43);
  const mha::Tensor x = random_normal({len, batch, embed_dim}, rng);
  for (auto _ : state) {
    mha::ForwardResult r = attn(x, x, x, {.need_weights = false});
    benchmark::DoNotOptimize(r.output.data<float>());
  }
  const double projections = 2.0 * batch * 4.0 * len * static_cast<double>(embed_dim) * embed_dim;
  const int64_t head_dim = embed_dim / heads;
  state.counters["FLOPS"] =
      flops_counter(projections + mha::attention_flops(batch, heads, len, len, head_dim, head_dim, false));
}

void register_benchmarks() {
  auto* sdpa = benchmark::RegisterBenchmark("SDPA_forward", sdpa_forward);
  sdpa->ArgNames({"B", "H", "L", "d", "causal"})->UseRealTime()->Unit(benchmark::kMillisecond);
  // The headline batch (B=4, H=16) at a medium and a long sequence...
  for (const int64_t len : {512, 2048})
    for (const int64_t dim : {64, 128})
      for (const int64_t causal : {0, 1}) sdpa->Args({4, 16, len, dim, causal});
  // ...a small call, where per-call overhead and threading show...
  for (const int64_t causal : {0, 1}) sdpa->Args({1, 8, 128, 64, causal});
  // ...and a BERT-sized batch of short heads, whose 50 MB of rows stream from memory every call.
  sdpa->Args({32, 12, 128, 64, 0});

  auto* window = benchmark::RegisterBenchmark("SDPA_window", sdpa_window);
  window->ArgNames({"B", "H", "L", "d", "W", "mode"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t mode : {0, 1, 2}) window->Args({1, 16, 4096, 64, 512, mode});
  for (const int64_t mode : {0, 2}) window->Args({1, 8, 16384, 64, 256, mode});

  auto* alibi = benchmark::RegisterBenchmark("SDPA_alibi", sdpa_alibi);
  alibi->ArgNames({"B", "H", "L", "d", "causal", "mode"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t causal : {0, 1})
    for (const int64_t mode : {0, 1, 2}) alibi->Args({4, 16, 2048, 64, causal, mode});

  auto* backward = benchmark::RegisterBenchmark("SDPA_backward", sdpa_backward);
  backward->ArgNames({"B", "H", "L", "d", "causal", "bf16"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t len : {128, 512, 2048})  // 128: 2 2/3 panels of 48, where padding shows
    for (const int64_t dim : {64, 128})
      for (const int64_t causal : {0, 1}) backward->Args({4, 16, len, dim, causal, 0});
  for (const int64_t len : {128, 2048}) backward->Args({4, 16, len, 64, 0, 1});  // bf16 training

  auto* decode = benchmark::RegisterBenchmark("SDPA_decode", sdpa_decode);
  decode->ArgNames({"B", "Hq", "Hkv", "S", "d", "Lq", "dtype"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t dtype : {0, 1, 2, 3, 4}) decode->Args({4, 16, 16, 2048, 64, 1, dtype});  // one token, a cache in memory
  decode->Args({4, 16, 16, 512, 64, 1, 0});                                          // a cache that fits in L3
  for (const int64_t dtype : {0, 2, 3, 4}) decode->Args({1, 32, 8, 4096, 128, 1, dtype});  // grouped heads
  decode->Args({1, 32, 8, 4096, 128, 8, 0});                                         // speculative: 8 tokens

  auto* paged = benchmark::RegisterBenchmark("SDPA_decode_paged", sdpa_decode_paged);
  paged->ArgNames({"B", "Hq", "Hkv", "S", "d", "Lq", "page", "layout"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t page : {16, 256})
    for (const int64_t layout : {0, 1}) paged->Args({4, 16, 16, 2048, 64, 1, page, layout});
  paged->Args({1, 32, 8, 4096, 128, 1, 16, 1});  // grouped heads, as SDPA_decode's
  paged->Args({1, 32, 8, 4096, 128, 8, 16, 1});  // speculative: 8 tokens

  auto* padded = benchmark::RegisterBenchmark("SDPA_decode_padded", sdpa_decode_padded);
  padded->ArgNames({"B", "Hq", "Hkv", "S", "d", "bf16", "padded"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t bf16 : {0, 1})
    for (const int64_t percent : {0, 25, 50}) padded->Args({8, 32, 8, 2048, 128, bf16, percent});

  auto* varlen = benchmark::RegisterBenchmark("SDPA_varlen", sdpa_varlen);
  varlen->ArgNames({"sequences", "shortest", "longest", "causal"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t causal : {0, 1}) {
    varlen->Args({256, 8, 128, causal});   // many short sequences
    varlen->Args({16, 64, 1024, causal});  // a few long ones
  }

  auto* module = benchmark::RegisterBenchmark("MHA_module_forward", module_forward);
  module->ArgNames({"E", "H", "B", "L"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const int64_t len : {128, 512}) module->Args({1024, 16, 4, len});
}

// Takes --threads=N out of argv (Google Benchmark rejects flags it does not know) and applies it.
void apply_threads_flag(int& argc, char** argv) {
  constexpr const char* kFlag = "--threads=";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], kFlag, std::strlen(kFlag)) == 0) {
      mha::set_num_threads(std::atoi(argv[i] + std::strlen(kFlag)));
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    apply_threads_flag(argc, argv);
  } catch (const mha::Error& e) {
    std::fprintf(stderr, "mha_bench: --threads: %s\n", e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("mha_isa", mha::cpu_isa());
  benchmark::AddCustomContext("mha_threads", std::to_string(mha::get_num_threads()));
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
