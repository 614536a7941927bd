#include "demo_timing.hpp"

#include <cstdio>
#include <random>

#include "mha/reference.hpp"
#include "mha/sdpa.hpp"
#include "mha/threading.hpp"
#include "random_tensor.hpp"
#include "timing.hpp"

namespace mha::tools {
namespace {

constexpr int kBatch = 1, kHeads = 4, kDim = 64;
constexpr int kLengths[] = {128, 512, 1024, 2048};
// Above this predicted time one reference call is not worth waiting for.
constexpr double kReferenceBudgetMs = 3000;

}  // namespace

void print_timing_table(uint64_t seed) {
  std::printf("      scaled_dot_product_attention, B=%d H=%d d=%d, non-causal, threads: %d; median of repeats\n",
              kBatch, kHeads, kDim, get_num_threads());
  std::printf("      fused: float32 flash-style kernel; reference: naive float64, full score matrix\n\n");
  std::printf("      %6s  %10s  %9s  %13s  %8s\n", "L", "fused ms", "GFLOP/s", "reference ms", "speedup");
  std::mt19937_64 rng(seed + 10);
  double last_reference_ms = 0;
  int last_reference_len = 0;
  for (const int len : kLengths) {
    const Tensor q = random_normal({kBatch, kHeads, len, kDim}, rng);
    const Tensor k = random_normal({kBatch, kHeads, len, kDim}, rng);
    const Tensor v = random_normal({kBatch, kHeads, len, kDim}, rng);
    const double flops = attention_flops(kBatch, kHeads, len, len, kDim, kDim, /*causal=*/false);
    const TimingStats fused = time_repeats([&] { (void)scaled_dot_product_attention(q, k, v); }, 2, 7);
    std::printf("      %6d  %10.3f  %9.1f  ", len, fused.median_ms, gflops_per_second(flops, fused.median_ms));
    std::fflush(stdout);  // the reference may take a while; show the fused numbers first

    // The reference's cost grows as L^2: predict it from the previous row.
    const double ratio = last_reference_len ? static_cast<double>(len) / last_reference_len : 0;
    const double predicted_ms = last_reference_ms * ratio * ratio;
    if (predicted_ms > kReferenceBudgetMs) {
      std::printf("%13s  %8s\n", "(skipped)", "-");
      continue;
    }
    const int reps = predicted_ms < 300 ? 3 : 1;
    const TimingStats ref = time_repeats([&] { (void)reference::scaled_dot_product_attention(q, k, v); }, 0, reps);
    std::printf("%13.1f  %7.0fx\n", ref.median_ms, ref.median_ms / fused.median_ms);
    last_reference_ms = ref.median_ms;
    last_reference_len = len;
  }
}

}  // namespace mha::tools
