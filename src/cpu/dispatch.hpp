// The one place that decides which CPU kernel runs. Everything else asks active_isa().
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace mha::detail {

// From the lowest: portable C++ (any CPU), AVX2 + FMA, AVX-512, and AMX, which adds the bfloat16
// kernels on the tile unit (float32 runs on AVX-512 there).
// Each level runs what the one below it runs: avx512_bf16 adds bfloat16 products (vdpbf16ps) to
// AVX-512, amx the tile unit to both.
enum class Isa { portable, avx2, avx512, avx512_bf16, amx };

std::string_view isa_name(Isa isa);
// Every ISA this CPU can run, lowest first (portable is always there).
std::vector<Isa> supported_isas();
// The ISA kernels use now: the override if set, else MHA_ISA from the environment if set, else
// the best supported one.
Isa active_isa();
// For tests: run every later call on `isa` (mha::Error if unsupported); nullopt restores the default.
void force_isa(std::optional<Isa> isa);

}  // namespace mha::detail
