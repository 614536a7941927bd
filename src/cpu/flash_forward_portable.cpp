// The fused forward for any CPU: the same body over 16-float arrays.
#include "cpu/flash_forward.hpp"
#include "cpu/simd_portable.hpp"

namespace mha::detail {
void flash_forward_portable(const AttentionProblem& p, const ForwardOutputs& o) {
  FlashForward<simd::Portable>{p, o}.run();
}
}  // namespace mha::detail
