#include "lt2/tasks/sweep.h"

#include <cctype>
#include <chrono>
#include <deque>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "lt2/tasks/report.h"
#include "lt2/util/fs.h"
#include "lt2/util/gnuplot.h"
#include "lt2/util/process.h"

namespace lt2::tasks {

namespace {

std::string cell_label(const SweepCell& c) { return cat(c.model.label, " T=", c.n_loops); }

// The last non-empty line of a file ("" when absent).
std::string last_line(const std::string& path) {
  if (!path_exists(path)) return "";
  std::istringstream in(read_file(path));
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

std::string format_fixed(double v, int digits) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(digits);
  s << v;
  return s.str();
}

}  // namespace

SweepModel parse_sweep_model(const std::string& spec) {
  LT2_CHECK(!spec.empty(), "a sweep model must be 'label=model' or 'model', found an empty string");
  SweepModel m;
  const auto eq = spec.find('=');
  m.model = eq == std::string::npos ? spec : spec.substr(eq + 1);
  m.label = eq == std::string::npos ? std::filesystem::path(spec).stem().string() : spec.substr(0, eq);
  LT2_CHECK(!m.label.empty() && !m.model.empty(), "a sweep model must be 'label=model' or 'model', found '", spec, "'");
  for (char c : m.label)
    LT2_CHECK(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.',
              "sweep model label '", m.label, "' may hold only letters, digits, '-', '_' and '.'");
  return m;
}

SweepModel pattern_sweep_model(const std::string& base_model, const std::string& pattern) {
  LT2_CHECK(!pattern.empty(), "a sweep pattern must not be empty");
  SweepModel m{pattern, base_model, pattern};
  for (char& c : m.label)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.')) c = '_';
  return m;
}

void SweepConfig::validate() const {
  LT2_CHECK(!models.empty(), "sweep: no models (give --models and/or --patterns)");
  LT2_CHECK(!loops.empty(), "sweep: no loop counts (give --loops, e.g. 1,2,4,8)");
  for (int64_t t : loops) LT2_CHECK(t >= 1, "sweep: loop counts must be >= 1, found ", t);
  LT2_CHECK(jobs >= 1, "sweep: --jobs must be >= 1, found ", jobs);
  LT2_CHECK(threads_per_run >= 0, "sweep: --threads must be >= 0, found ", threads_per_run);
  LT2_CHECK(max_seconds >= 0, "sweep: --max-seconds must be >= 0, found ", max_seconds);
  base.validate();
}

std::vector<SweepCell> sweep_cells(const SweepConfig& cfg) {
  cfg.validate();
  std::set<std::string> labels;
  std::set<int64_t> loops;
  for (const auto& m : cfg.models)
    LT2_CHECK(labels.insert(m.label).second, "sweep: two models share the label '", m.label, "'");
  for (int64_t t : cfg.loops) LT2_CHECK(loops.insert(t).second, "sweep: loop count ", t, " is listed twice");
  std::vector<SweepCell> cells;
  for (const auto& m : cfg.models)
    for (int64_t t : cfg.loops) {
      SweepCell c{m, t, cfg.base};
      c.run.model = m.model;
      c.run.pattern = m.pattern;
      c.run.n_loops = t;
      c.run.out_dir = cat(cfg.base.out_dir, "/", m.label, "/T", t);
      cells.push_back(c);
    }
  return cells;
}

json sweep_table(const SweepConfig& cfg) {
  json runs = json::array();
  for (const auto& c : sweep_cells(cfg)) {
    json r{{"label", c.model.label}, {"model", c.model.model}, {"pattern", c.model.pattern},
           {"n_loops", c.n_loops}, {"out_dir", c.run.out_dir}};
    const json res = read_results(c.run.out_dir);
    if (res.is_null()) {
      r["status"] = "missing";
    } else {
      for (const char* key : {"status", "n_max", "step", "stages", "evals", "train_seconds", "ms_per_step"})
        r[key] = res.at(key);
      r["layer_pattern"] = res.at("model").at("layer_pattern");
      r["parameters"] = res.at("model").at("parameters");
      if (res.contains("current_stage")) r["current_stage"] = res["current_stage"];
    }
    runs.push_back(r);
  }
  json models = json::array();
  for (const auto& m : cfg.models) models.push_back({{"label", m.label}, {"model", m.model}, {"pattern", m.pattern}});
  return {{"task", cfg.base.task},
          {"num_stages", cfg.base.curriculum.num_stages},
          {"steps_per_stage", cfg.base.curriculum.steps_per_stage},
          {"threshold", cfg.base.curriculum.threshold},
          {"eval_every", cfg.base.eval_every},
          {"eval_examples", cfg.base.eval_examples},
          {"batch_size", cfg.base.batch_size},
          {"lr", cfg.base.lr},
          {"max_seconds_per_run", cfg.max_seconds},
          {"loops", cfg.loops},
          {"models", models},
          {"runs", runs}};
}

std::string sweep_markdown(const json& table) {
  const int64_t num_stages = table.at("num_stages").get<int64_t>();
  std::ostringstream s;
  s << "Task " << table.at("task").get<std::string>() << ": stage k has n = 2^(k+2); a stage is solved at "
    << "exact match >= " << table.at("threshold").get<double>() << " on " << table.at("eval_examples")
    << " held-out examples (evaluated every " << table.at("eval_every") << " steps); budget "
    << table.at("steps_per_stage") << " steps per stage, batch " << table.at("batch_size") << ", lr "
    << table.at("lr").get<double>() << ".\n\n";

  // n_max per (model, T).
  std::map<std::pair<std::string, int64_t>, const json*> by_cell;
  for (const auto& r : table.at("runs"))
    by_cell[{r.at("label").get<std::string>(), r.at("n_loops").get<int64_t>()}] = &r;
  auto n_max_cell = [](const json& r) -> std::string {
    const std::string status = r.at("status").get<std::string>();
    if (status == "missing") return "—";
    if (status == "failed") return "err";
    return std::to_string(r.at("n_max").get<int64_t>()) + (status == "finished" ? "" : "*");
  };
  s << "n_max (largest n solved; 0 = none)\n\n| model |";
  for (const auto& t : table.at("loops")) s << " T=" << t.get<int64_t>() << " |";
  s << "\n| --- |";
  for (size_t i = 0; i < table.at("loops").size(); ++i) s << " ---: |";
  s << "\n";
  for (const auto& m : table.at("models")) {
    const std::string label = m.at("label").get<std::string>();
    s << "| " << label << " |";
    for (const auto& t : table.at("loops")) {
      auto it = by_cell.find({label, t.get<int64_t>()});
      s << " " << (it == by_cell.end() ? "—" : n_max_cell(*it->second)) << " |";
    }
    s << "\n";
  }
  s << "\n`*` not finished (stopped at its time limit: running the sweep again resumes it); "
       "`err` the run failed (see its log.txt); `—` not run.\n\n";

  // Steps per stage, one row per run.
  s << "Steps per stage: the steps it took to solve; `x` the budget spent without solving it, `…` in "
       "progress; unsolved stages show their last exact match / per-answer accuracy\n\n| model | T | n_max |";
  for (int64_t k = 1; k <= num_stages; ++k) s << " n=" << stage_n(k) << " |";
  s << " steps | train s | ms/step | status |\n| --- | ---: | ---: |";
  for (int64_t k = 1; k <= num_stages; ++k) s << " ---: |";
  s << " ---: | ---: | ---: | --- |\n";
  for (const auto& r : table.at("runs")) {
    const std::string status = r.at("status").get<std::string>();
    s << "| " << r.at("label").get<std::string>() << " | " << r.at("n_loops") << " | " << n_max_cell(r) << " |";
    // The last evaluation of stage k as "exact/answers" ("" before its first).
    auto last_eval = [&](int64_t k) -> std::string {
      std::string last;
      for (const auto& e : r.at("evals"))
        if (e.at("stage").get<int64_t>() == k) {
          const auto rec = eval_record_from_json(e);
          last = format_fixed(rec.accuracy, 2) + "/" + format_fixed(rec.answer_accuracy, 2);
        }
      return last;
    };
    std::vector<std::string> cols(num_stages);
    if (r.contains("stages"))
      for (const auto& st : r.at("stages")) {
        const auto res = stage_result_from_json(st);
        if (res.stage >= 1 && res.stage <= num_stages)
          cols[res.stage - 1] = res.solved ? std::to_string(res.steps) : "x " + last_eval(res.stage);
      }
    if (r.contains("current_stage")) {
      const int64_t k = r.at("current_stage").at("stage").get<int64_t>();
      if (k >= 1 && k <= num_stages) cols[k - 1] = "… " + last_eval(k);
    }
    for (const auto& c : cols) s << " " << c << " |";
    if (r.contains("step"))
      s << " " << r.at("step") << " | " << format_fixed(r.at("train_seconds").get<double>(), 1) << " | "
        << format_fixed(r.at("ms_per_step").get<double>(), 1) << " |";
    else
      s << " | | |";
    s << " " << status << " |\n";
  }
  return s.str();
}

json run_sweep(const SweepConfig& cfg, const std::string& lt2_exe, std::FILE* log) {
  const auto cells = sweep_cells(cfg);
  auto say = [&](const std::string& line) {
    if (!log) return;
    std::fprintf(log, "%s\n", line.c_str());
    std::fflush(log);
  };

  // Check every cell before starting any: a folder holding another run's config is an error.
  std::vector<std::string> conflicts;
  std::deque<size_t> todo;
  for (size_t i = 0; i < cells.size(); ++i) {
    const auto& c = cells[i];
    const std::string config_path = c.run.out_dir + "/run_config.json";
    if (path_exists(config_path)) {
      const auto stored = TaskRunConfig::from_json(load_json_file(config_path), "'" + config_path + "'");
      for (const auto& d : run_config_differences(stored, c.run)) conflicts.push_back(cat(c.run.out_dir, ": ", d));
    }
    const json res = read_results(c.run.out_dir);
    if (!res.is_null() && res.value("status", "") == "finished") continue;
    todo.push_back(i);
  }
  std::string listed;
  for (const auto& c : conflicts) listed += "\n  " + c;
  LT2_CHECK(conflicts.empty(), "sweep: run folders under '", cfg.base.out_dir,
            "' hold runs with other settings (choose another --out, or the same settings):", listed);
  say(cat("sweep: ", cells.size(), " runs (", cells.size() - todo.size(), " already finished), ",
          cfg.jobs, " at a time -> ", cfg.base.out_dir));

  struct Running {
    size_t cell;
    Process child;
  };
  std::vector<Running> running;
  std::map<size_t, std::string> failures;  // cell -> what went wrong
  size_t started = 0;
  const size_t total = todo.size();
  while (!todo.empty() || !running.empty()) {
    while (!todo.empty() && static_cast<int>(running.size()) < cfg.jobs) {
      const size_t i = todo.front();
      todo.pop_front();
      const auto& c = cells[i];
      make_dirs(c.run.out_dir);
      const bool resume = path_exists(c.run.out_dir + "/latest");
      if (!resume) write_file_atomic(c.run.out_dir + "/run_config.json", c.run.to_json().dump(2) + "\n");
      std::vector<std::string> argv{lt2_exe, "tasks", "run", "--config", c.run.out_dir + "/run_config.json"};
      if (resume) argv.push_back("--resume");
      if (cfg.max_seconds > 0) {
        argv.push_back("--max-seconds");
        argv.push_back(cat(cfg.max_seconds));
      }
      if (cfg.threads_per_run > 0) {
        argv.push_back("--threads");
        argv.push_back(std::to_string(cfg.threads_per_run));
      }
      SpawnOptions opts;
      opts.output = c.run.out_dir + "/log.txt";
      opts.append = true;
      running.push_back({i, Process::spawn(argv, opts)});
      say(cat("[", ++started, "/", total, "] start ", cell_label(c), resume ? " (resume)" : "", " -> ",
              c.run.out_dir, "/log.txt"));
    }
    std::vector<Process*> children;
    for (auto& r : running) children.push_back(&r.child);
    const int done = wait_any(children);
    LT2_CHECK(done >= 0, "sweep: lost track of the running cells");
    const size_t cell = running[done].cell;
    const auto& c = cells[cell];
    const Process& child = running[done].child;
    if (child.status().ok()) {
      const json res = read_results(c.run.out_dir);
      say(cat("done  ", cell_label(c), ": ", res.value("status", "?"), ", n_max ", res.value("n_max", 0),
              ", ", res.value("step", 0), " steps, ", format_fixed(child.seconds(), 1), " s"));
    } else {
      const ExitStatus& st = child.status();
      const std::string why = st.exited() ? cat("exit ", st.code()) : cat("signal ", st.signal());
      failures[cell] = cat(why, ": ", last_line(c.run.out_dir + "/log.txt"));
      say(cat("FAIL  ", cell_label(c), " (", failures[cell], ")"));
    }
    running.erase(running.begin() + done);
  }

  json table = sweep_table(cfg);
  for (const auto& [i, why] : failures) {
    table["runs"][i]["status"] = "failed";
    table["runs"][i]["error"] = why;
  }
  write_file_atomic(cfg.base.out_dir + "/sweep.json", table.dump(2) + "\n");
  write_file_atomic(cfg.base.out_dir + "/sweep.md", sweep_markdown(table));

  std::vector<CurvePanel> panels;
  for (const auto& m : cfg.models) {
    CurvePanel p{m.label, {}, {}};
    for (const auto& r : table.at("runs")) {
      if (r.at("label") != m.label || !r.contains("evals")) continue;
      p.labels.push_back(cat("T=", r.at("n_loops").get<int64_t>()));
      p.evals.emplace_back();
      for (const auto& e : r.at("evals")) p.evals.back().push_back(eval_record_from_json(e));
    }
    panels.push_back(p);
  }
  if (find_gnuplot().empty())
    say("gnuplot not found: no curves.png (sweep.json holds every curve)");
  else
    plot_learning_curves(cfg.base.out_dir + "/curves.png", panels, cfg.base.curriculum.threshold);
  return table;
}

}  // namespace lt2::tasks
