#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

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
}
