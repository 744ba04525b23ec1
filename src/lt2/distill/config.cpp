#include "lt2/distill/config.h"

#include "lt2/config/presets.h"

namespace lt2::distill {

namespace {

const std::vector<std::pair<Stage, std::string>> kStageNames{
    {Stage::Align, "align"}, {Stage::Select, "select"}, {Stage::Kd, "kd"}, {Stage::Long, "long"}};

const std::vector<std::pair<SelectMethod, std::string>> kMethodNames{
    {SelectMethod::Shared, "shared"}, {SelectMethod::Exhaustive, "exhaustive"}, {SelectMethod::Both, "both"}};

json object_field(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) return json::object();
  LT2_CHECK(j[key].is_object(), where, ": field '", key, "' must be an object, found ", json_describe(j[key]));
  return j[key];
}

// A stage section: TrainConfig fields, plus `extras` (the stage's own settings) split off into `own`.
json train_fields(json section, const std::vector<std::string>& extras, json& own) {
  own = json::object();
  for (const auto& key : extras)
    if (section.contains(key)) {
      own[key] = section[key];
      section.erase(key);
    }
  return section;
}

}  // namespace

std::string to_string(Stage s) {
  for (const auto& [stage, name] : kStageNames)
    if (stage == s) return name;
  return "?";
}

std::vector<Stage> parse_stages(const std::string& name) {
  if (name == "all") return {Stage::Align, Stage::Select, Stage::Kd, Stage::Long};
  for (const auto& [stage, n] : kStageNames)
    if (n == name) return {stage};
  throw Error(cat("distill: unknown stage '", name, "' (expected align, select, kd, long or all)"));
}

TrainConfig DistillConfig::stage_config(Stage s, const std::string& out) const {
  json j = train;
  const json& section = s == Stage::Align ? align : s == Stage::Kd || s == Stage::Select ? kd : long_context;
  for (const auto& [key, value] : section.items()) j[key] = value;
  j["out_dir"] = out + "/" + to_string(s);
  return TrainConfig::from_json(j, "distill config, stage '" + to_string(s) + "'");
}

json DistillConfig::to_json() const {
  std::string method;
  for (const auto& [m, name] : kMethodNames)
    if (m == select.method) method = name;
  json k = kd;
  k["other_lr"] = kd_other_lr;
  k["loop_weights"] = kd_loop_weights;
  if (kd_keep) k["keep"] = *kd_keep;
  return json{{"train", train},
              {"student", student.to_json()},
              {"align", align},
              {"select", {{"method", method}, {"probe_steps", select.probe_steps},
                          {"shared_probe_steps", select.shared_probe_steps}, {"eval_batches", select.eval_batches}}},
              {"kd", k},
              {"long", long_context}};
}

DistillConfig DistillConfig::from_json(const json& j, const std::string& where) {
  LT2_CHECK(j.is_object(), where, ": expected a JSON object, found ", json_describe(j));
  json_reject_unknown(j, {"train", "student", "align", "select", "kd", "long", "comment"}, where);
  DistillConfig c;
  c.train = object_field(j, "train", where);
  c.student = StudentOptions::from_json(object_field(j, "student", where), where + ": student");
  c.align = object_field(j, "align", where);
  c.long_context = object_field(j, "long", where);
  json kd_own;
  c.kd = train_fields(object_field(j, "kd", where), {"other_lr", "loop_weights", "keep"}, kd_own);
  const std::string kd_where = where + ": kd";
  json_get(kd_own, "other_lr", c.kd_other_lr, kd_where);
  LT2_CHECK(c.kd_other_lr >= 0, kd_where, ": other_lr must be >= 0, found ", c.kd_other_lr);
  json_get(kd_own, "loop_weights", c.kd_loop_weights, kd_where);
  if (kd_own.contains("keep") && !kd_own["keep"].is_null())
    c.kd_keep = json_as<std::vector<int64_t>>(kd_own["keep"], kd_where + ": field 'keep'");
  const json sel = object_field(j, "select", where);
  const std::string sel_where = where + ": select";
  json_reject_unknown(sel, {"method", "probe_steps", "shared_probe_steps", "eval_batches", "comment"}, sel_where);
  std::string method = "shared";
  json_get(sel, "method", method, sel_where);
  bool known = false;
  for (const auto& [m, name] : kMethodNames)
    if (name == method) c.select.method = m, known = true;
  LT2_CHECK(known, sel_where, ": method must be shared, exhaustive or both, found '", method, "'");
  json_get(sel, "probe_steps", c.select.probe_steps, sel_where);
  json_get(sel, "shared_probe_steps", c.select.shared_probe_steps, sel_where);
  json_get(sel, "eval_batches", c.select.eval_batches, sel_where);
  LT2_CHECK(c.select.probe_steps >= 0 && c.select.shared_probe_steps >= 0, sel_where,
            ": probe_steps and shared_probe_steps must be >= 0 (0: no probe), found ", c.select.probe_steps, " and ",
            c.select.shared_probe_steps);
  LT2_CHECK(c.select.eval_batches >= 1, sel_where, ": eval_batches must be >= 1, found ", c.select.eval_batches);
  // Every stage's settings must make a valid TrainConfig: checked now, not stages later. (Each stage
  // starts from a checkpoint the pipeline names; the training data may still come from a flag.)
  for (Stage s : {Stage::Align, Stage::Kd, Stage::Long}) {  // the selection's probes take the kd settings
    TrainConfig t = c.stage_config(s, "check");
    t.init_from = "(the stage's starting checkpoint)";
    try {
      t.validate(/*needs_train_data=*/false);
    } catch (const Error& e) {
      throw Error(cat(where, ": stage '", to_string(s), "': ", e.what()));
    }
  }
  return c;
}

std::string default_distill_config_path() { return preset_dir() + "/distill/default.json"; }

}  // namespace lt2::distill
