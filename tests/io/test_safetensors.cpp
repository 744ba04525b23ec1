// Safetensors read (mmap, zero-copy views) and write: bit-exact round trips for every dtype, and
// clear errors for corrupt files.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "io/io_testing.h"
#include "lt2/io/checkpoint.h"
#include "lt2/io/safetensors.h"
#include "lt2/util/json.h"

using namespace lt2;
using lt2::testing::expect_error;
using lt2::testing::raw_safetensors;
using lt2::testing::TempDir;

namespace {

const std::vector<std::pair<std::string, torch::ScalarType>> kDtypes = {
    {"F64", torch::kFloat64}, {"F32", torch::kFloat32},   {"F16", torch::kFloat16},
    {"BF16", torch::kBFloat16}, {"F8_E4M3", torch::kFloat8_e4m3fn}, {"F8_E5M2", torch::kFloat8_e5m2},
    {"I64", torch::kInt64},   {"I32", torch::kInt32},     {"I16", torch::kInt16},
    {"I8", torch::kInt8},     {"U64", torch::kUInt64},    {"U32", torch::kUInt32},
    {"U16", torch::kUInt16},  {"U8", torch::kUInt8},      {"BOOL", torch::kBool}};

// A [rows, cols] tensor of `dtype` with random bits (bools 0/1), so any bit-level change shows.
torch::Tensor random_bits(torch::ScalarType dtype, int64_t rows, int64_t cols) {
  const int64_t es = c10::elementSize(dtype);
  if (dtype == torch::kBool) return torch::randint(0, 2, {rows, cols}, torch::kUInt8).to(torch::kBool);
  return torch::randint(0, 256, {rows, cols * es}, torch::kUInt8).view(dtype);
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ab = a.contiguous().flatten().view(torch::kUInt8), bb = b.contiguous().flatten().view(torch::kUInt8);
  return torch::equal(ab, bb);
}

}  // namespace

TEST(Safetensors, DtypeNames) {
  for (const auto& [name, t] : kDtypes) {
    EXPECT_EQ(safetensors_dtype(name), t);
    EXPECT_EQ(safetensors_dtype_name(t), name);
  }
  expect_error([] { safetensors_dtype("F4"); }, {"unknown dtype \"F4\"", "BF16"});
  expect_error([] { safetensors_dtype_name(torch::kComplexFloat); }, {"no safetensors equivalent"});
}

TEST(Safetensors, RoundTripEveryDtypeBitExact) {
  TempDir dir;
  torch::manual_seed(3);
  TensorMap tensors;
  for (const auto& [name, t] : kDtypes) tensors["t_" + name] = random_bits(t, 3, 5);
  tensors["scalar"] = torch::tensor(2.5, torch::kFloat64);                    // 0-dim
  tensors["empty"] = torch::empty({0, 4}, torch::kFloat32);                   // no bytes
  tensors["strided"] = torch::randn({4, 6}, torch::kFloat32).t();             // non-contiguous
  tensors["odd_u8"] = torch::randint(0, 256, {7}, torch::kUInt8);             // odd byte count
  const Metadata meta = {{"format", "pt"}, {"note", "caf\u00e9"}};
  const std::string path = dir / "x.safetensors";
  save_safetensors(path, tensors, meta);
  EXPECT_EQ(dir.list(), std::vector<std::string>{"x.safetensors"});  // no temporary left

  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), meta);
  std::vector<std::string> expected_names;
  for (const auto& kv : tensors) expected_names.push_back(kv.first);
  EXPECT_EQ(f.names(), expected_names);
  for (const auto& [name, t] : tensors) {
    auto got = f.tensor(name);
    EXPECT_EQ(got.device().type(), torch::kCPU);
    EXPECT_TRUE(same_bits(got, t)) << name;
    // Our writer aligns every tensor, so every non-empty one is a view of the mapping.
    EXPECT_EQ(f.is_zero_copy(name), t.numel() > 0) << name;
  }
  // The header is padded to 8 bytes and the data follows it.
  const std::string bytes = lt2::testing::read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, ViewsShareTheMapping) {
  TempDir dir;
  const std::string path = dir / "v.safetensors";
  auto a = torch::arange(12, torch::kFloat32).view({3, 4});
  save_safetensors(path, {{"a", a}, {"b", torch::ones({5}, torch::kInt8)}});
  torch::Tensor v1, v2;
  {
    SafetensorsFile f(path);
    v1 = f.tensor("a");
    v2 = f.tensor("a");
    EXPECT_TRUE(f.is_zero_copy("a"));
    EXPECT_EQ(v1.data_ptr(), v2.data_ptr());  // both view the same mapped bytes
    const auto info = f.info("a");
    EXPECT_EQ(info.shape, (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(info.end - info.begin, 48u);
  }
  // The file object is gone; the views keep the mapping alive.
  EXPECT_TRUE(torch::equal(v1, a));
  // Owned copies for data that is modified after loading.
  auto owned = load_tensor_map(path);
  EXPECT_NE(owned["a"].data_ptr(), v1.data_ptr());
  owned["a"].add_(1);
  EXPECT_TRUE(torch::equal(owned["a"], a + 1));
}

TEST(Safetensors, UnalignedOffsetGivesACopy) {
  TempDir dir;
  const std::string path = dir / "u.safetensors";
  // One byte of U8 first, so the F32 tensor starts at data offset 1.
  std::string header = R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const float vals[2] = {1.5f, -3.25f};
  std::string data(1, '\x07');
  data.append(reinterpret_cast<const char*>(vals), 8);
  lt2::testing::write_bytes(path, raw_safetensors(header, data));
  SafetensorsFile f(path);
  EXPECT_FALSE(f.is_zero_copy("f"));
  EXPECT_TRUE(f.is_zero_copy("b"));
  EXPECT_TRUE(torch::equal(f.tensor("f"), torch::tensor({1.5f, -3.25f})));
  EXPECT_EQ(f.tensor("b").item<uint8_t>(), 7);
}

TEST(Safetensors, CorruptFilesGiveClearErrors) {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  auto open_it = [&] { SafetensorsFile f(path); };
  auto write = [&](const std::string& bytes) { lt2::testing::write_bytes(path, bytes); };
  const std::string f32x2 = std::string(8, '\0');

  // Truncated: a valid file missing its last bytes.
  save_safetensors(path, {{"w", torch::randn({4, 4})}});
  std::string good = lt2::testing::read_bytes(path);
  write(good.substr(0, good.size() - 5));
  expect_error(open_it, {path, "'w'", "truncated", "[0, 64]", "59"});
  write(good.substr(0, 5));
  expect_error(open_it, {path, "too short"});
  write(good + "xyz");
  expect_error(open_it, {path, "3 trailing bytes"});

  // Header length beyond the file.
  write(raw_safetensors("{}", "", 1000));
  expect_error(open_it, {path, "header length (1000 bytes) goes beyond the end of the file"});
  // Bad JSON, and JSON that is not an object.
  write(raw_safetensors(R"({"w": {"dtype": "F32",)", ""));
  expect_error(open_it, {path, "not valid JSON"});
  write(raw_safetensors("[1, 2]", ""));
  expect_error(open_it, {path, "must be a JSON object"});
  // Unknown dtype.
  write(raw_safetensors(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "x"));
  expect_error(open_it, {path, "tensor 'w'", "unknown dtype \"F4\""});
  // Overlapping offsets.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2));
  expect_error(open_it, {path, "'a'", "'b'", "overlap"});
  // Offsets that do not match shape x dtype.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2));
  expect_error(open_it, {path, "tensor 'a'", "[3] x F32 needs 12 bytes", "hold 8"});
  // Offsets out of range.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f32x2));
  expect_error(open_it, {path, "tensor 'a'", "truncated"});
  // A gap in the data.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2));
  expect_error(open_it, {path, "bytes [0, 4) belong to no tensor", "'a'"});
  // Malformed entries.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2));
  expect_error(open_it, {path, "tensor 'a'", "non-negative integer", "-2"});
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[2]}})", f32x2));
  expect_error(open_it, {path, "tensor 'a'", "missing field 'data_offsets'"});
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", f32x2));
  expect_error(open_it, {path, "unknown field 'x'"});
  write(raw_safetensors(R"({"__metadata__":{"k":1}})", ""));
  expect_error(open_it, {path, "'__metadata__'", "must be a string"});
  // Bool bytes other than 0/1 are refused when the tensor is read.
  write(raw_safetensors(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x02", 2)));
  SafetensorsFile f(path);
  expect_error([&] { f.tensor("m"); }, {path, "'m'", "other than 0 and 1"});
  expect_error([&] { f.tensor("nope"); }, {path, "no tensor 'nope'"});
  // A missing file.
  expect_error([&] { SafetensorsFile g(dir / "missing.safetensors"); }, {"missing.safetensors", "cannot open"});
}

TEST(Safetensors, HostileSizesAreRefusedBeforeAllocating) {
  TempDir dir;
  const std::string path = dir / "hostile.safetensors";
  auto open_it = [&] { SafetensorsFile f(path); };
  auto write = [&](const std::string& bytes) { lt2::testing::write_bytes(path, bytes); };
  // A header length of 2^60 (and one just over the format's 100 MB) in a tiny file.
  write(raw_safetensors("{}", "", int64_t{1} << 60));
  expect_error(open_it, {path, "header length (1152921504606846976 bytes) is more than the format's limit"});
  write(raw_safetensors("{}", "", 100'000'001));
  expect_error(open_it, {path, "more than the format's limit of 100000000 bytes"});
  // 2^60 elements claimed for 8 bytes of data, and sizes whose product overflows 64 bits.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[1073741824,1073741824],"data_offsets":[0,8]}})",
                        std::string(8, '\0')));
  expect_error(open_it, {path, "needs 4611686018427387904 bytes", "hold 8"});
  write(raw_safetensors(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})",
                        std::string(8, '\0')));
  expect_error(open_it, {path, "tensor 'a'", "non-zero sizes multiply to more than 2^63 bytes"});
  // An empty tensor is 0 bytes whatever its other sizes, but torch still computes their strides.
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],)"
                        R"("data_offsets":[0,0]}})", ""));
  expect_error(open_it, {path, "non-zero sizes multiply to more than 2^63 bytes"});
  write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[0,1048576,1048576],"data_offsets":[0,0]}})", ""));
  EXPECT_EQ(SafetensorsFile(path).tensor("a").numel(), 0);
  // More dimensions than a tensor may have.
  json many = json::array();
  for (int i = 0; i < 65; ++i) many.push_back(1);
  write(raw_safetensors(json{{"a", {{"dtype", "F32"}, {"shape", many}, {"data_offsets", {0, 4}}}}}.dump(), std::string(4, '\0')));
  expect_error(open_it, {path, "'shape' has 65 dimensions, more than the 64"});
}

TEST(Safetensors, WriteErrorsLeaveNoFile) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  expect_error([&] { save_safetensors(path, {{"c", torch::zeros({2}, torch::kComplexFloat)}}); },
               {"tensor 'c'", "no safetensors equivalent"});
  expect_error([&] { save_safetensors(path, {{"__metadata__", torch::zeros({2})}}); }, {"__metadata__"});
  EXPECT_TRUE(dir.list().empty());
}
