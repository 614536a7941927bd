#include "cpu/dispatch.hpp"

#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"

#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#include <string>

#include "mha/error.hpp"
#include "mha/threading.hpp"

namespace mha::detail {
namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const bool osxsave = ecx & (1u << 27);
  const bool fma = ecx & (1u << 12);
  if (!osxsave || !fma) return false;
  // The OS must save ZMM state: XCR0 bits 1, 2 (SSE, AVX) and 5, 6, 7 (opmask, ZMM).
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0xe6u) != 0xe6u) return false;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool f = ebx & (1u << 16), dq = ebx & (1u << 17), bw = ebx & (1u << 30), vl = ebx & (1u << 31);
  const bool bmi2 = ebx & (1u << 8);
  return f && dq && bw && vl && bmi2;
#else
  return false;
#endif
}

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  // F16C (half-precision conversions) came with AVX2 on every x86 CPU that has both; checked anyway.
  const bool osxsave = ecx & (1u << 27), fma = ecx & (1u << 12), f16c = ecx & (1u << 29);
  if (!osxsave || !fma || !f16c) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0x6u) != 0x6u) return false;  // the OS saves XMM and YMM state
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (ebx & (1u << 5));
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
#else
  return false;
#endif
}

bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  return amx_bf16 && amx_tile && cpu_has_avx512_bf16();
#else
  return false;
#endif
}

// Linux hands out the 8 KiB tile state only on request (XFEATURE_XTILEDATA = 18).
bool request_amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

Isa from_environment(Isa best) {
  const char* env = std::getenv("MHA_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string want(env);
  for (Isa isa : supported_isas()) {
    if (isa_name(isa) == want) return isa;
  }
  std::string names;
  for (Isa isa : supported_isas()) names += (names.empty() ? "" : ", ") + std::string(isa_name(isa));
  throw Error("MHA_ISA: '" + want + "' is not an instruction set this CPU runs (supported: " + names + ")");
}

// -1: no override; otherwise the forced Isa's value.
std::atomic<int> g_forced{-1};

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx: return "amx";
  }
  return "?";
}

std::vector<Isa> supported_isas() {
  static const std::vector<Isa> isas = [] {
    std::vector<Isa> v{Isa::portable};
    if (cpu_has_avx2_fma()) v.push_back(Isa::avx2);
    if (cpu_has_avx512()) v.push_back(Isa::avx512);
    if (cpu_has_avx512() && cpu_has_avx512_bf16()) v.push_back(Isa::avx512_bf16);
    if (cpu_has_avx512() && cpu_has_amx_bf16() && request_amx_permission()) v.push_back(Isa::amx);
    return v;
  }();
  return isas;
}

Isa active_isa() {
  const int forced = g_forced.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<Isa>(forced);
  static const Isa chosen = from_environment(supported_isas().back());  // an Error here repeats on every call
  return chosen;
}

void force_isa(std::optional<Isa> isa) {
  if (!isa) {
    g_forced.store(-1);
    return;
  }
  for (Isa s : supported_isas()) {
    if (s == *isa) {
      g_forced.store(static_cast<int>(*isa));
      return;
    }
  }
  throw Error("force_isa: this CPU does not support " + std::string(isa_name(*isa)));
}

bool amx_usable() { return active_isa() == Isa::amx; }

bool amx_bf16_takes_shape(int64_t len_q, int64_t len_k, int64_t dim_qk, int64_t dim_v) {
  // Decoding (up to 4 queries per head) reads the cache once per key/value head in the decoding
  // kernel; the tile unit's kernel reads it once per query head, a few rows of its 32-query tiles
  // used. From 5 queries on, the tile unit (a throughput many times the FMA units') is kept.
  // Head dims from 16 up: the kernel pads them to the tile's depth of 32 (at most half the products
  // wasted); narrower ones take the float32 kernel.
  return dim_qk >= 16 && dim_v >= 16 && len_q > kFewQueriesPerHeadAmx && len_k > 0 && len_q <= (int64_t{1} << 30) &&
         len_k <= (int64_t{1} << 30);
}

bool amx_bf16_supports(const AttentionProblem& p) {
  const TensorView* views[] = {&p.q, &p.k, &p.v};
  for (const TensorView* t : views) {
    if (t->dtype != DType::bf16 || (t->strides[3] != 1 && t->shape[3] > 1)) return false;
  }
  // Soft-capped scores are formed by the float32 kernels only (the tile unit's would need a pass of its own).
  return p.softcap == 0 && amx_bf16_takes_shape(p.len_q, p.len_k, p.dim_qk, p.dim_v) && p.dropout_p < 1.0;
}

bool bf16_pairs_supports(const AttentionProblem& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 && p.dim_qk % 2 == 0;
}

bool bf16_pairs_take_shape(int64_t len_q, int64_t dim_qk) {
  return dim_qk % 2 == 0 && len_q > kFewQueriesPerHead;
}

bool bf16_pairs_backward_takes(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  return bf16_pairs_supports(p) && in.grad_out_dtype == DType::bf16 && p.dim_v % 2 == 0 && out.dscores == nullptr &&
         p.heads_kv > 0 && p.heads_q / p.heads_kv * p.len_q > kFewQueryRowsBackward;
}

bool amx_bf16_backward_supports(const AttentionProblem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  return amx_usable() && amx_bf16_supports(p) && in.grad_out_dtype == DType::bf16 &&
         (out.grad_dtype == DType::bf16 || out.grad_dtype == DType::f32) &&
         out.dscores == nullptr && p.key_pages == nullptr && p.heads_kv > 0;
}

}  // namespace mha::detail

namespace mha {
std::string cpu_isa() { return std::string(detail::isa_name(detail::active_isa())); }
}  // namespace mha
