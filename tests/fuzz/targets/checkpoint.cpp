// Checkpoint folders as `lt2 train --resume`, `lt2 tasks run --resume` and `lt2 info` read them:
// the run config of a task run (run_config.json), the trainer state (trainer_state.json: the step,
// and a task run's curriculum), and config.json with the weights (model.safetensors, or an index
// and its shards) checked from the headers against the model the config builds, then loaded, and
// the optimizer state (optimizer.safetensors) loaded into an optimizer of that model. The input is
// the folder (fuzz_target.h: ScratchFolder); each reader runs on its own, so a bad file of one kind
// does not hide the others from the fuzzer.
#include "fuzz/fuzz_target.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/tasks/curriculum.h"
#include "lt2/tasks/runner.h"
#include "lt2/train/optimizer.h"
#include "lt2/util/fs.h"

namespace {

// Configs within which building the model is cheap (under ~100 MB): lt2 builds whatever size a
// config names, so a large one is not a reader's fault, only slow to fuzz.
bool cheap_to_build(const lt2::ModelConfig& c) {
  return c.vocab_size <= 4096 && c.d_model <= 256 && c.n_layers <= 8 && c.n_heads * c.dim_head() <= 1024 &&
         c.kv_heads() * c.dim_head() <= 1024 && c.ffn_dim() <= 2048 && c.max_seq_len <= 65536;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lt2::fuzz::ScratchFolder folder("checkpoint", lt2::fuzz::bytes(data, size));
  if (!folder.ok) return 0;
  const std::string dir = folder.path;
  lt2::fuzz::run([&] {
    const std::string path = dir + "/run_config.json";
    if (lt2::path_exists(path)) lt2::tasks::TaskRunConfig::from_json(lt2::load_json_file(path), "'" + path + "'");
  });
  lt2::fuzz::run([&] {
    const std::string path = dir + "/trainer_state.json";
    if (!lt2::path_exists(path)) return;
    const lt2::json state = lt2::load_json_file(path);
    lt2::json_require<int64_t>(state, "step", path);
    if (!state.contains("curriculum")) return;  // a task run's state has its curriculum
    lt2::tasks::Curriculum::from_json(lt2::json_require<lt2::json>(state, "curriculum", path));
    lt2::json_require<double>(state, "train_seconds", path);
  });
  lt2::fuzz::run([&] {
    const lt2::ModelConfig config = lt2::load_checkpoint_config(dir);
    if (!cheap_to_build(config)) return;
    lt2::check_checkpoint_weights(dir, lt2::LoopedLM(config));
    lt2::LoopedLM model = lt2::load_checkpoint(dir);
    std::vector<std::pair<std::string, torch::Tensor>> params;
    for (auto& p : model->named_parameters()) params.emplace_back(p.key(), p.value());
    lt2::AdamW optimizer(params, {});
    optimizer.load_state_dict(lt2::load_tensor_map(dir + "/optimizer.safetensors"));
  });
  return 0;
}
