// `mha info`: what this build will run with.
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "commands.hpp"
#include "mha/threading.hpp"

namespace mha::tools {

int run_info() {
  std::printf("mha %s\n", MHA_VERSION);
  std::printf("isa       %s\n", mha::cpu_isa().c_str());
  std::printf("threads   %d (hardware threads: %u)\n", mha::get_num_threads(), std::thread::hardware_concurrency());
  for (const char* name : {"MHA_NUM_THREADS", "MHA_ISA"}) {
    const char* value = std::getenv(name);
    std::printf("%-15s %s\n", name, value ? value : "(not set)");
  }
  return 0;
}

}  // namespace mha::tools
