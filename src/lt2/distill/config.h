// The configuration of `lt2 distill` (configs/distill.json): settings every stage shares, the
// student's shape, and each stage's training settings (TrainConfig fields) and extras.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "lt2/distill/student.h"
#include "lt2/train/train_config.h"

namespace lt2::distill {

enum class Stage { Align, Select, Kd, Long };
std::string to_string(Stage s);
// "align" | "select" | "kd" | "long"; "all" gives every stage in order.
std::vector<Stage> parse_stages(const std::string& name);

// How the selection ranks the layers (distill/selection.h).
//   shared:     every layer restored in turn on one model (the aligned student after
//               shared_probe_steps of stage 2) and the KL measured without more training
//   exhaustive: one stage-2 probe of probe_steps per restored layer (N + 1 probes), the published method
//   both:       both rankings, and how their choices compare
enum class SelectMethod { Shared, Exhaustive, Both };

struct SelectOptions {
  SelectMethod method = SelectMethod::Shared;
  int64_t probe_steps = 50;        // exhaustive: stage-2 steps of each probe (the kd section's settings otherwise)
  int64_t shared_probe_steps = 0;  // shared: stage-2 steps before the layers are scored (0: none)
  int64_t eval_batches = 4;        // held-out batches the KL of each candidate is measured on
};

struct DistillConfig {
  json train = json::object();  // TrainConfig fields every stage shares (data, device, seed, ...)
  StudentOptions student;
  json align = json::object(), kd = json::object(), long_context = json::object();  // per-stage TrainConfig fields
  SelectOptions select;
  double kd_other_lr = 7e-6;  // stage 2: learning rate of everything but the student mixers
  std::vector<double> kd_loop_weights;  // stage 2: per-loop weights (distill/losses.h: loop_weights)
  // stage 2: layers kept full attention; unset: the selection's choice when the select stage ran,
  // else student.keep.
  std::optional<std::vector<int64_t>> kd_keep;

  // The resolved TrainConfig of a stage (shared fields, then the stage's), out_dir under `out`.
  TrainConfig stage_config(Stage s, const std::string& out) const;
  json to_json() const;
  static DistillConfig from_json(const json& j, const std::string& where);
};

// The built-in defaults: configs/distill.json of the source tree (the preset folder's distill.json).
std::string default_distill_config_path();

}  // namespace lt2::distill
