// Whole-file reads for the tensor formats.
#pragma once

#include <string>
#include <vector>

namespace mha::detail {
// The bytes of `path`; mha::Error naming `format` and the path if it cannot be read.
std::vector<char> read_file_bytes(const std::string& path, const std::string& format);
}  // namespace mha::detail
