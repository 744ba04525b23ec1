// The `lt2 serve` command itself: a checkpoint served on a port the OS picks answers a greedy
// completion with exactly `lt2 generate`'s tokens, documents every flag, and drains on SIGTERM.
#include <filesystem>
#include <regex>
#include <thread>

#include "lt2/model/checkpoint_io.h"
#include "lt2/util/fs.h"
#include "serve/serve_testing.h"
#include "train/subprocess.h"

using namespace lt2;
using namespace lt2::testing;

namespace {

const std::string kLt2 = LT2_CLI;

// A served checkpoint: a tiny fp64 GDN + full-attention hybrid with the byte-level tokenizer.
std::string make_checkpoint(const std::string& name) {
  const auto dir = (std::filesystem::temp_directory_path() / ("lt2-serve-" + name + "-" + std::to_string(::getpid()))).string();
  remove_tree(dir);
  save_checkpoint(dir, make_test_model(serve_config("interleaved:1:1:gdn:full"), 9));
  chat_tokenizer().save(dir + "/tokenizer.json");
  return dir;
}

// The port `lt2 serve` printed, once it did (-1 after timeout_s).
int wait_for_port(const std::string& log, double timeout_s) {
  int port = -1;
  wait_until([&] {
    std::smatch m;
    const std::string text = read_text(log);
    if (std::regex_search(text, m, std::regex("listening on http://127\\.0\\.0\\.1:([0-9]+)"))) port = std::stoi(m[1]);
    return port > 0;
  }, timeout_s);
  return port;
}

}  // namespace

TEST(ServeCli, GreedyCompletionEqualsLt2GenerateAndSigtermDrains) {
  const auto ckpt = make_checkpoint("cli");
  const std::string prompt = "To be, or not to be";
  const std::string glog = ckpt + ".generate.log";
  auto gen = start_process({kLt2, "generate", ckpt, "-p", prompt, "-n", "24", "-t", "0", "--ignore-eos", "--json",
                            "--prefill-chunk", "8", "--device", "cpu"},
                           {"OMP_NUM_THREADS=1"}, glog);
  ASSERT_TRUE(wait_process(gen, 120).ok()) << read_text(glog);
  const std::string gtext = read_text(glog);
  const auto want = json::parse(gtext.substr(gtext.find('{')))["tokens"].get<std::vector<int64_t>>();
  ASSERT_EQ(want.size(), 24u);

  const std::string slog = ckpt + ".serve.log";
  auto srv = start_process({kLt2, "serve", ckpt, "--port", "0", "--device", "cpu", "--max-batch", "2", "--max-context",
                            "128", "--prefill-chunk", "8", "--model-name", "ck"},
                           {"OMP_NUM_THREADS=1"}, slog);
  const int port = wait_for_port(slog, 120);
  ASSERT_GT(port, 0) << read_text(slog);
  const json body{{"model", "ck"}, {"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0},
                  {"ignore_eos", true}, {"return_token_ids", true}};
  const auto r = post(port, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body()["choices"][0]["token_ids"].get<std::vector<int64_t>>(), want);

  // SIGTERM while a request runs: it is answered in full, then the server exits with status 0.
  HttpResult drained;
  json long_body = body;
  long_body["max_tokens"] = 100;
  std::thread client([&] { drained = post(port, "/v1/completions", long_body); });
  wait_until([&] { return metric(port, "lt2_requests_running") + metric(port, "lt2_requests_prefilling") >= 1; }, 30);
  srv.kill(SIGTERM);
  const auto e = wait_process(srv, 60);
  client.join();
  EXPECT_TRUE(e.ok()) << ExitStatus{e.status}.describe() << "\n" << read_text(slog);
  EXPECT_EQ(drained.status, 200) << drained.body;
  const std::string log = read_text(slog);
  EXPECT_NE(log.find("finished: length"), std::string::npos) << log;  // one log line per request
  remove_tree(ckpt);
}

TEST(ServeCli, HelpDocumentsEveryFlag) {
  const std::string log = (std::filesystem::temp_directory_path() / ("lt2-serve-help-" + std::to_string(::getpid()))).string();
  auto p = start_process({kLt2, "serve", "--help"}, {}, log);
  ASSERT_TRUE(wait_process(p, 60).ok());
  const std::string help = read_text(log);
  for (const char* flag : {"--port", "--host", "--max-batch", "--max-context", "--prefill-chunk", "--step-token-budget",
                           "--prefill-rows", "--prefix-cache-gb", "--prefix-cache-host-gb", "--prefix-cache-interval",
                           "--timeout", "--read-timeout", "--write-timeout", "--max-body-mb", "--http-threads",
                           "--drain-timeout", "--max-queue", "--tokenizer", "--chat-template", "--model-name", "--device", "--dtype",
                           "--no-cuda-graphs", "--quiet"})
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  std::filesystem::remove(log);
}

TEST(ServeCli, ABrokenChatTemplateFileStopsTheStartWithItsPosition) {
  const auto ckpt = make_checkpoint("template");
  write_file_atomic(ckpt + ".jinja", "{% for m in messages %}\n{{ m.content }}\n{% endif %}");
  const std::string log = ckpt + ".log";
  auto p = start_process({kLt2, "serve", ckpt, "--port", "0", "--device", "cpu", "--chat-template", ckpt + ".jinja"},
                         {"OMP_NUM_THREADS=1"}, log);
  const auto e = wait_process(p, 120);
  EXPECT_FALSE(e.ok());
  const std::string text = read_text(log);
  EXPECT_NE(text.find(ckpt + ".jinja:3:4: '{% endif %}' without a block it could end"), std::string::npos) << text;
  std::filesystem::remove(ckpt + ".jinja");
  std::filesystem::remove(log);
  remove_tree(ckpt);
}
