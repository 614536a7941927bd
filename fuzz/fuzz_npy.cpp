// The .npy reader on arbitrary bytes: it must return or throw mha::Error, nothing else.
#include <cstddef>
#include <cstdint>

#include "mha/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const mha::Tensor t = mha::parse_npy(data, size);
    if (t.numel() > 0 && t.view().data == nullptr) __builtin_trap();
  } catch (const mha::Error&) {
  }
  return 0;
}
