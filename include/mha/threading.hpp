// The library's worker threads. One pool is created on first use and reused by every call.
#pragma once

#include <string>

namespace mha {

// Threads used by calls that do not set their own count. Default: the MHA_NUM_THREADS environment
// variable if set, else the number of hardware threads. Values < 1 are an mha::Error.
void set_num_threads(int n);
int get_num_threads();

// The instruction set the CPU kernels run with: "avx512" or "portable". Chosen once by CPUID;
// the environment variable MHA_ISA=portable forces the portable path.
std::string cpu_isa();

}  // namespace mha
