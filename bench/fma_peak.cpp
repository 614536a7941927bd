// The machine's float32 FMA ceiling: every thread runs independent chains of vector FMAs (enough
// of them to cover the FMA latency on every port), nothing else, and the best of several runs is
// reported in GFLOP/s (2 flops per lane per FMA). bench/compare.py divides by it. With --bf16-dot,
// the same for AVX512-BF16's bfloat16 pair products (vdpbf16ps: 4 flops per lane), the ceiling
// of the bfloat16 kernels on CPUs that have them but no AMX.
//
//   fma_peak [--threads N]              prints: fma_peak_gflops <value> isa <avx512|avx2|scalar> threads <N>
//   fma_peak --bf16-dot [--threads N]   prints: bf16_dot_peak_gflops <value> threads <N> (0 without AVX512-BF16)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr long kIterations = 20'000'000;  // per thread; about 0.1 s at 3 GHz

// 12 chains: 2 FMA ports x 4-5 cycles of latency, with room to spare. The sum at the end keeps
// the compiler from removing the loop. Returns FMAs per lane performed.
__attribute__((target("avx512f"))) float chains_avx512(float seed) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < kIterations; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// The same for bfloat16 pair products: 16 lanes x 2 products x 2 flops per instruction, 16
// chains (their latency is longer: on Zen 5, 12 chains reached 960-975 GFLOP/s on 2 cores and 16
// reached 1050-1060; 20 spilled). The loop's trip count is scaled so the work matches 12 chains'.
__attribute__((target("avx512f,avx512bf16"))) float chains_bf16_dot(float seed) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f));
  for (long it = 0; it < kIterations * 12 / kChains; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) float chains_avx2(float seed) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(seed + static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < kIterations; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, s);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

float chains_scalar(float seed) {
  float acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = seed + static_cast<float>(i);
  for (long it = 0; it < kIterations / 8; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  float total = 0;
  for (float x : acc) total += x;
  return total;
}

// The best of 5 runs of `chains` on every thread at once, in GFLOP/s, where one call performs
// `flops` floating-point operations.
template <class Chains>
double best_rate(int threads, Chains chains, double flops) {
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> results(threads);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { results[t] = chains(static_cast<float>(t + rep)); });
    for (auto& th : pool) th.join();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (float r : results) sink = sink + r;
    best = std::max(best, flops * threads / seconds / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  bool bf16_dot = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--bf16-dot") == 0) bf16_dot = true;
  }
  if (bf16_dot) {
    if (!__builtin_cpu_supports("avx512bf16")) {
      std::printf("bf16_dot_peak_gflops 0 threads %d\n", threads);
      return 0;
    }
    const double best = best_rate(threads, chains_bf16_dot, 4.0 * 12 * 16 * static_cast<double>(kIterations));
    std::printf("bf16_dot_peak_gflops %.1f threads %d\n", best, threads);
    return 0;
  }
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const int lanes = avx512 ? 16 : avx2 ? 8 : 1;
  const long iterations = avx512 || avx2 ? kIterations : kIterations / 8;
  auto run = [&](float seed) {
    return avx512 ? chains_avx512(seed) : avx2 ? chains_avx2(seed) : chains_scalar(seed);
  };
  const double best = best_rate(threads, run, 2.0 * 12 * lanes * static_cast<double>(iterations));
  std::printf("fma_peak_gflops %.1f isa %s threads %d\n", best, avx512 ? "avx512" : avx2 ? "avx2" : "scalar", threads);
  return 0;
}
