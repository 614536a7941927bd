// The ISA dispatch (cpu/dispatch.cpp): the levels it finds, in order; its CPUID reading against
// the compiler's own (__builtin_cpu_supports); only the portable level off x86; forcing a level
// the CPU lacks is an mha::Error naming it, and the default comes back afterwards.
// (MHA_ISA is read once per process: the command line's test cli.isa_unknown covers a bad value.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "mha/error.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha::detail::Isa;

bool has(const std::vector<Isa>& isas, Isa isa) { return std::find(isas.begin(), isas.end(), isa) != isas.end(); }

TEST(Dispatch, LevelsAscendFromPortable) {
  const std::vector<Isa> isas = mha::detail::supported_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::portable);
  EXPECT_TRUE(std::is_sorted(isas.begin(), isas.end())) << "levels out of order";
  EXPECT_EQ(std::adjacent_find(isas.begin(), isas.end()), isas.end()) << "a level listed twice";
  const char* env = std::getenv("MHA_ISA");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(mha::detail::active_isa(), isas.back());  // the best, unless the environment says otherwise
    EXPECT_EQ(mha::cpu_isa(), std::string(mha::detail::isa_name(isas.back())));
  }
}

TEST(Dispatch, CpuidAgreesWithTheCompiler) {
  const std::vector<Isa> isas = mha::detail::supported_isas();
#if defined(__x86_64__)
  __builtin_cpu_init();
  // (The compiler's answers include the OS's consent to save the wider registers, as ours do.)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(has(isas, Isa::avx2), avx2);
  EXPECT_EQ(has(isas, Isa::avx512), avx512);
  EXPECT_EQ(has(isas, Isa::avx512_bf16), avx512 && __builtin_cpu_supports("avx512bf16"));
  if (has(isas, Isa::amx)) EXPECT_TRUE(has(isas, Isa::avx512_bf16));
#else
  // Off x86 the x86 kernels are not built (x86_kernels_absent.cpp): the portable level alone.
  EXPECT_EQ(isas, std::vector<Isa>{Isa::portable});
#endif
}

TEST(Dispatch, ForcingALevelTheCpuLacksIsAnError) {
  const std::vector<Isa> isas = mha::detail::supported_isas();
  const Isa before = mha::detail::active_isa();
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
    SCOPED_TRACE(std::string(mha::detail::isa_name(isa)));
    if (has(isas, isa)) {
      mha::detail::force_isa(isa);
      EXPECT_EQ(mha::detail::active_isa(), isa);
      EXPECT_EQ(mha::cpu_isa(), std::string(mha::detail::isa_name(isa)));
    } else {
      const Isa now = mha::detail::active_isa();
      mha_test::expect_error([&] { mha::detail::force_isa(isa); },
                             "force_isa: this CPU does not support " + std::string(mha::detail::isa_name(isa)));
      EXPECT_EQ(mha::detail::active_isa(), now);  // unchanged by the refusal
    }
  }
  mha::detail::force_isa(std::nullopt);
  EXPECT_EQ(mha::detail::active_isa(), before);
}

}  // namespace
