// The library's worker threads. One pool is created on first use and reused by every call.
#pragma once

#include <string>

namespace mha {

// Threads used by calls that do not set their own count. Default: the MHA_NUM_THREADS environment
// variable if set (anything but a whole number from 1 to 4096 is an mha::Error), else the number
// of hardware threads. set_num_threads(n) with n < 1 is an mha::Error.
void set_num_threads(int n);
int get_num_threads();

// Where the parallel work runs. `pool`: the library's own worker threads (created once, asleep
// when idle); the default. `openmp`: the OpenMP runtime's thread team. A library that also uses
// OpenMP (PyTorch's CPU operators) leaves its threads spinning for a while after each of its
// calls; on a machine without spare cores those spinning threads take cores from our pool and can
// double the time of a short call made right after one of theirs. With `openmp`, both libraries
// use the same team (one OpenMP runtime per process), so its threads pick our work up at once.
// The environment variable MHA_THREADING=pool|openmp sets the default. Results are bit-identical
// either way. Choosing `openmp` in a build without OpenMP is an mha::Error.
enum class Threading { pool, openmp };
void set_threading(Threading threading);
Threading get_threading();
bool openmp_available();

// The instruction set the CPU kernels run with: "amx", "avx512_bf16", "avx512", "avx2" or "portable". Chosen once
// by CPUID; the environment variable MHA_ISA names a lower one to force it (MHA_ISA=avx2); a name
// this CPU cannot run is an mha::Error.
std::string cpu_isa();

// Whether this CPU runs bfloat16 work in bfloat16 products (AVX512-BF16 or AMX, with oneDNN, at
// an ISA of at least avx512): a bfloat16 module then rounds where PyTorch's bf16 module rounds
// (its projections, attention output and each product of its backward). Otherwise it computes in
// float32 on widened copies and rounds its results once.
bool bfloat16_products();

}  // namespace mha
