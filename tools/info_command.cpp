// `mha info`: what this build will run with.
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "commands.hpp"
#include "mha/cuda.hpp"
#include "mha/threading.hpp"

namespace mha::tools {

int run_info() {
  std::printf("mha %s\n", MHA_VERSION);
  std::printf("isa       %s\n", mha::cpu_isa().c_str());
  std::printf("threads   %d (hardware threads: %u)\n", mha::get_num_threads(), std::thread::hardware_concurrency());
  // The CUDA backend: whether it is built, and each device with the kernels it runs by
  // default (the wgmma one at head dim 128 without masks on compute capability 9.0).
  if (!mha::cuda::is_built()) {
    std::printf("cuda      not built\n");
  } else if (mha::cuda::device_count() == 0) {
    std::printf("cuda      built, no device\n");
  } else {
    for (int d = 0; d < mha::cuda::device_count(); ++d) {
      std::printf("cuda:%-5d %s; forward: %s; backward: mma.sync, deterministic\n", d, mha::cuda::describe(d).c_str(),
                  mha::cuda::compute_capability(d) == 90 ? "wgmma at d=128 without masks, else mma.sync" : "mma.sync");
    }
  }
  for (const char* name : {"MHA_NUM_THREADS", "MHA_ISA", "MHA_CUDA_KERNEL", "MHA_CUDA_BACKWARD_TILE"}) {
    const char* value = std::getenv(name);
    std::printf("%-23s %s\n", name, value ? value : "(not set)");
  }
  return 0;
}

}  // namespace mha::tools
