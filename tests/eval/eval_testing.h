// Fixtures of the evaluation tests: a byte-level tokenizer (every byte one token, <|endoftext|> =
// 256), tiny random models, a scratch folder, and a check on lt2::Error messages.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::eval_testing {

inline Tokenizer byte_tokenizer() { return Tokenizer::byte_level({"<|endoftext|>"}); }

// A tiny fp32 model over the byte tokenizer's 257 ids.
inline LoopedLM tiny_model(ModelForm form = ModelForm::LT2, int64_t max_seq_len = 256) {
  auto cfg = testing::tiny_config("full", form);
  cfg.vocab_size = 260;
  cfg.max_seq_len = max_seq_len;
  auto m = testing::make_test_model(cfg, 3, torch::kFloat32);
  m->eval();
  return m;
}

// A fresh folder under /tmp, removed at the end of the test.
struct ScratchDir {
  std::string path;
  ScratchDir() : path("/tmp/lt2_eval_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++)) {
    remove_tree(path);
    make_dirs(path);
  }
  ~ScratchDir() { remove_tree(path); }
  std::string write(const std::string& name, const std::string& contents) const {
    write_file_atomic(path + "/" + name, contents);
    return path + "/" + name;
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

// Runs `fn`, expects an lt2::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an lt2::Error mentioning " << parts[0];
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// The folder of real evaluation data beside the checkout (absent in CI: tests using it skip).
inline std::string shared_data() { return LT2_SOURCE_DIR "/../shared/data"; }

}  // namespace lt2::eval_testing
