// safetensors: [u64 little-endian header length N][N bytes of JSON][tensor bytes]. The JSON maps
// names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the tensor bytes), plus
// an optional "__metadata__" map of strings.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "io/file_bytes.hpp"
#include "mha/io.hpp"

namespace mha {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // as the reference implementation limits it

DType parse_dtype(const std::string& s, const std::string& name) {
  if (s == "F32") return DType::f32;
  if (s == "F64") return DType::f64;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "F8_E4M3") return DType::f8e4m3;
  if (s == "F8_E5M2") return DType::f8e5m2;
  if (s == "BOOL") return DType::boolean;
  throw Error("safetensors: tensor '" + name + "' has dtype '" + s +
              "'; supported are F32, F64, BF16, F16, F8_E4M3, F8_E5M2 and BOOL");
}

const char* dtype_code(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f8e4m3: return "F8_E4M3";
    case DType::f8e5m2: return "F8_E5M2";
    case DType::boolean: return "BOOL";
  }
  return "?";
}

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

SafetensorsFile parse_safetensors(const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 8) throw Error("safetensors: file of " + std::to_string(size) + " bytes is too short for a header");
  const uint64_t header_len = read_u64_le(bytes);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    throw Error("safetensors: header length " + std::to_string(header_len) + " exceeds the file (" +
                std::to_string(size) + " bytes) or the 100 MiB limit");
  }
  const unsigned char* payload = bytes + 8 + header_len;
  const uint64_t payload_len = size - 8 - header_len;

  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    throw Error(std::string("safetensors: header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) throw Error("safetensors: header must be a JSON object");

  SafetensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) throw Error("safetensors: __metadata__ must be an object of strings");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) throw Error("safetensors: __metadata__ value of '" + m.key() + "' is not a string");
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
      throw Error("safetensors: tensor '" + name + "' needs dtype, shape and data_offsets");
    }
    const json& dt = entry["dtype"];
    const json& shape_json = entry["shape"];
    const json& offsets = entry["data_offsets"];
    if (!dt.is_string()) throw Error("safetensors: tensor '" + name + "' dtype is not a string");
    const DType dtype = parse_dtype(dt.get<std::string>(), name);
    if (!shape_json.is_array() || shape_json.size() > static_cast<size_t>(kMaxDims)) {
      throw Error("safetensors: tensor '" + name + "' shape must be an array of at most " + std::to_string(kMaxDims) +
                  " sizes");
    }
    Shape shape;
    for (const json& s : shape_json) {
      if (!s.is_number_unsigned()) throw Error("safetensors: tensor '" + name + "' has a size that is not a non-negative integer");
      const uint64_t v = s.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) throw Error("safetensors: tensor '" + name + "' size overflows");
      shape.push_back(static_cast<int64_t>(v));
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      throw Error("safetensors: tensor '" + name + "' data_offsets must be [begin, end]");
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    const int64_t numel = checked_numel(shape, "safetensors: tensor '" + name + "'");
    int64_t nbytes;
    if (__builtin_mul_overflow(numel, dtype_size(dtype), &nbytes)) {
      throw Error("safetensors: tensor '" + name + "' byte count overflows");
    }
    if (begin > end || end > payload_len || end - begin != static_cast<uint64_t>(nbytes)) {
      throw Error("safetensors: tensor '" + name + "' data_offsets [" + std::to_string(begin) + ", " +
                  std::to_string(end) + ") do not hold " + std::to_string(nbytes) + " bytes within the " +
                  std::to_string(payload_len) + " bytes of data");
    }
    ranges.emplace_back(begin, end);
    Tensor t = Tensor::empty(shape, dtype);
    if (nbytes > 0) std::memcpy(t.view().data, payload + begin, static_cast<size_t>(nbytes));
    if (dtype == DType::boolean) {  // only 0 and 1 are valid bool bytes
      const auto* b = static_cast<const unsigned char*>(t.view().data);
      for (int64_t i = 0; i < numel; ++i)
        if (b[i] > 1) throw Error("safetensors: tensor '" + name + "' holds a bool byte other than 0 or 1");
    }
    file.tensors.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) throw Error("safetensors: tensors' data ranges overlap");
  }
  return file;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path, "safetensors");
  return parse_safetensors(bytes.data(), bytes.size());
}

void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> contiguous;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    if (name == "__metadata__") throw Error("save_safetensors: '__metadata__' is not a valid tensor name");
    if (view.numel() > 0 && view.data == nullptr) throw Error("save_safetensors: tensor '" + name + "' has null data");
    contiguous.push_back(Tensor::copy_of(view));
    const uint64_t nbytes = static_cast<uint64_t>(view.numel() * dtype_size(view.dtype));
    header[name] = {{"dtype", dtype_code(view.dtype)}, {"shape", view.sizes()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned, as the format suggests
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error("save_safetensors: cannot open '" + path + "' for writing");
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const Tensor& t : contiguous) {
    out.write(static_cast<const char*>(t.view().data), static_cast<std::streamsize>(t.numel() * dtype_size(t.dtype())));
  }
  if (!out) throw Error("save_safetensors: writing '" + path + "' failed");
}

std::unordered_map<std::string, TensorView> views_of(const TensorMap& tensors) {
  std::unordered_map<std::string, TensorView> v;
  for (const auto& [name, t] : tensors) v.emplace(name, t.view());
  return v;
}

}  // namespace mha
