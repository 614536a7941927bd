// .npy: "\x93NUMPY", version (major, minor), header length (u16 for 1.x, u32 for 2.x/3.x), then a
// Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with
// spaces and a newline, then the data.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "io/file_bytes.hpp"
#include "mha/io.hpp"

namespace mha {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

// The text after `'key':` in the header dict, or an Error.
size_t find_value(const std::string& header, const std::string& key) {
  const std::string quoted[] = {"'" + key + "'", "\"" + key + "\""};
  for (const auto& q : quoted) {
    size_t pos = header.find(q);
    if (pos == std::string::npos) continue;
    pos = header.find(':', pos + q.size());
    if (pos == std::string::npos) break;
    ++pos;
    while (pos < header.size() && std::isspace(static_cast<unsigned char>(header[pos]))) ++pos;
    return pos;
  }
  throw Error("npy: header has no '" + key + "' entry");
}

DType parse_descr(const std::string& header) {
  size_t pos = find_value(header, "descr");
  if (pos >= header.size() || (header[pos] != '\'' && header[pos] != '"')) throw Error("npy: 'descr' is not a string");
  const char quote = header[pos];
  const size_t end = header.find(quote, pos + 1);
  if (end == std::string::npos) throw Error("npy: unterminated 'descr'");
  const std::string d = header.substr(pos + 1, end - pos - 1);
  if (d == "<f4") return DType::f32;
  if (d == "<f8") return DType::f64;
  if (d == "<f2") return DType::f16;
  if (d == "|b1") return DType::boolean;
  throw Error("npy: dtype '" + d + "' is not supported (expected <f4, <f8, <f2 or |b1)");
}

bool parse_fortran(const std::string& header) {
  const size_t pos = find_value(header, "fortran_order");
  if (header.compare(pos, 4, "True") == 0) return true;
  if (header.compare(pos, 5, "False") == 0) return false;
  throw Error("npy: 'fortran_order' is neither True nor False");
}

Shape parse_shape(const std::string& header) {
  size_t pos = find_value(header, "shape");
  if (pos >= header.size() || header[pos] != '(') throw Error("npy: 'shape' is not a tuple");
  const size_t end = header.find(')', pos);
  if (end == std::string::npos) throw Error("npy: unterminated 'shape'");
  Shape shape;
  size_t i = pos + 1;
  while (i < end) {
    while (i < end && (std::isspace(static_cast<unsigned char>(header[i])) || header[i] == ',')) ++i;
    if (i >= end) break;
    if (!std::isdigit(static_cast<unsigned char>(header[i]))) throw Error("npy: 'shape' holds something other than sizes");
    int64_t v = 0;
    while (i < end && std::isdigit(static_cast<unsigned char>(header[i]))) {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, header[i] - '0', &v)) {
        throw Error("npy: a size in 'shape' overflows");
      }
      ++i;
    }
    shape.push_back(v);
    if (shape.size() > static_cast<size_t>(kMaxDims)) throw Error("npy: more than " + std::to_string(kMaxDims) + " dimensions");
  }
  return shape;
}

}  // namespace

Tensor parse_npy(const void* data, size_t size) {
  const auto* b = static_cast<const unsigned char*>(data);
  if (size < 10 || std::memcmp(b, kMagic, 6) != 0) throw Error("npy: not a .npy file (bad magic)");
  const unsigned major = b[6];
  size_t header_len, header_start;
  if (major == 1) {
    header_len = b[8] | (static_cast<size_t>(b[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) throw Error("npy: file too short for a version 2 header");
    header_len = b[8] | (static_cast<size_t>(b[9]) << 8) | (static_cast<size_t>(b[10]) << 16) |
                 (static_cast<size_t>(b[11]) << 24);
    header_start = 12;
  } else {
    throw Error("npy: unsupported version " + std::to_string(major));
  }
  if (header_len > size - header_start) throw Error("npy: header length exceeds the file");
  const std::string header(reinterpret_cast<const char*>(b + header_start), header_len);
  const DType dtype = parse_descr(header);
  const bool fortran = parse_fortran(header);
  const Shape shape = parse_shape(header);
  const int64_t numel = checked_numel(shape, "npy shape");
  int64_t nbytes;
  if (__builtin_mul_overflow(numel, dtype_size(dtype), &nbytes)) throw Error("npy: byte count overflows");
  const size_t data_start = header_start + header_len;
  if (static_cast<uint64_t>(nbytes) > size - data_start) {
    throw Error("npy: shape " + TensorView(nullptr, dtype, shape).shape_str() + " needs " + std::to_string(nbytes) +
                " bytes, the file has " + std::to_string(size - data_start));
  }
  // Fortran order is the transpose's C order: read it as such and copy to C order.
  Shape stored = shape;
  if (fortran) std::reverse(stored.begin(), stored.end());
  Tensor raw = Tensor::empty(stored, dtype);
  if (nbytes > 0) std::memcpy(raw.view().data, b + data_start, static_cast<size_t>(nbytes));
  if (dtype == DType::boolean) {
    const auto* v = static_cast<const unsigned char*>(raw.view().data);
    for (int64_t i = 0; i < numel; ++i)
      if (v[i] > 1) throw Error("npy: a bool byte other than 0 or 1");
  }
  if (!fortran || shape.size() < 2) return raw;  // one dimension: both orders are the same
  std::vector<int> order(shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(order.size() - 1 - i);
  return Tensor::copy_of(raw.view().permute(order));
}

Tensor load_npy(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path, "npy");
  return parse_npy(bytes.data(), bytes.size());
}

void save_npy(const std::string& path, const TensorView& tensor) {
  const char* descr = nullptr;
  switch (tensor.dtype) {
    case DType::f32: descr = "<f4"; break;
    case DType::f64: descr = "<f8"; break;
    case DType::f16: descr = "<f2"; break;
    case DType::boolean: descr = "|b1"; break;
    case DType::bf16: throw Error("save_npy: numpy has no bfloat16; convert to float32 first");
    case DType::f8e4m3: throw Error("save_npy: numpy has no float8_e4m3fn; convert to float32 first");
    case DType::f8e5m2: throw Error("save_npy: numpy has no float8_e5m2; convert to float32 first");
  }
  if (tensor.numel() > 0 && tensor.data == nullptr) throw Error("save_npy: null data");
  std::string shape = "(";
  for (int d = 0; d < tensor.ndim; ++d) shape += std::to_string(tensor.shape[d]) + (tensor.ndim == 1 || d + 1 < tensor.ndim ? ", " : "");
  shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');  // data aligned to 64 bytes
  header += '\n';
  const Tensor c = Tensor::copy_of(tensor);
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error("save_npy: cannot open '" + path + "' for writing");
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const unsigned char len[2] = {static_cast<unsigned char>(header.size() & 0xff), static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(len), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(c.view().data), static_cast<std::streamsize>(c.numel() * dtype_size(c.dtype())));
  if (!out) throw Error("save_npy: writing '" + path + "' failed");
}

}  // namespace mha
