// safetensors and .npy: round trips, and malformed files rejected with mha::Error.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("mha_test_io_" + std::to_string(::getpid()) + "_" + name)).string();
}

mha::Tensor random_tensor(const mha::Shape& shape, std::mt19937_64& rng) { return mha_test::randn(shape, rng); }

void expect_equal(const mha::TensorView& a, const mha::TensorView& b) {
  ASSERT_EQ(a.sizes(), b.sizes());
  const mha::Tensor a64 = mha::Tensor::copy_of(a, mha::DType::f64), b64 = mha::Tensor::copy_of(b, mha::DType::f64);
  for (int64_t i = 0; i < a64.numel(); ++i) ASSERT_EQ(a64.data<double>()[i], b64.data<double>()[i]) << i;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Safetensors, RoundTripWithStridesDtypesAndMetadata) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor a = random_tensor({3, 5}, rng);
  mha::Tensor mask = mha::Tensor::zeros({4}, mha::DType::boolean);
  mask.data<bool>()[1] = true;
  const mha::Tensor half = mha::Tensor::copy_of(a, mha::DType::bf16);
  const mha::Tensor eight = mha::Tensor::copy_of(a, mha::DType::f8e4m3);  // float8 caches, "F8_E4M3"
  const mha::Tensor wide_eight = mha::Tensor::copy_of(a, mha::DType::f8e5m2);  // and "F8_E5M2"
  const std::string path = temp_path("rt.safetensors");
  mha::save_safetensors(path, {{"a_t", a.view().transpose(0, 1)}, {"mask", mask}, {"half", half}, {"eight", eight},
                               {"e5m2", wide_eight}}, {{"num_heads", "4"}});
  EXPECT_NE(bytes_of(path).find("\"dtype\":\"F8_E4M3\""), std::string::npos);
  EXPECT_NE(bytes_of(path).find("\"dtype\":\"F8_E5M2\""), std::string::npos);
  const mha::SafetensorsFile f = mha::load_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 5u);
  expect_equal(f.tensors.at("eight"), eight);
  EXPECT_EQ(f.tensors.at("eight").dtype(), mha::DType::f8e4m3);
  expect_equal(f.tensors.at("e5m2"), wide_eight);
  EXPECT_EQ(f.tensors.at("e5m2").dtype(), mha::DType::f8e5m2);
  expect_equal(f.tensors.at("a_t"), a.view().transpose(0, 1));
  expect_equal(f.tensors.at("mask"), mask);
  expect_equal(f.tensors.at("half"), half);
  EXPECT_EQ(f.tensors.at("half").dtype(), mha::DType::bf16);
  EXPECT_EQ(f.metadata.at("num_heads"), "4");
  std::remove(path.c_str());
}

TEST(Safetensors, MalformedFilesAreErrors) {
  std::mt19937_64 rng(mha_test::test_seed());
  const std::string path = temp_path("good.safetensors");
  mha::save_safetensors(path, {{"w", random_tensor({2, 3}, rng)}});
  const std::string good = bytes_of(path);
  std::remove(path.c_str());
  uint64_t header_len = 0;
  std::memcpy(&header_len, good.data(), 8);
  const std::string header = good.substr(8, header_len);
  auto with_header = [&](std::string h) {
    h.append((8 - h.size() % 8) % 8, ' ');
    std::string out(8, '\0');
    const uint64_t n = h.size();
    std::memcpy(out.data(), &n, 8);
    return out + h + good.substr(8 + header_len);
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"short", good.substr(0, 5)},
      {"huge header length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + good.substr(8)},
      {"truncated data", good.substr(0, good.size() - 4)},
      {"not json", with_header("{\"w\": [")},
      {"not an object", with_header("[1, 2]")},
      {"bad dtype", with_header(R"({"w":{"dtype":"I8","shape":[2,3],"data_offsets":[0,6]}})")},
      {"negative size", with_header(R"({"w":{"dtype":"F32","shape":[-2,3],"data_offsets":[0,24]}})")},
      {"size mismatch", with_header(R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,24]}})")},
      {"offsets past end", with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]}})")},
      {"reversed offsets", with_header(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})")},
      {"overflowing shape", with_header(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,24]}})")},
      {"overlap", with_header(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})")},
      {"missing field", with_header(R"({"w":{"dtype":"F32","shape":[2,3]}})")},
      {"metadata not strings", with_header(R"({"__metadata__":{"a":1}})")},
  };
  for (const auto& [what, bytes] : cases) {
    EXPECT_THROW(mha::parse_safetensors(bytes.data(), bytes.size()), mha::Error) << what;
  }
  EXPECT_NO_THROW(mha::parse_safetensors(good.data(), good.size()));
  (void)header;
  EXPECT_THROW(mha::load_safetensors(temp_path("does_not_exist.safetensors")), mha::Error);
}

TEST(Npy, RoundTripAndFortranOrder) {
  std::mt19937_64 rng(mha_test::test_seed());
  const mha::Tensor a = random_tensor({2, 3, 4}, rng);
  const std::string path = temp_path("a.npy");
  mha::save_npy(path, a.view().transpose(0, 2));  // strided input, stored C-contiguous
  expect_equal(mha::load_npy(path), a.view().transpose(0, 2));
  // A Fortran-ordered file: the same bytes as the C-ordered transpose.
  std::string bytes = bytes_of(path);
  const size_t pos = bytes.find("False");
  bytes.replace(pos, 5, "True ");
  const size_t shape_pos = bytes.find("(4, 3, 2)");
  ASSERT_NE(shape_pos, std::string::npos);
  bytes.replace(shape_pos, 9, "(2, 3, 4)");
  expect_equal(mha::parse_npy(bytes.data(), bytes.size()), a);
  std::remove(path.c_str());
}

TEST(Npy, MalformedFilesAreErrors) {
  std::mt19937_64 rng(mha_test::test_seed());
  const std::string path = temp_path("m.npy");
  mha::save_npy(path, random_tensor({3, 2}, rng));
  const std::string good = bytes_of(path);
  std::remove(path.c_str());
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string b = good;
    b.replace(b.find(from), from.size(), to);
    return b;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"short", good.substr(0, 8)},
      {"bad magic", "\x93NUMPZ" + good.substr(6)},
      {"bad version", replace(std::string("NUMPY\x01", 6), std::string("NUMPY\x07", 6))},
      {"bad dtype", replace("<f4", "<i8")},
      {"truncated", good.substr(0, good.size() - 1)},
      {"bigger shape", replace("(3, 2)", "(3, 9)")},
      {"overflowing shape", replace("(3, 2)", "(99999999999999999999, 2)")},
      {"no shape", replace("'shape'", "'shope'")},
  };
  for (const auto& [what, bytes] : cases) {
    EXPECT_THROW(mha::parse_npy(bytes.data(), bytes.size()), mha::Error) << what;
  }
}

TEST(ModuleFromStateDict, ReadsOptionsOffNamesAndShapes) {
  mha::MultiheadAttention src(12, 3, {.bias = true, .add_bias_kv = true, .kdim = 5, .vdim = 7, .seed = 9});
  mha::TensorMap state;
  for (const auto& [name, t] : src.named_parameters()) state.emplace(name, t);
  const mha::MultiheadAttention m = mha::module_from_state_dict(state, 3);
  EXPECT_EQ(m.embed_dim(), 12);
  EXPECT_EQ(m.kdim(), 5);
  EXPECT_EQ(m.vdim(), 7);
  EXPECT_TRUE(m.options().add_bias_kv);
  for (const auto& [name, t] : src.named_parameters()) expect_equal(m.parameter(name), t);
  state.erase("out_proj.weight");
  EXPECT_THROW(mha::module_from_state_dict(state, 3), mha::Error);
}

}  // namespace
