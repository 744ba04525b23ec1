// lt2 eval ppl | mc | niah: perplexity, zero-shot multiple choice and needle-in-a-haystack in
// lm-evaluation-harness's and RULER's conventions (src/lt2/eval/).
#include <cstdio>
#include <fstream>

#include "commands.h"
#include "lt2/eval/niah.h"
#include "lt2/eval/perplexity.h"
#include "lt2/eval/tasks.h"
#include "lt2/util/fs.h"

namespace lt2::cli {

eval::LoopOptions LoopFlags::options() const {
  LT2_CHECK(exit_rule == "lt2" || exit_rule == "published", "--exit-rule must be lt2 or published, found '", exit_rule,
            "'");
  LT2_CHECK(exits == "final" || exits == "all", "--exits must be final or all, found '", exits, "'");
  eval::LoopOptions o;
  o.loops = loops;
  o.exit_step = exit_step;
  o.exit_threshold = exit_threshold;
  o.exit_rule_published = exit_rule == "published";
  o.all_exits = exits == "all";
  return o;
}

void add_loop_flags(CLI::App* cmd, LoopFlags& f, bool with_exits) {
  cmd->add_option("--loops", f.loops, "Run only the first T' loops (fewer than trained; default: all)");
  cmd->add_option("--exit-step", f.exit_step, "Ouro form: every token takes this loop's exit (1-based)");
  cmd->add_option("--exit-threshold", f.exit_threshold,
                  "Ouro form: exit at the first loop whose cumulative exit probability reaches q (default: the config's "
                  "early_exit_threshold)");
  cmd->add_option("--exit-rule", f.exit_rule,
                  "Ouro form: lt2 (cumulative probability in fp32; q = 1 always takes the last loop) | published "
                  "(compared in the model dtype as Ouro's released code does: at q = 1 a token can exit early where "
                  "the remaining probability rounds away)")
      ->capture_default_str();
  if (with_exits)
    cmd->add_option("--exits", f.exits,
                    "final (the exit chosen by the settings above) | all (every loop's exit: one column per loop, for "
                    "quality against loop depth)")
        ->capture_default_str();
}

namespace {

// Flags every `lt2 eval` mode takes.
struct CommonFlags {
  eval::ModelSource source;
  LoopFlags loops;
  std::string prefix_token, out_md;
  bool json_out = false, quiet = false;
};

void add_common_flags(CLI::App* cmd, CommonFlags& f) {
  cmd->add_option("model", f.source.model,
                  "Model: a preset name (configs/*.json; random weights), a model-config JSON (random weights), or a "
                  "checkpoint folder (ours or Ouro)")
      ->required();
  cmd->add_option("--tokenizer", f.source.tokenizer,
                  "tokenizer.json, or a folder with tokenizer.json or vocab.json + merges.txt (default: the "
                  "checkpoint's; required for presets and configs)");
  cmd->add_option("--device", f.source.device, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--dtype", f.source.dtype, "auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16")->capture_default_str();
  cmd->add_option("--init-seed", f.source.seed, "Seed of the random weights of presets and configs")
      ->capture_default_str()
      ->check(at_least(0));
  add_loop_flags(cmd, f.loops, /*with_exits=*/true);
  cmd->add_flag("--json", f.json_out, "Print one JSON object on stdout instead of the Markdown table");
  cmd->add_option("--out-md", f.out_md, "Also write the Markdown table to this file");
  cmd->add_flag("--quiet", f.quiet, "No progress line on stderr");
}

// Prints the result: JSON or the Markdown table on stdout, and the table to --out-md.
void report(const CommonFlags& f, const json& j, const std::string& markdown) {
  if (!f.out_md.empty()) write_file_atomic(f.out_md, markdown);
  std::printf("%s\n", f.json_out ? j.dump(2).c_str() : markdown.c_str());
}

json model_json(const CommonFlags& f, const eval::LoadedModel& m) {
  return {{"model", f.source.model}, {"config", m.model->config().name}, {"random_weights", m.random_weights},
          {"dtype", c10::toString(m.model->parameters().front().scalar_type())},
          {"device", m.model->parameters().front().device().str()}};
}

struct ScoreFlags {
  std::optional<int64_t> max_length, limit;
  int64_t batch_tokens = 8192;
};

void add_score_flags(CLI::App* cmd, ScoreFlags& f) {
  cmd->add_option("--max-length", f.max_length, "Tokens per model input (default: the config's max_seq_len)");
  cmd->add_option("--batch-tokens", f.batch_tokens, "Padded tokens per forward (requests sorted by length, padded right; the logits of that many tokens are held at once)")
      ->capture_default_str();
  cmd->add_option("--limit", f.limit, "Only the first N documents / items (default: all)")->check(at_least(0));
}

eval::ScorerOptions scorer_options(const ScoreFlags& f, const CommonFlags& c, const ModelConfig& cfg) {
  eval::ScorerOptions o;
  o.max_length = f.max_length.value_or(cfg.max_seq_len);
  o.batch_tokens = f.batch_tokens;
  o.loops = c.loops.options();
  return o;
}

// ---- ppl ----

struct PplArgs {
  CommonFlags common;
  ScoreFlags score;
  std::string data, per_token;
  eval::DocumentOptions docs;
};

void run_ppl(const PplArgs& a) {
  auto m = eval::load_model(a.common.source);
  auto docs = eval::read_documents(a.data, a.docs, m.tokenizer);
  if (a.score.limit && static_cast<int64_t>(docs.size()) > *a.score.limit) docs.resize(*a.score.limit);
  eval::Scorer scorer(*m.model, scorer_options(a.score, a.common, m.model->config()));
  const int32_t prefix = eval::prefix_token(m.tokenizer, a.common.prefix_token);
  std::unique_ptr<std::ofstream> per_token;
  const std::string per_token_tmp = a.per_token + ".tmp";
  if (!a.per_token.empty()) {
    per_token = std::make_unique<std::ofstream>(per_token_tmp);
    LT2_CHECK(*per_token, "cannot write '", per_token_tmp, "'");
  }
  auto res = eval::evaluate_perplexity(scorer, m.tokenizer, docs, prefix, per_token.get(), a.common.quiet);
  if (per_token) {
    per_token->close();
    LT2_CHECK(*per_token && std::rename(per_token_tmp.c_str(), a.per_token.c_str()) == 0, "cannot write '",
              a.per_token, "'");
  }
  json j = res.to_json();
  j["data"] = a.data;
  j["max_length"] = scorer.options().max_length;
  j["model"] = model_json(a.common, m);
  report(a.common, j, "**" + a.data + "**" + (a.docs.wikitext ? " (wikitext)" : "") + "\n\n" + res.markdown());
}

// ---- mc ----

struct McArgs {
  CommonFlags common;
  ScoreFlags score;
  std::string task, data, data_dir;
  std::vector<std::string> tasks;
};

void run_mc(const McArgs& a) {
  std::vector<std::string> names = a.tasks;
  if (!a.task.empty()) names.insert(names.begin(), a.task);
  if (names.size() == 1 && names[0] == "all") {
    names.clear();
    for (const auto& s : eval::task_specs()) names.push_back(s.name);
  }
  LT2_CHECK(!names.empty(), "give --task NAME --data FILE, or --tasks a,b,c --data-dir DIR");
  LT2_CHECK(a.data.empty() || names.size() == 1, "--data names one file: give one task, or --data-dir for several");
  LT2_CHECK(!a.data.empty() || !a.data_dir.empty(), "give the data: --data FILE (one task) or --data-dir DIR");
  // Every task's data is read and formatted before the model loads, so bad input fails fast.
  std::vector<std::pair<const eval::TaskSpec*, std::vector<eval::McItem>>> tasks;
  for (const auto& n : names) {
    const auto& spec = eval::find_task(n);
    tasks.emplace_back(&spec, eval::load_task(spec, a.data.empty() ? eval::find_task_file(spec, a.data_dir) : a.data,
                                              a.score.limit.value_or(-1)));
  }
  auto m = eval::load_model(a.common.source);
  eval::Scorer scorer(*m.model, scorer_options(a.score, a.common, m.model->config()));
  const int32_t prefix = eval::prefix_token(m.tokenizer, a.common.prefix_token);
  std::vector<eval::TaskResult> results;
  json per_task = json::array();
  for (const auto& [spec, items] : tasks) {
    auto ll = eval::model_loglikelihood(scorer, m.tokenizer, prefix, spec->name, a.common.quiet);
    results.push_back(eval::score_task(*spec, items, ll, scorer.exit_names()));
    per_task.push_back(results.back().to_json());
  }
  json j{{"tasks", per_task}, {"model", model_json(a.common, m)}, {"max_length", scorer.options().max_length}};
  if (results.size() > 1) j["average"] = eval::average_primary(results);
  report(a.common, j, eval::tasks_markdown(results));
}

// ---- niah ----

struct NiahArgs {
  CommonFlags common;
  eval::NiahOptions opts;
  std::string haystack, plot;
};

void run_niah(NiahArgs a) {
  auto m = eval::load_model(a.common.source);
  LT2_CHECK(a.opts.task == "s-niah-1" || !a.haystack.empty(), a.opts.task,
            " puts the needle in an essay: give --haystack FILE|FOLDER (any text)");
  eval::NiahGenerator gen(a.opts.task, m.tokenizer, a.haystack.empty() ? "" : eval::read_haystack(a.haystack));
  a.opts.loops = a.common.loops.options();
  auto res = eval::run_niah(m.model, m.tokenizer, gen, a.opts, a.common.quiet);
  json j = res.to_json();
  j["model"] = model_json(a.common, m);
  if (!a.plot.empty() && !res.plot(a.plot)) std::fprintf(stderr, "note: gnuplot is not installed; no %s\n", a.plot.c_str());
  report(a.common, j, res.markdown());
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Evaluate a model: perplexity, zero-shot multiple choice, needle-in-a-haystack");
  cmd->require_subcommand(1);

  auto pa = std::make_shared<PplArgs>();
  auto* ppl = cmd->add_subcommand("ppl", "Perplexity by rolling windows (lm-evaluation-harness loglikelihood_rolling): "
                                         "token, word and byte perplexity and bits per byte");
  add_common_flags(ppl, pa->common);
  add_score_flags(ppl, pa->score);
  ppl->add_option("--data", pa->data, "Plain text (one document), JSONL (one document a line), or an `lt2 data` shard")
      ->required();
  ppl->add_option("--field", pa->docs.field, "JSONL: the field holding each document")->capture_default_str();
  ppl->add_flag("--wikitext", pa->docs.wikitext,
                "Plain text is raw WikiText: split it into articles at ' = Title = ' lines and detokenise each as the "
                "harness's wikitext task does (words and bytes counted before detokenising)");
  ppl->add_option("--separator", pa->docs.separator, "Shards: the token between documents")->capture_default_str();
  ppl->add_option("--prefix-token", pa->common.prefix_token,
                  "Token before each document (default: <|begin_of_text|>, <s>, <|endoftext|> or </s>, the first the "
                  "tokenizer has)");
  ppl->add_option("--per-token", pa->per_token,
                  "Write each token's log-probability to this JSONL file: doc, index, token (id), text, logprob (an "
                  "array, one per loop, with --exits all)");
  ppl->callback([pa] { run_ppl(*pa); });

  auto ma = std::make_shared<McArgs>();
  std::string task_list;
  for (const auto& s : eval::task_specs()) task_list += "\n  " + s.name + ": " + s.prompt + "  (" + s.files[0] + ")";
  auto* mc = cmd->add_subcommand("mc", "Zero-shot multiple choice (and LAMBADA) as lm-evaluation-harness scores them: "
                                       "acc = argmax of the summed log-likelihood, acc_norm = argmax of sum / characters");
  add_common_flags(mc, ma->common);
  add_score_flags(mc, ma->score);
  mc->add_option("--task", ma->task, "One task (see below)");
  mc->add_option("--data", ma->data, "The task's data file (its original release format)");
  mc->add_option("--tasks", ma->tasks, "Several tasks, comma-separated, or 'all' (with --data-dir); prints their "
                                       "average")->delimiter(',');
  mc->add_option("--data-dir", ma->data_dir, "A folder with each task's file at the path listed below");
  mc->add_option("--prefix-token", ma->common.prefix_token, "Token standing for an empty context (default as for ppl)");
  mc->footer("Tasks (context -> continuation; default file under --data-dir):" + task_list);
  mc->callback([ma] { run_mc(*ma); });

  auto na = std::make_shared<NiahArgs>();
  auto* niah = cmd->add_subcommand("niah", "Needle in a haystack (RULER's S-NIAH-1/2/3): exact match per context length "
                                           "and needle depth, greedy decoding through the inference engine");
  add_common_flags(niah, na->common);
  niah->add_option("--task", na->opts.task, "s-niah-1 (number in repeated noise) | s-niah-2 (number in an essay) | "
                                            "s-niah-3 (UUID in an essay)")->capture_default_str();
  niah->add_option("--haystack", na->haystack, "Essay text for s-niah-2/3: a file, or a folder of .txt files");
  niah->add_option("--lengths", na->opts.lengths, "Context lengths in tokens (prompt + generated)")
      ->delimiter(',')->capture_default_str();
  niah->add_option("--depths", na->opts.depths, "Needle depths in % (0 = start, 100 = end)")
      ->delimiter(',')->capture_default_str();
  niah->add_option("--samples", na->opts.samples, "Samples per (length, depth)")->capture_default_str();
  niah->add_option("--seed", na->opts.seed, "Seed of the keys and values")->capture_default_str()->check(at_least(0));
  niah->add_option("--max-new-tokens", na->opts.max_new_tokens, "Greedy tokens generated per sample")->capture_default_str();
  niah->add_option("--batch", na->opts.batch, "Sequences decoded together")->capture_default_str();
  niah->add_option("--plot", na->plot, "Write a PNG heatmap (gnuplot) of the scores");
  niah->callback([na] { run_niah(*na); });
}

}  // namespace lt2::cli
