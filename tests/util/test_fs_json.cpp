#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "lt2/util/fs.h"
#include "lt2/util/json.h"

using namespace lt2;

TEST(Fs, AtomicWriteReplacesWholeFile) {
  auto dir = std::filesystem::temp_directory_path() / "lt2_test_fs";
  make_dirs(dir.string());
  auto path = (dir / "a.txt").string();
  write_file_atomic(path, std::string("first version, long"));
  write_file_atomic(path, std::string("second"));
  EXPECT_EQ(read_file(path), "second");
  // No temporary file is left behind.
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) n += e.path().filename().string().rfind("a.txt.tmp", 0) == 0;
  EXPECT_EQ(n, 0);
  MappedFile m(path);
  EXPECT_EQ(m.size(), 6u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), m.size()), "second");
}

TEST(Fs, FailedWriteKeepsOldFile) {
  auto dir = std::filesystem::temp_directory_path() / "lt2_test_fs2";
  make_dirs(dir.string());
  auto path = (dir / "b.txt").string();
  write_file_atomic(path, std::string("good"));
  EXPECT_THROW(write_file_atomic(path, [](std::ostream&) { throw Error("boom"); }), Error);
  EXPECT_EQ(read_file(path), "good");
}

TEST(Fs, MissingFileNamesPath) {
  try {
    read_file("/nonexistent/lt2/x.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/lt2/x.json"), std::string::npos);
  }
}

TEST(Json, ErrorsNameFieldAndType) {
  json j = json::parse(R"({"a": "text", "b": 3})");
  int a = 0;
  try {
    json_get(j, "a", a, "cfg");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'a'"), std::string::npos);
    EXPECT_NE(m.find("string"), std::string::npos);
  }
  EXPECT_THROW(json_reject_unknown(j, {"a"}, "cfg"), Error);
  EXPECT_THROW(parse_json("{bad", "x"), Error);
  EXPECT_THROW(parse_json("{\"n\": 1e999}", "x"), Error);  // out of double's range: not a json::exception
}

TEST(Json, IntegersAreStrict) {
  const json j = json::parse(R"({"half": 2.5, "whole": 2.0, "neg": -1, "big": 1099511627776, "one": 1,
                                 "list": [1, 2, 3.5], "flag": true})");
  int64_t i = 7;
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  // nlohmann's get<int64_t>() would give 2: a non-integer where an integer is expected is an error.
  EXPECT_EQ(message([&] { json_get(j, "half", i, "cfg.json"); }),
            "cfg.json: field 'half' must be an integer, found number 2.5");
  EXPECT_NE(message([&] { json_get(j, "whole", i, "cfg.json"); }).find("must be an integer"), std::string::npos);
  EXPECT_EQ(i, 7);  // unchanged by the failures
  // Out of the type's range: no wrap-around into an unsigned, no truncation into a narrow type.
  uint64_t u = 0;
  EXPECT_EQ(message([&] { json_get(j, "neg", u, "c"); }),
            "c: field 'neg' must be an integer in [0, 18446744073709551615], found -1");
  int32_t n = 0;
  EXPECT_EQ(message([&] { json_get(j, "big", n, "c"); }),
            "c: field 'big' must be an integer in [-2147483648, 2147483647], found 1099511627776");
  bool b = false;
  EXPECT_EQ(message([&] { json_get(j, "one", b, "c"); }), "c: field 'one' must be true or false, found integer 1");
  std::vector<int64_t> list;
  EXPECT_EQ(message([&] { json_get(j, "list", list, "c"); }), "c: field 'list'[2] must be an integer, found number 3.5");
  double d = 0;
  json_get(j, "one", d, "c");  // an integer is a number
  EXPECT_EQ(d, 1.0);
  json_get(j, "neg", i, "c");
  EXPECT_EQ(i, -1);
  json_get(j, "big", u, "c");
  EXPECT_EQ(u, uint64_t{1} << 40);
  json_get(j, "flag", b, "c");
  EXPECT_TRUE(b);
  EXPECT_EQ(json_require<int64_t>(j, "one", "c"), 1);
  EXPECT_EQ(message([&] { json_require<int64_t>(j, "absent", "c"); }), "c: required field 'absent' is missing");
  EXPECT_EQ(message([&] { json_require<int64_t>(json::array(), "one", "c"); }), "c: expected a JSON object, found array []");
}

TEST(Fs, StaleTemporariesAreRemoved) {
  auto dir = std::filesystem::temp_directory_path() / "lt2_test_fs_stale";
  remove_tree(dir.string());
  make_dirs(dir.string());
  const std::string keep = (dir / "model.json").string();
  write_file_atomic(keep, std::string("{}"));
  // What a process killed mid-write leaves: its temporary file, and a folder of that name.
  write_file_atomic(temporary_path(keep) + "1", std::string("half"));
  make_dirs(temporary_path((dir / "sub").string()));
  for (const char* name : {"a.tmp", "a.tmp.", "a.tmp.x1", ".tmp.12"}) write_file_atomic((dir / name).string(), std::string("x"));
  remove_stale_temporaries(dir.string());
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{".tmp.12", "a.tmp", "a.tmp.", "a.tmp.x1", "model.json"}));
  remove_tree(dir.string());
}
