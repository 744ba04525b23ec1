// The LM loss through the fused head (train/losses.h lm_cross_entropy, ops/loss/lm_head_loss.h)
// against the reference through the model's logits: every parameter's gradient, with tied and
// untied embeddings and the Ouro form; and whole training steps of the trainer.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/testing.h"
#include "lt2/train/losses.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "train/train_testing.h"

using namespace lt2;
namespace fs = std::filesystem;

namespace {

using lt2::testing::rel_err;

struct LossAndGrads {
  double loss;
  std::map<std::string, torch::Tensor> grads;
};

LossAndGrads loss_and_grads(LoopedLM& m, const torch::Tensor& tokens, const torch::Tensor& targets,
                            const ForwardOptions& fo, const LmLossOptions& opts) {
  m->zero_grad();
  auto loss = lm_cross_entropy(*m, tokens, targets, fo, opts);
  loss.backward();
  LossAndGrads out{loss.item<double>(), {}};
  for (const auto& p : m->named_parameters())
    if (p.value().grad().defined()) out.grads[p.key()] = p.value().grad().clone();
  return out;
}

void expect_fused_matches_reference(LoopedLM& m, const ForwardOptions& fo, const std::string& what) {
  ASSERT_TRUE(m->logits_from_hidden(fo)) << what;
  const auto tokens = lt2::testing::random_tokens(2, 9, m->config().vocab_size, 5);
  const auto targets = lt2::testing::random_tokens(2, 9, m->config().vocab_size, 6);
  LmLossOptions fused, reference;
  fused.head.chunk_tokens = 5;  // 18 tokens: 4 chunks, the last one short
  reference.fused = false;
  const auto a = loss_and_grads(m, tokens, targets, fo, fused);
  const auto b = loss_and_grads(m, tokens, targets, fo, reference);
  EXPECT_NEAR(a.loss, b.loss, 1e-10 * b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (const auto& [name, g] : b.grads) {
    ASSERT_TRUE(a.grads.count(name)) << what << ": " << name;
    EXPECT_LT(rel_err(a.grads.at(name), g), 1e-10) << what << ": " << name;
  }
}

}  // namespace

TEST(FusedLoss, EveryGradientMatchesTheReference) {
  for (bool tied : {false, true}) {
    auto cfg = lt2::testing::tiny_config();
    cfg.tie_embeddings = tied;
    auto m = lt2::testing::make_test_model(cfg);
    expect_fused_matches_reference(m, {}, tied ? "tied embeddings" : "untied");
  }
  // Ouro form with its exit gate: the logits of the last loop's exit are head(hidden).
  auto m = lt2::testing::make_test_model(lt2::testing::tiny_config("full", ModelForm::Ouro));
  ForwardOptions last_exit;
  last_exit.exit_at_loop = m->config().n_loops;
  expect_fused_matches_reference(m, last_exit, "Ouro, last exit");
  // Where the exit gate picks each token's loop, the logits are not head(hidden): the reference runs.
  EXPECT_FALSE(m->logits_from_hidden({}));
}

TEST(FusedLoss, TrainingStepsMatchTheReference) {
  const std::string dir = (fs::temp_directory_path() / "lt2_fused_loss_steps").string();
  lt2::remove_tree(dir);
  auto cfg = lt2::testing::tiny_run(dir);
  cfg.steps = 3;
  cfg.loss_chunk_tokens = 5;  // 4 x 16 tokens a micro-batch: the last chunk is short
  auto reference_cfg = cfg;
  reference_cfg.fused_loss = false;
  reference_cfg.out_dir = dir + "/reference";
  auto train = [](const TrainConfig& c, std::vector<double>& losses) {
    auto t = std::make_unique<Trainer>(c, false);
    t->on_step = [&losses](const StepMetrics& m) { losses.push_back(m.loss); };
    t->run();
    return t;
  };
  std::vector<double> fused_losses, reference_losses;
  auto fused = train(cfg, fused_losses);
  auto reference = train(reference_cfg, reference_losses);
  ASSERT_EQ(fused_losses.size(), 3u);
  for (size_t i = 0; i < fused_losses.size(); ++i)
    EXPECT_NEAR(fused_losses[i], reference_losses[i], 1e-5 * reference_losses[i]) << "step " << i + 1;
  auto pa = fused->model()->named_parameters(), pb = reference->model()->named_parameters();
  for (const auto& p : pa) EXPECT_LT(rel_err(p.value(), pb[p.key()]), 1e-5) << p.key();
  EXPECT_NEAR(fused->evaluate(), reference->evaluate(), 1e-5);
}
