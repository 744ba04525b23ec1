#include "lt2/data/prepare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <thread>

#include "lt2/data/shard.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2 {

namespace {

// Documents are encoded in batches of about this many bytes, in parallel, then written in order.
constexpr size_t kBatchBytes = size_t{8} << 20;

bool held_out(int64_t index, double fraction) {
  return std::floor(static_cast<double>(index + 1) * fraction) > std::floor(static_cast<double>(index) * fraction);
}

json split_json(const SplitStats& s) {
  return {{"documents", s.documents},
          {"tokens", s.tokens},
          {"bytes", s.bytes},
          {"bytes_per_token", s.tokens > 0 ? static_cast<double>(s.bytes) / static_cast<double>(s.tokens) : 0.0}};
}

}  // namespace

json PrepareSummary::to_json() const {
  SplitStats all{train.documents + val.documents, train.tokens + val.tokens, train.bytes + val.bytes};
  return {{"train", split_json(train)}, {"val", split_json(val)}, {"total", split_json(all)},
          {"vocab_size", vocab_size}};
}

PrepareSummary prepare_data(const PrepareOptions& o) {
  LT2_CHECK(o.val_fraction >= 0.0 && o.val_fraction < 1.0, "--val-fraction must be in [0, 1), got ",
            o.val_fraction);
  LT2_CHECK(!o.out_dir.empty(), "no output folder given");
  LT2_CHECK(o.threads >= 0, "--threads must be >= 0 (0: all cores), got ", o.threads);
  const Tokenizer tok = Tokenizer::load(o.tokenizer_path);
  std::vector<int32_t> separator;
  if (!o.separator.empty()) {
    const auto id = tok.token_to_id(o.separator);
    LT2_CHECK(id, "separator '", o.separator, "' is not a token of ", o.tokenizer_path,
              " (give --separator \"\" for none, or a token the tokenizer has)");
    separator.push_back(*id);
  }
  const Corpus corpus(o.inputs, o.text_split);
  make_dirs(o.out_dir);
  ShardWriter train(o.out_dir + "/train.bin", tok.vocab_size());
  ShardWriter val(o.out_dir + "/val.bin", tok.vocab_size());

  PrepareSummary summary;
  summary.vocab_size = tok.vocab_size();
  int threads = o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(1, threads);
  const auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  int64_t index = 0;  // of the next document in corpus order

  std::vector<std::string> batch;
  size_t batch_bytes = 0;
  int64_t bytes_read = 0;
  auto flush = [&] {
    std::vector<std::vector<int32_t>> ids(batch.size());
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(threads);
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        try {
          for (size_t i = t; i < batch.size(); i += threads) ids[i] = tok.encode(batch[i]);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
    for (auto& th : pool) th.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    for (size_t i = 0; i < batch.size(); ++i, ++index) {
      const bool to_val = held_out(index, o.val_fraction);
      ShardWriter& w = to_val ? val : train;
      SplitStats& s = to_val ? summary.val : summary.train;
      w.write(ids[i]);
      w.write(separator);
      s.documents += 1;
      s.tokens += static_cast<int64_t>(ids[i].size() + separator.size());
      s.bytes += static_cast<int64_t>(batch[i].size());
    }
    batch.clear();
    batch_bytes = 0;
    const auto now = std::chrono::steady_clock::now();
    if (o.progress && (now - last_report > std::chrono::seconds(2))) {
      last_report = now;
      const double secs = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "prepare: %.1f / %.1f MB read (%.0f%%), %lld documents, %lld tokens, %.1f MB/s\n",
                   bytes_read / 1e6, corpus.total_bytes() / 1e6,
                   100.0 * bytes_read / std::max<int64_t>(1, corpus.total_bytes()),
                   static_cast<long long>(index), static_cast<long long>(summary.train.tokens + summary.val.tokens),
                   bytes_read / 1e6 / std::max(secs, 1e-9));
    }
  };
  corpus.for_each([&](std::string_view doc, int64_t read_so_far) {
    batch.emplace_back(doc);
    batch_bytes += doc.size();
    bytes_read = read_so_far;
    if (batch_bytes >= kBatchBytes) flush();
  });
  flush();
  LT2_CHECK(summary.train.documents > 0, "no documents found in the inputs");
  if (o.progress && o.val_fraction > 0 && summary.val.documents == 0)
    std::fprintf(stderr, "prepare: warning: %lld documents are too few for --val-fraction %g; val.bin is empty\n",
                 static_cast<long long>(summary.train.documents), o.val_fraction);

  train.close();
  val.close();
  write_file_atomic(o.out_dir + "/tokenizer.json", read_file(o.tokenizer_path));
  json s = summary.to_json();
  s["inputs"] = o.inputs;
  s["files"] = corpus.files().size();
  s["separator"] = o.separator;
  s["val_fraction"] = o.val_fraction;
  s["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_file_atomic(o.out_dir + "/summary.json", s.dump(2) + "\n");
  return summary;
}

}  // namespace lt2
