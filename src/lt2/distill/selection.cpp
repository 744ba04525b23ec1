#include "lt2/distill/selection.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>

#include "lt2/distill/losses.h"
#include "lt2/distill/stages.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/util/fs.h"

namespace lt2::distill {

namespace {

// Finished probes' KLs by key ("baseline", "shared/<layer>", "exhaustive/<layer>"), saved after each.
class ProbeLog {
 public:
  ProbeLog(std::string path, bool resume) : path_(std::move(path)) {
    if (resume && path_exists(path_)) log_ = load_json_file(path_);
  }
  bool has(const std::string& key) const { return log_.contains(key); }
  double get(const std::string& key) const { return log_[key].get<double>(); }
  void put(const std::string& key, double kl) {
    log_[key] = kl;
    write_file_atomic(path_, log_.dump(2) + "\n");
  }

 private:
  std::string path_;
  json log_ = json::object();
};

struct Context {
  LoopedLMImpl& teacher;
  const DistillConfig& cfg;
  std::string dir;  // <out>/select
  std::vector<int64_t> candidates;
  std::vector<double> weights;
  std::shared_ptr<const ShardReader> shard;  // held-out batches
  ProbeLog log;
  bool resume;
  StageResult last_probe = {};  // the latest probe: where the measurements run
};

// A stage-2 probe of `steps` steps from checkpoint `init` in <dir>/probe-<name>: its trained
// student's folder, and where it ran. With 0 steps, `init` itself, untrained.
StageResult probe(Context& c, const std::string& init, const std::string& name, const std::vector<int64_t>& linear,
                  int64_t steps) {
  TrainConfig t = c.cfg.stage_config(Stage::Select, c.dir);
  if (steps == 0) {
    c.last_probe.checkpoint = init;
    c.last_probe.device = training_device(t);
    c.last_probe.autocast = training_autocast(t, c.last_probe.device);
    return c.last_probe;
  }
  t.out_dir = c.dir + "/probe-" + name;
  t.init_from = init;
  t.steps = steps;
  t.warmup = std::min(t.warmup, t.steps / 4);
  t.eval_every = 0;
  t.save_every = 0;
  const double scale = t.lr > 0 ? c.cfg.kd_other_lr / t.lr : 0.0;
  const bool resume = c.resume && !latest_checkpoint(t.out_dir).empty();
  c.last_probe = run_kd(c.teacher, t, linear, c.weights, scale, resume, /*step_lines=*/false);
  return c.last_probe;
}

double measure(Context& c, LoopedLMImpl& student) {
  return held_out_kl(c.teacher, student, c.shard, c.cfg.stage_config(Stage::Select, c.dir), c.cfg.select.eval_batches,
                     c.weights, c.last_probe.device, c.last_probe.autocast);
}

std::vector<int64_t> without(const std::vector<int64_t>& v, int64_t x) {
  std::vector<int64_t> out;
  for (int64_t y : v)
    if (y != x) out.push_back(y);
  return out;
}

StudentOptions keeping(const StudentOptions& base, int64_t layer) {
  StudentOptions o = base;
  o.keep.insert(layer);
  return o;
}

// Adds layer `l`'s score to `r`: its KL from the probe log, or from `measure_layer` (then logged).
void add_score(Context& c, Ranking& r, int64_t l, const std::function<double()>& measure_layer) {
  const std::string key = r.method + "/" + std::to_string(l);
  if (!c.log.has(key)) c.log.put(key, measure_layer());
  r.scores.push_back({l, c.log.get(key), r.baseline_kl - c.log.get(key)});
  std::printf("select %-10s layer %3lld restored: KL %.5f (gain %+.5f)\n", r.method.c_str(), static_cast<long long>(l),
              r.scores.back().kl, r.scores.back().gain);
  std::fflush(stdout);
}

// A method's probe of the aligned student (`steps` steps): its KL (the method's baseline) and, when
// `probed` is given, the probed student.
double baseline(Context& c, const std::string& method, const std::string& aligned, int64_t steps,
                std::optional<LoopedLM>* probed) {
  const std::string key = method + "/baseline";
  if (c.log.has(key) && !probed) return c.log.get(key);
  const auto r = probe(c, aligned, method + "-baseline", c.candidates, steps);
  LoopedLM student = load_checkpoint(r.checkpoint);
  const double kl = measure(c, *student);
  c.log.put(key, kl);
  if (probed) *probed = student;
  remove_tree(c.dir + "/probe-" + method + "-baseline");
  std::printf("select %-10s no layer restored, after %lld probe steps: KL %.5f\n", method.c_str(),
              static_cast<long long>(steps), kl);
  return kl;
}

Ranking rank_shared(Context& c, const std::string& aligned) {
  const int64_t steps = c.cfg.select.shared_probe_steps;
  Ranking r;
  r.method = "shared";
  r.probe_steps = steps;
  // The probed student is needed whenever a layer is still to be scored.
  bool all_done = c.log.has("shared/baseline");
  for (int64_t l : c.candidates) all_done = all_done && c.log.has("shared/" + std::to_string(l));
  std::optional<LoopedLM> probed;
  r.baseline_kl = baseline(c, "shared", aligned, steps, all_done ? nullptr : &probed);
  r.probes = steps > 0 ? 1 : 0;
  r.evaluations = 1;
  for (int64_t l : c.candidates) {
    add_score(c, r, l, [&] {
      LoopedLM restored = hybrid_student(c.teacher, **probed, keeping(c.cfg.student, l));
      return measure(c, *restored);
    });
    ++r.evaluations;
  }
  return r;
}

Ranking rank_exhaustive(Context& c, const std::string& aligned) {
  const int64_t steps = c.cfg.select.probe_steps;
  Ranking r;
  r.method = "exhaustive";
  r.probe_steps = steps;
  r.baseline_kl = baseline(c, "exhaustive", aligned, steps, nullptr);
  LoopedLM start = load_checkpoint(aligned);
  for (int64_t l : c.candidates) {
    add_score(c, r, l, [&] {
      const std::string name = "layer-" + std::to_string(l), init = c.dir + "/init-" + name;
      save_checkpoint(init, hybrid_student(c.teacher, *start, keeping(c.cfg.student, l)));
      const auto trained = probe(c, init, name, without(c.candidates, l), steps);
      LoopedLM student = load_checkpoint(trained.checkpoint);
      const double kl = measure(c, *student);
      remove_tree(c.dir + "/probe-" + name);
      remove_tree(init);
      return kl;
    });
  }
  r.probes = steps > 0 ? static_cast<int64_t>(c.candidates.size()) + 1 : 0;
  r.evaluations = static_cast<int64_t>(c.candidates.size()) + 1;
  return r;
}

std::string fixed(double x, int digits = 5) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string list(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s.empty() ? "none" : s;
}

int64_t overlap(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  int64_t n = 0;
  for (int64_t x : a) n += std::count(b.begin(), b.end(), x);
  return n;
}

}  // namespace

std::vector<int64_t> top_layers(const std::vector<LayerScore>& scores, int64_t k) {
  std::vector<LayerScore> s = scores;
  std::stable_sort(s.begin(), s.end(), [](const LayerScore& a, const LayerScore& b) {
    return a.gain != b.gain ? a.gain > b.gain : a.layer < b.layer;
  });
  std::vector<int64_t> out;
  for (int64_t i = 0; i < std::min<int64_t>(k, s.size()); ++i) out.push_back(s[i].layer);
  std::sort(out.begin(), out.end());
  return out;
}

double spearman(const std::vector<LayerScore>& a, const std::vector<LayerScore>& b) {
  LT2_CHECK(a.size() == b.size() && !a.empty(), "spearman: expected two rankings of the same layers");
  auto ranks = [](const std::vector<LayerScore>& s) {
    std::vector<size_t> order(s.size());
    for (size_t i = 0; i < s.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return s[x].gain > s[y].gain; });
    std::vector<double> rank(s.size());
    for (size_t r = 0; r < order.size(); ++r) rank[order[r]] = static_cast<double>(r);
    return rank;
  };
  const auto ra = ranks(a), rb = ranks(b);
  const double n = static_cast<double>(a.size());
  if (a.size() == 1) return 1.0;
  double d2 = 0;
  for (size_t i = 0; i < a.size(); ++i) d2 += (ra[i] - rb[i]) * (ra[i] - rb[i]);
  return 1.0 - 6.0 * d2 / (n * (n * n - 1));
}

json Selection::to_json() const {
  json j{{"keep", keep}, {"k", k}, {"rankings", json::array()}};
  for (const auto& r : rankings) {
    json scores = json::array();
    for (const auto& s : r.scores) scores.push_back({{"layer", s.layer}, {"kl", s.kl}, {"gain", s.gain}});
    j["rankings"].push_back({{"method", r.method}, {"baseline_kl", r.baseline_kl}, {"probe_steps", r.probe_steps},
                             {"probes", r.probes},
                             {"evaluations", r.evaluations}, {"scores", scores}, {"chosen", r.chosen}});
  }
  if (rankings.size() == 2)
    j["comparison"] = {{"top_k_overlap", overlap(rankings[0].chosen, rankings[1].chosen)},
                       {"spearman", spearman(rankings[0].scores, rankings[1].scores)}};
  return j;
}

std::string Selection::markdown() const {
  std::ostringstream md;
  md << "# KL-guided layer selection\n\n"
     << "KL(teacher || student) on held-out batches with each layer alone restored to full attention, after "
        "the method's stage-2 probe (none at 0 steps); gain = KL with no layer restored - KL with the layer "
        "restored.\n\n";
  md << "| layer |";
  for (const auto& r : rankings) md << " KL (" << r.method << ") | gain (" << r.method << ") |";
  md << "\n| --- |";
  for (size_t i = 0; i < rankings.size(); ++i) md << " --- | --- |";
  md << "\n| none restored |";
  for (const auto& r : rankings) md << " " << fixed(r.baseline_kl) << " | |";
  md << "\n";
  for (size_t i = 0; i < (rankings.empty() ? 0 : rankings[0].scores.size()); ++i) {
    md << "| " << rankings[0].scores[i].layer << " |";
    for (const auto& r : rankings) md << " " << fixed(r.scores[i].kl) << " | " << fixed(r.scores[i].gain) << " |";
    md << "\n";
  }
  md << "\n| method | steps per probe | probes | KL evaluations | chosen (top " << k
     << ") |\n| --- | --- | --- | --- | --- |\n";
  for (const auto& r : rankings)
    md << "| " << r.method << " | " << r.probe_steps << " | " << r.probes << " | " << r.evaluations << " | "
       << list(r.chosen) << " |\n";
  if (rankings.size() == 2)
    md << "\nTop-" << k << " overlap " << overlap(rankings[0].chosen, rankings[1].chosen) << "/" << k
       << ", Spearman rank correlation of the gains " << fixed(spearman(rankings[0].scores, rankings[1].scores), 3)
       << ".\n";
  md << "\nKept full attention: " << list(keep) << ".\n";
  return md.str();
}

Selection select_layers(LoopedLMImpl& teacher, const std::string& aligned, const DistillConfig& cfg,
                        const std::string& out, bool resume) {
  const std::string dir = out + "/select";
  make_dirs(dir);
  const TrainConfig t = cfg.stage_config(Stage::Select, out);
  Context c{teacher, cfg, dir, converted_layers(teacher.config(), cfg.student.keep),
            loop_weights(teacher.config(), cfg.kd_loop_weights),
            std::make_shared<const ShardReader>(t.val_data.empty() ? t.train_data : t.val_data),
            ProbeLog(dir + "/probes.json", resume), resume};
  LT2_CHECK(!c.candidates.empty(), "select: the student converts no layer (every full-attention layer is kept)");
  Selection s;
  const int64_t n_keep = std::llround(cfg.student.keep_fraction * static_cast<double>(teacher.config().n_layers));
  s.k = std::clamp<int64_t>(n_keep - static_cast<int64_t>(cfg.student.keep.size()), 0, c.candidates.size());
  std::printf("select: %zu candidate layer(s), keeping %lld more full attention (method %s)\n", c.candidates.size(),
              static_cast<long long>(s.k),
              cfg.select.method == SelectMethod::Shared ? "shared"
              : cfg.select.method == SelectMethod::Exhaustive ? "exhaustive" : "both");
  if (cfg.select.method != SelectMethod::Exhaustive) s.rankings.push_back(rank_shared(c, aligned));
  if (cfg.select.method != SelectMethod::Shared) s.rankings.push_back(rank_exhaustive(c, aligned));
  for (auto& r : s.rankings) r.chosen = top_layers(r.scores, s.k);
  // The final choice: the published ranking where it ran, else the shared one.
  std::set<int64_t> keep = cfg.student.keep;
  for (int64_t l : s.rankings.back().chosen) keep.insert(l);
  s.keep.assign(keep.begin(), keep.end());
  write_file_atomic(dir + "/selection.json", s.to_json().dump(2) + "\n");
  write_file_atomic(dir + "/selection.md", s.markdown());
  std::printf("select: keep full attention in layers %s -> %s/selection.{json,md}\n", list(s.keep).c_str(), dir.c_str());
  return s;
}

std::vector<int64_t> selected_keep(const std::string& out) {
  const std::string path = out + "/select/selection.json";
  return json_require<std::vector<int64_t>>(load_json_file(path), "keep", "'" + path + "'");
}

}  // namespace lt2::distill
