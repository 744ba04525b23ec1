// Helpers of the task-run tests (tests/tasks, tests/faults): a model config file, a tiny run.
#pragma once
#include <string>

#include "lt2/tasks/runner.h"
#include "lt2/util/fs.h"
#include "lt2/util/json.h"

namespace lt2::testing {

// A model config file in folder `dir`: full attention, LT2 form, vocab from the task.
inline std::string write_task_model(const std::string& dir, int64_t d_model, int64_t n_layers, int64_t n_heads,
                                    int64_t n_loops, int64_t ffn_hidden = 0) {
  const std::string path = dir + "/model.json";
  write_file_atomic(path, json{{"name", "test-model"}, {"vocab_size", 0}, {"d_model", d_model},
                               {"n_layers", n_layers}, {"n_heads", n_heads}, {"n_loops", n_loops},
                               {"ffn_hidden", ffn_hidden}, {"layer_pattern", "full"}}
                              .dump());
  return path;
}

// A few-step run through the curriculum's transitions, its model in folder `dir`: with one query
// per example and a 4% bar, chance-level answers (1 in 32) solve a stage now and then. With these
// settings stage 1 is solved at step 4 and stage 2 spends its budget (step 12).
inline tasks::TaskRunConfig tiny_task_run(const std::string& dir, const std::string& out_dir) {
  tasks::TaskRunConfig c;
  c.model = write_task_model(dir, 32, 1, 2, 2, 64);
  c.task = "mqar";
  c.pool = 32;
  c.max_queries = 1;
  c.curriculum = {3, 8, 0.04};
  c.eval_every = 2;
  c.eval_examples = 50;
  c.batch_size = 4;
  c.lr = 1e-2;
  c.warmup = 3;
  c.device = "cpu";
  c.out_dir = out_dir;
  return c;
}

}  // namespace lt2::testing
