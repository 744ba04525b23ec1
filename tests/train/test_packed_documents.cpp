// Training on packed documents (TrainConfig::pack_documents): a step's loss equals the
// token-weighted loss of every document of its rows run alone through the model, a resumed run
// repeats an uninterrupted one exactly, and a shard without a known separator is a clear error.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>

#include "common/expect_error.h"
#include "common/testing.h"
#include "lt2/data/prepare.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/train/batches.h"
#include "lt2/train/losses.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "train/train_testing.h"

using namespace lt2;
namespace fs = std::filesystem;

namespace {

using lt2::testing::expect_error_containing;
using lt2::testing::losses_of;

// The tiny run on a hybrid model (GDN: the varlen scan; full attention: the per-document
// fallback), packing at token 0, which the pattern shard holds every 23 tokens and at random.
TrainConfig packed_run(const std::string& dir) {
  lt2::remove_tree(dir);
  auto cfg = lt2::testing::tiny_run(dir);
  auto model = lt2::testing::tiny_config("gdn,full");
  model.vocab_size = 0;
  model.mixer_options = json{{"gdn", {{"chunk_size", 4}}}};
  model.save(dir + "/model.json");
  cfg.model = dir + "/model.json";
  cfg.pack_documents = true;
  cfg.document_separator = 0;
  cfg.seq_len = 48;  // about two documents a row
  cfg.steps = 4;
  return cfg;
}

}  // namespace

TEST(PackedDocuments, StepLossEqualsDocumentsAlone) {
  const std::string dir = (fs::temp_directory_path() / "lt2_packed_step").string();
  auto cfg = packed_run(dir);
  cfg.steps = 1;
  Trainer t(cfg, false);
  // The step's batches and the model before the step, each document of each row alone.
  BatchSampler sampler(std::make_shared<const ShardReader>(cfg.train_data), cfg.seq_len, cfg.seed);
  double alone = 0, unpacked = 0;
  int64_t documents = 0;
  {
    torch::NoGradGuard ng;
    for (int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
      const auto [x, y] = sampler.sample(0, micro, cfg.batch_size);
      const auto docs = PackedDocuments::at_separator(x, cfg.document_separator);
      for (int64_t b = 0; b < docs.rows(); ++b)
        for (size_t d = 0; d < docs.starts[b].size(); ++d, ++documents) {
          const int64_t s = docs.starts[b][d], e = d + 1 < docs.starts[b].size() ? docs.starts[b][d + 1] : docs.T;
          const auto logits = t.model()->forward(x.narrow(0, b, 1).narrow(1, s, e - s)).logits;
          alone += token_cross_entropy(logits, y.narrow(0, b, 1).narrow(1, s, e - s)).sum().item<double>();
        }
      unpacked += cross_entropy(t.model()->forward(x).logits, y).item<double>();
    }
  }
  const double tokens = static_cast<double>(cfg.grad_accum * cfg.batch_size * cfg.seq_len);
  alone /= tokens;
  unpacked /= static_cast<double>(cfg.grad_accum);
  ASSERT_GE(documents, 2 * cfg.grad_accum * cfg.batch_size) << "too few document boundaries to test";
  const auto losses = losses_of(t);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_NEAR(losses[0], alone, 1e-5 * alone);  // fp32 on the CPU
  EXPECT_GT(std::abs(unpacked - alone), 1e-3) << "packing changed nothing: no test";
}

TEST(PackedDocuments, ResumeIsExact) {
  const std::string dir = (fs::temp_directory_path() / "lt2_packed_resume").string();
  auto cfg = packed_run(dir);
  Trainer whole(cfg, false);
  const auto all = losses_of(whole);
  ASSERT_EQ(all.size(), 4u);
  auto part = cfg;
  part.out_dir = dir + "/run2";
  part.steps = 2;
  Trainer first(part, false);
  const auto head = losses_of(first);
  part.steps = 4;
  Trainer resumed(part, true);
  const auto tail = losses_of(resumed);
  ASSERT_EQ(tail.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(head[i], all[i]) << "step " << i + 1;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(tail[i], all[2 + i]) << "step " << 3 + i;
}

TEST(PackedDocuments, UnknownSeparatorIsAnError) {
  const std::string dir = (fs::temp_directory_path() / "lt2_packed_no_separator").string();
  auto cfg = packed_run(dir);
  cfg.document_separator = -1;  // the shard's: no summary.json beside it
  expect_error_containing([&] { Trainer t(cfg, false); }, "document_separator");
  cfg.document_separator = 50;  // the shard's vocabulary is 50
  expect_error_containing([&] { Trainer t(cfg, false); }, "outside the model's vocabulary");
}

// The separator of a shard from `lt2 data prepare` is found beside it (summary.json names it,
// tokenizer.json gives its id): the run equals one given that id.
TEST(PackedDocuments, SeparatorOfAPreparedShard) {
  const std::string dir = (fs::temp_directory_path() / "lt2_packed_prepared").string();
  lt2::remove_tree(dir);
  fs::create_directories(dir + "/corpus");
  std::string text;
  for (int i = 0; i < 40; ++i) text += "document " + std::to_string(i) + (i % 3 ? " is short" : " is a bit longer") + "\n\n";
  write_file_atomic(dir + "/corpus/a.txt", text);
  const auto tokenizer = Tokenizer::byte_level({"<|endoftext|>"});
  tokenizer.save(dir + "/tokenizer.json");
  PrepareOptions o;
  o.inputs = {dir + "/corpus"};
  o.tokenizer_path = dir + "/tokenizer.json";
  o.out_dir = dir + "/shards";
  o.val_fraction = 0;
  o.progress = false;
  prepare_data(o);
  auto cfg = lt2::testing::tiny_run(dir);
  cfg.train_data = dir + "/shards/train.bin";
  cfg.pack_documents = true;
  cfg.steps = 2;
  Trainer found(cfg, false);
  const auto with_found = losses_of(found);
  cfg.out_dir = dir + "/run2";
  cfg.document_separator = *tokenizer.token_to_id("<|endoftext|>");
  Trainer given(cfg, false);
  EXPECT_EQ(with_found, losses_of(given));
  cfg.out_dir = dir + "/run3";
  cfg.document_separator = tokenizer.encode("d").at(0);  // other boundaries, another loss
  Trainer other(cfg, false);
  EXPECT_NE(with_found, losses_of(other));
}
