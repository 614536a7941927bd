// `mha bench`: times one forward call on random inputs, either SDPA (the fused kernel) or the
// whole MultiheadAttention module (projections + attention + output projection).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iomanip>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "mha/mha.hpp"
#include "random_tensor.hpp"
#include "timing.hpp"

namespace mha::tools {
namespace {

// Below this many milliseconds in all, a run finishes before anyone wonders whether it hangs.
constexpr double kQuietMs = 2000;

// The resolved shape: every defaulted option filled in.
struct BenchShape {
  int64_t batch, heads, kv_heads, len_q, len_k, dim, dim_v;
  bool causal;
  CausalAlignment alignment;
  int64_t window_left, window_right;
};

BenchShape resolve(const BenchOptions& o) {
  return {o.batch,
          o.heads,
          o.kv_heads.value_or(o.heads),
          o.len_q,
          o.len_k.value_or(o.len_q),
          o.dim,
          o.dim_v.value_or(o.dim),
          o.causal,
          o.align == "bottom-right" ? CausalAlignment::BottomRight : CausalAlignment::TopLeft,
          o.window_left,
          o.window_right};
}

// The (query, key) pairs of one head that causality and the window leave, for the FLOP count.
double visible_pairs(const BenchShape& s) {
  const int64_t diagonal = s.alignment == CausalAlignment::BottomRight ? s.len_k - s.len_q : 0;
  double pairs = 0;
  for (int64_t i = 0; i < s.len_q; ++i) {
    int64_t begin = 0, end = s.len_k;  // keys [begin, end)
    if (s.window_left >= 0) begin = std::max<int64_t>(begin, i + diagonal - s.window_left);
    if (s.causal) end = std::min<int64_t>(end, i + diagonal + 1);
    if (s.window_right >= 0) end = std::min<int64_t>(end, i + diagonal + s.window_right + 1);
    pairs += static_cast<double>(std::max<int64_t>(end - begin, 0));
  }
  return pairs;
}

// ALiBi's slopes as BLOOM sets them: 2^(-8 h / H) for head h = 1..H.
Tensor bloom_slopes(int64_t heads) {
  Tensor slopes = Tensor::empty({heads});
  for (int64_t h = 0; h < heads; ++h)
    slopes.data<float>()[h] = static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(heads)));
  return slopes;
}

// Attention sinks for --sinks, one per head, of either sign around the scores (gpt-oss learns them).
Tensor bench_sinks(int64_t heads) {
  Tensor sinks = Tensor::empty({heads});
  for (int64_t h = 0; h < heads; ++h) sinks.data<float>()[h] = static_cast<float>(h % 5) - 2.0f;
  return sinks;
}

// The tensors the options point to: ALiBi's slopes (BLOOM's, --alibi) and the sinks (--sinks).
struct OptionTensors {
  Tensor slopes, sinks;
  OptionTensors(const BenchShape& s, const BenchOptions& o)
      : slopes(o.alibi ? bloom_slopes(s.heads) : Tensor()), sinks(o.sinks ? bench_sinks(s.heads) : Tensor()) {}
};

// The shape's and the options' SDPA options; `tensors` must outlive them.
SdpaOptions sdpa_options(const BenchShape& s, const BenchOptions& o, const OptionTensors& tensors) {
  return {.is_causal = s.causal,
          .causal_alignment = s.alignment,
          .window_left = s.window_left,
          .window_right = s.window_right,
          .alibi_slopes = o.alibi ? std::optional<TensorView>(tensors.slopes.view()) : std::nullopt,
          .sinks = o.sinks ? std::optional<TensorView>(tensors.sinks.view()) : std::nullopt,
          .softcap = o.softcap,
          .enable_gqa = s.kv_heads != s.heads,
          .dropout_p = o.dropout,
          .dropout_seed = o.seed};
}

// What is timed: one call, its floating-point work, and a line that describes it.
struct Workload {
  std::function<void()> call;
  double flops = 0;
  std::string description;
};

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(0);
  if (name.rfind("cuda:", 0) == 0 && name.size() > 5 && name.find_first_not_of("0123456789", 5) == std::string::npos &&
      name.size() < 10) {
    return Device::cuda(std::stoi(name.substr(5)));
  }
  throw UsageError("--device: expected cpu, cuda or cuda:N, got '" + name + "'");
}

DType parse_dtype(const std::string& name) {
  if (name == "float8_e4m3fn") return DType::f8e4m3;
  if (name == "float8_e5m2") return DType::f8e5m2;
  return name == "bfloat16" ? DType::bf16 : name == "float16" ? DType::f16 : name == "float64" ? DType::f64 : DType::f32;
}

// The keys' and values' dtype: --kv-dtype's, else --dtype's.
DType kv_dtype(const BenchOptions& o) { return parse_dtype(o.kv_dtype.empty() ? o.dtype : o.kv_dtype); }

// " (keys and values float8_e4m3fn)" where --kv-dtype differs from --dtype.
std::string kv_note(const BenchOptions& o) {
  return o.kv_dtype.empty() || o.kv_dtype == o.dtype ? "" : " (keys and values " + o.kv_dtype + ")";
}

// --grads: letters of q, k and v, each at most once, at least one.
SdpaGradientsWanted wanted_gradients(const std::string& letters) {
  SdpaGradientsWanted w{.query = false, .key = false, .value = false};
  bool* of[] = {&w.query, &w.key, &w.value};
  for (const char c : letters) {
    const auto at = std::string("qkv").find(c);
    if (at == std::string::npos || *of[at]) {
      throw UsageError("--grads: expected letters of q, k and v, each at most once, got '" + letters + "'");
    }
    *of[at] = true;
  }
  if (letters.empty()) throw UsageError("--grads: expected at least one of q, k and v, got ''");
  return w;
}

// A random normal tensor in `dtype` on `device`.
Tensor random_input(const Shape& shape, std::mt19937_64& rng, DType dtype, Device device) {
  const Tensor t = random_normal(shape, rng);
  const Tensor typed = dtype == DType::f32 ? t : Tensor::copy_of(t, dtype);
  return device.is_cpu() ? typed : typed.to(device);
}

// The keys and values of each sequence (Lk of them) in a paged cache, FlashAttention's layout
// [pages, page_size, Hkv, d], the pages of all sequences shuffled over the pool (as a server's
// cache ends up): one paged_attention call.
Workload paged_workload(const BenchShape& s, const BenchOptions& o, std::mt19937_64& rng) {
  if (o.device != "cpu") throw UsageError("--page-size: paged caches run on the host kernels; drop --device");
  if (o.backward || o.weights || o.dropout > 0) {
    throw UsageError(std::string("--page-size: paged attention is inference (no backward, weights or dropout); drop ") +
                     (o.backward ? "--backward" : o.weights ? "--weights" : "--dropout"));
  }
  const DType dtype = parse_dtype(o.dtype);
  const int64_t per_sequence = (s.len_k + o.page_size - 1) / o.page_size, pages = s.batch * per_sequence;
  const Tensor q = random_input({s.batch, s.heads, s.len_q, s.dim}, rng, dtype, Device::cpu());
  const Tensor k = random_input({pages, o.page_size, s.kv_heads, s.dim}, rng, kv_dtype(o), Device::cpu());
  const Tensor v = random_input({pages, o.page_size, s.kv_heads, s.dim_v}, rng, kv_dtype(o), Device::cpu());
  auto table = std::make_shared<std::vector<int32_t>>(static_cast<size_t>(pages));
  std::iota(table->begin(), table->end(), 0);
  std::shuffle(table->begin(), table->end(), rng);
  auto lens = std::make_shared<const std::vector<int64_t>>(static_cast<size_t>(s.batch), s.len_k);
  const auto tensors = std::make_shared<const OptionTensors>(s, o);
  const SdpaOptions options = sdpa_options(s, o, *tensors);
  Workload w;
  w.flops = 2.0 * visible_pairs(s) * static_cast<double>(s.dim + s.dim_v) * static_cast<double>(s.batch * s.heads);
  w.call = [q, k, v, table, lens, tensors, options] {
    (void)paged_attention(q, k.view().transpose(1, 2), v.view().transpose(1, 2), *table, *lens, options);
  };
  w.description = "paged_attention (pages of " + std::to_string(o.page_size) + ") on cpu, " + o.dtype + kv_note(o);
  return w;
}

Workload sdpa_workload(const BenchShape& s, const BenchOptions& o, std::mt19937_64& rng) {
  Workload w;
  const Device device = parse_device(o.device);
  const DType dtype = parse_dtype(o.dtype);
  if (!device.is_cpu() && o.weights) throw UsageError("--weights: the GPU kernel never forms the weights; drop --weights");
  if (!device.is_cpu() && o.dropout > 0) throw UsageError("--dropout: the GPU kernel has no dropout; drop --dropout");
  if (!device.is_cpu() && o.alibi) throw UsageError("--alibi: ALiBi runs on the host kernels; drop --alibi or --device");
  if (!device.is_cpu() && o.sinks) throw UsageError("--sinks: sinks are applied on the host; drop --sinks or --device");
  if (!device.is_cpu() && o.softcap > 0) {
    throw UsageError("--softcap: soft-capping runs in the host kernels; drop --softcap or --device");
  }
  if (!device.is_cpu() && o.window_left >= 0) {
    throw UsageError("--window-left: a window's left end runs on the host kernels; drop --window-left or --device");
  }
  if (kv_dtype(o) != dtype && (o.backward || !device.is_cpu())) {
    throw UsageError("--kv-dtype: keys and values of another dtype are an inference call on the host; drop " +
                     std::string(o.backward ? "--backward" : "--device"));
  }
  if (o.page_size > 0) return paged_workload(s, o, rng);
  const Tensor q = random_input({s.batch, s.heads, s.len_q, s.dim}, rng, dtype, device);
  const Tensor k = random_input({s.batch, s.kv_heads, s.len_k, s.dim}, rng, kv_dtype(o), device);
  const Tensor v = random_input({s.batch, s.kv_heads, s.len_k, s.dim_v}, rng, kv_dtype(o), device);
  // Outputs are allocated once so the timing is the kernel's, not the allocator's.
  const Tensor out = Tensor::empty({s.batch, s.heads, s.len_q, s.dim_v}, dtype, device);
  Tensor weights_buffer;
  std::optional<TensorView> weights_view;
  if (o.weights) {
    weights_buffer = Tensor::empty({s.batch, s.heads, s.len_q, s.len_k}, dtype);
    weights_view = weights_buffer.view();
  }
  const auto tensors = std::make_shared<const OptionTensors>(s, o);
  const SdpaOptions options = sdpa_options(s, o, *tensors);
  w.flops = 2.0 * visible_pairs(s) * static_cast<double>(s.dim + s.dim_v) * static_cast<double>(s.batch * s.heads);
  if (o.backward) {
    // The training forward runs once; each call is one backward from its output and
    // log-sum-exp, for a random output gradient.
    auto saved = std::make_shared<const AttentionForTraining>(scaled_dot_product_attention_for_training(q, k, v, options));
    const Tensor grad_out = random_input({s.batch, s.heads, s.len_q, s.dim_v}, rng, dtype, device);
    const SdpaGradientsWanted wanted = wanted_gradients(o.grads);
    w.call = [q, k, v, saved, grad_out, tensors, options, device, wanted] {
      (void)scaled_dot_product_attention_backward(q, k, v, *saved, grad_out, options, wanted);
      if (!device.is_cpu()) cuda::synchronize(device.index);
    };
    w.flops *= 2.5;  // the FlashAttention papers' convention (docs/PERFORMANCE.md)
    w.description = "scaled_dot_product_attention backward on " + device.str() + ", " + o.dtype;
    return w;
  }
  // Tensors are captured by value: the call shares, and so keeps alive, their storage. On the GPU
  // the call waits for the kernel, so that the time is its run, not its launch.
  w.call = [q, k, v, out, weights_buffer, weights_view, tensors, options, device] {
    scaled_dot_product_attention_into(q, k, v, out, options, weights_view);
    if (!device.is_cpu()) cuda::synchronize(device.index);
  };
  w.description = "scaled_dot_product_attention on " + device.str() + ", " + o.dtype + kv_note(o);
  return w;
}

Workload module_workload(const BenchShape& s, const BenchOptions& o, std::mt19937_64& rng) {
  // SDPA options that the module does not have.
  if (kv_dtype(o) != parse_dtype(o.dtype)) {
    throw UsageError("--kv-dtype: MultiheadAttention projects its keys and values in its own dtype; drop --module or "
                     "--kv-dtype");
  }
  if (s.kv_heads != s.heads) {
    throw UsageError("--kv-heads: MultiheadAttention has no grouped-query attention; drop --module or --kv-heads");
  }
  if (s.dim_v != s.dim) {
    throw UsageError("--dim-v: MultiheadAttention's heads all have width embed_dim / heads; drop --module or --dim-v");
  }
  if (s.causal && s.alignment == CausalAlignment::BottomRight) {
    throw UsageError("--align bottom-right: MultiheadAttention's is_causal is top-left only; drop --module or --align");
  }
  if (s.window_left >= 0 || s.window_right >= 0 || o.alibi || o.sinks || o.softcap > 0) {
    throw UsageError(std::string(o.alibi ? "--alibi" : o.sinks ? "--sinks" : o.softcap > 0 ? "--softcap" : "--window-left/--window-right") +
                     ": MultiheadAttention has no sliding window, ALiBi, sinks or soft-capping (as PyTorch's); drop --module");
  }
  if (o.page_size > 0) throw UsageError("--page-size: MultiheadAttention keeps no cache; drop --module");
  const int64_t embed_dim = s.heads * s.dim;
  const DType dtype = parse_dtype(o.dtype);
  auto attn = std::make_shared<MultiheadAttention>(embed_dim, s.heads,
                                                   MultiheadAttentionOptions{.dropout = o.dropout, .seed = o.seed, .dtype = dtype});
  attn->train(o.dropout > 0);  // dropout acts in training mode only
  Workload w;
  const Tensor query = random_input({s.len_q, s.batch, embed_dim}, rng, dtype, Device::cpu());
  // Equal lengths: self-attention on one tensor, the module's common case. Otherwise the keys and
  // values come from another sequence (cross-attention).
  const Tensor memory =
      s.len_k == s.len_q ? query : random_input({s.len_k, s.batch, embed_dim}, rng, dtype, Device::cpu());
  const ForwardOptions options{.need_weights = o.weights, .is_causal = s.causal};
  w.call = [=] { (void)attn->forward(query, memory, memory, options); };
  // Projections: q (Lq rows), k and v (Lk rows each), the output (Lq rows), each E x E.
  const double projection_flops =
      2.0 * s.batch * (2.0 * s.len_q + 2.0 * s.len_k) * static_cast<double>(embed_dim) * embed_dim;
  w.flops = projection_flops + attention_flops(s.batch, s.heads, s.len_q, s.len_k, s.dim, s.dim, s.causal);
  w.description = "MultiheadAttention.forward (E=" + std::to_string(embed_dim) + ", " + o.dtype + ", projections included)";
  return w;
}

std::string shape_line(const BenchShape& s, const BenchOptions& o) {
  const bool alibi = o.alibi, sinks = o.sinks, weights = o.weights;
  const double dropout = o.dropout;
  std::ostringstream line;
  line << "B=" << s.batch << " Hq=" << s.heads << " Hkv=" << s.kv_heads << " Lq=" << s.len_q << " Lk=" << s.len_k
       << " Dk=" << s.dim << " Dv=" << s.dim_v << ' ';
  if (!s.causal) {
    line << "non-causal";
  } else {
    line << "causal (" << (s.alignment == CausalAlignment::BottomRight ? "bottom-right" : "top-left") << ")";
  }
  if (s.window_left >= 0 || s.window_right >= 0) line << ", window (" << s.window_left << ", " << s.window_right << ")";
  if (alibi) line << ", ALiBi";
  if (sinks) line << ", sinks";
  if (o.softcap > 0) line << ", softcap " << o.softcap;
  if (weights) line << ", with weights";
  if (dropout > 0) line << ", dropout " << dropout;
  return line.str();
}

std::string json_report(const BenchShape& s, const BenchOptions& o, const TimingStats& t, double flops) {
  std::ostringstream j;
  j.precision(7);  // enough for milliseconds to the microsecond
  auto boolean = [](bool b) { return b ? "true" : "false"; };
  j << "{\"shape\": {\"batch\": " << s.batch << ", \"heads\": " << s.heads << ", \"kv_heads\": " << s.kv_heads
    << ", \"len_q\": " << s.len_q << ", \"len_k\": " << s.len_k << ", \"dim\": " << s.dim << ", \"dim_v\": " << s.dim_v
    << ", \"causal\": " << boolean(s.causal) << ", \"align\": \"" << o.align << "\", \"window_left\": " << s.window_left
    << ", \"window_right\": " << s.window_right << ", \"alibi\": " << boolean(o.alibi) << ", \"sinks\": " << boolean(o.sinks)
    << ", \"softcap\": " << o.softcap
    << ", \"page_size\": " << o.page_size << "}"
    << ", \"op\": \"" << (o.module ? "module" : o.backward ? "sdpa_backward" : o.page_size > 0 ? "paged" : "sdpa") << "\", \"weights\": " << boolean(o.weights)
    << ", \"grads\": \"" << (o.backward ? o.grads : "") << "\""
    << ", \"dropout\": " << o.dropout
    << ", \"dtype\": \"" << o.dtype << "\", \"kv_dtype\": \"" << (o.kv_dtype.empty() ? o.dtype : o.kv_dtype)
    << "\", \"device\": \"" << o.device << "\""
    << ", \"threads\": " << get_num_threads() << ", \"isa\": \"" << cpu_isa() << "\", \"reps\": " << o.reps
    << ", \"ms_median\": " << t.median_ms << ", \"ms_min\": " << t.min_ms << ", \"flops\": " << std::fixed
    << std::setprecision(0) << flops << std::defaultfloat << std::setprecision(7)
    << ", \"gflops\": " << gflops_per_second(flops, t.median_ms) << "}";
  return j.str();
}

// Prints "timing N calls of ~X ms" and a dot per call on stderr, but only once the first call
// shows that the whole run will take long enough to need it.
class Progress {
 public:
  explicit Progress(int calls) : calls_(calls) {}
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\n");
  }
  void after_call(double ms) {
    if (done_++ == 0 && ms * calls_ > kQuietMs) {
      shown_ = true;
      std::fprintf(stderr, "timing %d calls of ~%.0f ms ", calls_, ms);
    }
    if (shown_) {
      std::fprintf(stderr, ".");
      std::fflush(stderr);
    }
  }

 private:
  int calls_, done_ = 0;
  bool shown_ = false;
};

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.threads) set_num_threads(*o.threads);
  const BenchShape s = resolve(o);
  std::mt19937_64 rng(o.seed);
  if (o.module && o.device != "cpu") {
    throw UsageError("--module: the module runs on the CPU; drop --device");
  }
  if (o.backward && (o.module || o.weights)) {
    throw UsageError(std::string("--backward: times the SDPA backward alone; drop ") + (o.module ? "--module" : "--weights"));
  }
  if (!o.backward && o.grads != "qkv") throw UsageError("--grads: chooses the backward's gradients; add --backward");
  if (o.backward) (void)wanted_gradients(o.grads);  // a bad --grads is told before the inputs and the forward
  const Workload w = o.module ? module_workload(s, o, rng) : sdpa_workload(s, o, rng);
  if (!o.json) {
    std::printf("shape    %s\n", shape_line(s, o).c_str());
    std::printf("op       %s, ISA %s, threads: %d\n", w.description.c_str(), cpu_isa().c_str(), get_num_threads());
    std::fflush(stdout);  // before the progress display on stderr
  }

  TimingStats t;
  {
    Progress progress(o.warmup + o.reps);
    t = time_repeats(w.call, o.warmup, o.reps, [&](double ms) { progress.after_call(ms); });
  }
  if (o.json) {
    std::printf("%s\n", json_report(s, o, t, w.flops).c_str());
    return 0;
  }
  std::printf("time     %.3f ms median, %.3f ms min (%d reps after %d warm-up)\n", t.median_ms, t.min_ms, o.reps,
              o.warmup);
  std::printf("speed    %.1f GFLOP/s at the median (%.3f GFLOP per call)\n", gflops_per_second(w.flops, t.median_ms),
              w.flops / 1e9);
  return 0;
}

}  // namespace mha::tools
