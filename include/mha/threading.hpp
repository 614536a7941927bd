// The library's worker threads. One pool is created on first use and reused by every call.
#pragma once

#include <string>

namespace mha {

// Threads used by calls that do not set their own count. Default: the MHA_NUM_THREADS environment
// variable if set (anything but a whole number from 1 to 4096 is an mha::Error), else the number
// of hardware threads. set_num_threads(n) with n < 1 is an mha::Error.
void set_num_threads(int n);
int get_num_threads();

// The instruction set the CPU kernels run with: "amx", "avx512", "avx2" or "portable". Chosen once
// by CPUID; the environment variable MHA_ISA names a lower one to force it (MHA_ISA=avx2); a name
// this CPU cannot run is an mha::Error.
std::string cpu_isa();

}  // namespace mha
