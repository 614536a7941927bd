// Compiling a kernel file for an instruction set without compiling the rest of the program for it.
//
// A kernel file (*_avx2.cpp, *_avx512.cpp, *_avx512bf16.cpp, *_amx.cpp) is compiled with the
// baseline flags, like every other file, and opens a region in which each function it defines
// is compiled for its instruction set:
//
//   #include "cpu/kernel_prelude.hpp"   // the standard library and the rest of mha: baseline
//   #include "cpu/isa_region.hpp"
//   MHA_ISA_BEGIN(MHA_ISA_AVX2)
//   #include "cpu/flash_forward.hpp"    // kernel templates and the SIMD layer: AVX2 + FMA
//   ...
//   MHA_ISA_END
//
// Why not -mavx2 on the file: an inline function or template instantiation the file shares with
// others (std::vector's growth, a destructor) is one symbol to the linker, which keeps one copy
// for all callers; an AVX2 copy kept for baseline callers dies of SIGILL on a CPU without AVX2,
// and which copy is kept depends on the order in which the user's link pulls members from
// libmha.a. Functions declared before the region (the prelude's) keep the baseline target, and
// so do their instantiations made inside it; the region's own functions inline them as usual.
// Highway compiles its per-target code the same way.
//
// GCC's `#pragma GCC target` and clang's `#pragma clang attribute` both apply to templates
// declared in the region (instantiated later) and to lambdas. Headers read for the first time
// inside a region are compiled for its target: everything that is not kernel code must come in
// through kernel_prelude.hpp (tests/check_isa_copies.py, a CTest, finds copies that slipped).
#pragma once

#define MHA_ISA_PRAGMA_(x) _Pragma(#x)
#define MHA_ISA_PRAGMA(x) MHA_ISA_PRAGMA_(x)

// The target lists, one per kernel file suffix (the same features as each -m flag set used to be).
#define MHA_ISA_AVX2 "avx2,fma,f16c"
#define MHA_ISA_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,fma,bmi2"
#define MHA_ISA_AVX512BF16 "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2"
#define MHA_ISA_AMX "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2,amx-tile,amx-bf16"

#if defined(__clang__)
#define MHA_ISA_BEGIN(targets) \
  MHA_ISA_PRAGMA(clang attribute push(__attribute__((target(targets))), apply_to = function))
#define MHA_ISA_END _Pragma("clang attribute pop")
#elif defined(__GNUC__)
#define MHA_ISA_BEGIN(targets) _Pragma("GCC push_options") MHA_ISA_PRAGMA(GCC target(targets))
#define MHA_ISA_END _Pragma("GCC pop_options")
#else
#error "the x86 kernel files need GCC or clang (per-function target attributes)"
#endif
