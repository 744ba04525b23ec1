// Tokenizer speed: encode and decode throughput on one core, and BPE training time.
//
//   tokenizer_bench --corpus TEXT [--mb 4] [--tokenizer tokenizer.json ...]
//                   [--train-corpus TEXT --vocab-size 32000 --threads 2] [--json OUT.json]
//
// Encode is timed twice per tokenizer: "cold" (a freshly loaded tokenizer, so every distinct
// word goes through the merge loop once) and "warm" (the word cache filled by the first pass).
// The text is encoded as paragraphs (cut at blank lines), as `lt2 data prepare` does.
// Encode and decode speeds are bytes per second of this thread's CPU time, so that other load on
// the machine does not distort them; training reports wall time and process CPU time.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <time.h>
#include <fstream>
#include <string>
#include <vector>

#include "lt2/tokenizer/tokenizer.h"
#include "lt2/tokenizer/trainer.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "lt2/util/json.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double cpu_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}
double thread_cpu_seconds() { return cpu_seconds(CLOCK_THREAD_CPUTIME_ID); }
double process_cpu_seconds() { return cpu_seconds(CLOCK_PROCESS_CPUTIME_ID); }

std::vector<std::string> paragraphs(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find("\n\n", begin);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(begin, end - begin + (end < text.size() ? 2 : 0)));
    begin = end + 2;
  }
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  std::string corpus, train_corpus, json_out;
  std::vector<std::string> tokenizers;
  double mb = 4;
  int vocab_size = 32000, threads = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--corpus") corpus = next();
    else if (a == "--mb") mb = std::stod(next());
    else if (a == "--tokenizer") tokenizers.push_back(next());
    else if (a == "--train-corpus") train_corpus = next();
    else if (a == "--vocab-size") vocab_size = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--json") json_out = next();
    else {
      std::fprintf(stderr, "usage: %s --corpus TEXT [--mb 4] [--tokenizer F ...] [--train-corpus TEXT "
                   "--vocab-size N --threads N] [--json OUT]\n", argv[0]);
      return 2;
    }
  }
  try {
    lt2::json result = {{"cpu", cpu_model()}, {"date_unix", static_cast<int64_t>(std::time(nullptr))}};
    std::string trained_path;
    if (!train_corpus.empty()) {
      const std::string text = lt2::read_file(train_corpus);
      lt2::BpeTrainerOptions o;
      o.vocab_size = vocab_size;
      o.threads = threads;
      const auto t0 = std::chrono::steady_clock::now();
      const double cpu0 = process_cpu_seconds();
      const lt2::Tokenizer tok = lt2::train_bpe({text}, o);
      const double secs = seconds_since(t0), cpu = process_cpu_seconds() - cpu0;
      trained_path = "/tmp/tokenizer_bench_trained.json";
      tok.save(trained_path);
      result["train"] = {{"corpus_bytes", text.size()}, {"vocab_size", tok.vocab_size()},
                         {"threads", threads}, {"wall_seconds", secs}, {"cpu_seconds", cpu}};
      std::printf("train: %d tokens on %.1f MB with %d threads in %.2f s (%.2f s CPU)\n", tok.vocab_size(),
                  text.size() / 1e6, threads, secs, cpu);
      tokenizers.insert(tokenizers.begin(), trained_path);
    }
    if (!corpus.empty()) {
      std::string text = lt2::read_file(corpus);
      if (text.size() > mb * 1e6) text.resize(static_cast<size_t>(mb * 1e6));
      const std::vector<std::string> docs = paragraphs(text);
      result["encode"] = lt2::json::array();
      for (const std::string& path : tokenizers) {
        const lt2::Tokenizer tok = lt2::Tokenizer::load(path);
        lt2::json row = {{"tokenizer", path == trained_path ? "lt2-trained" : path},
                         {"vocab_size", tok.vocab_size()}, {"bytes", text.size()}};
        std::vector<std::vector<int32_t>> ids(docs.size());
        int64_t n_tokens = 0;
        for (const char* pass : {"cold", "warm"}) {
          const double t0 = thread_cpu_seconds();
          n_tokens = 0;
          for (size_t i = 0; i < docs.size(); ++i) {
            ids[i] = tok.encode(docs[i]);
            n_tokens += static_cast<int64_t>(ids[i].size());
          }
          row[std::string("encode_mb_per_s_") + pass] = text.size() / 1e6 / (thread_cpu_seconds() - t0);
        }
        const double t0 = thread_cpu_seconds();
        size_t decoded = 0;
        for (const auto& d : ids) decoded += tok.decode(d).size();
        row["decode_mb_per_s"] = decoded / 1e6 / (thread_cpu_seconds() - t0);
        row["tokens"] = n_tokens;
        row["bytes_per_token"] = static_cast<double>(text.size()) / n_tokens;
        std::printf("%-60s vocab %6d  encode %6.1f MB/s cold, %6.1f MB/s warm  decode %6.1f MB/s  %.2f bytes/token\n",
                    row["tokenizer"].get<std::string>().c_str(), tok.vocab_size(),
                    row["encode_mb_per_s_cold"].get<double>(), row["encode_mb_per_s_warm"].get<double>(),
                    row["decode_mb_per_s"].get<double>(), row["bytes_per_token"].get<double>());
        result["encode"].push_back(row);
      }
      result["corpus"] = corpus;
      result["corpus_bytes"] = text.size();
    }
    if (!json_out.empty()) lt2::write_file_atomic(json_out, result.dump(2) + "\n");
  } catch (const lt2::Error& e) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
