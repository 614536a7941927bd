#include "io/file_bytes.hpp"

#include <fstream>

#include "mha/error.hpp"

namespace mha::detail {

std::vector<char> read_file_bytes(const std::string& path, const std::string& format) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(format + ": cannot open '" + path + "'");
  const std::streamoff size = in.tellg();
  if (size < 0) throw Error(format + ": cannot read the size of '" + path + "'");
  std::vector<char> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(bytes.data(), size)) throw Error(format + ": cannot read '" + path + "'");
  return bytes;
}

}  // namespace mha::detail
