#include "lt2/eval/niah.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "lt2/eval/progress.h"
#include "lt2/eval/text.h"
#include "lt2/infer/engine.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "lt2/util/gnuplot.h"
#include "lt2/util/hash.h"

namespace lt2::eval {

namespace {

const char* kNoise[] = {"The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                        "There and back again."};

// Key words: RULER draws adjective-noun pairs from wonderwords' lists; these are lt2's own.
const char* kAdjectives[] = {"abundant", "ancient", "bitter", "brave", "bright", "calm", "clever", "cold",
                             "curious", "damp", "eager", "early", "elegant", "faint", "fancy", "fierce",
                             "fragile", "gentle", "giant", "glossy", "grumpy", "hollow", "humble", "icy",
                             "jolly", "kind", "lazy", "lively", "loud", "lucky", "mellow", "misty",
                             "modern", "narrow", "noisy", "odd", "pale", "polite", "proud", "quiet",
                             "rapid", "rare", "rough", "rusty", "shiny", "silent", "sleepy", "slow",
                             "smooth", "soft", "solid", "spicy", "steep", "sticky", "sturdy", "sunny",
                             "tall", "tame", "tidy", "tiny", "vast", "warm", "wild", "young"};
const char* kNouns[] = {"anchor", "apple", "badge", "basket", "beacon", "bicycle", "blanket", "bottle",
                        "bridge", "bucket", "cabin", "camera", "candle", "canyon", "castle", "cellar",
                        "chair", "cloud", "comet", "compass", "cottage", "crystal", "desert", "dragon",
                        "drum", "engine", "falcon", "feather", "forest", "fountain", "garden", "glacier",
                        "hammer", "harbor", "helmet", "island", "jacket", "kettle", "lantern", "ladder",
                        "meadow", "mirror", "monkey", "needle", "ocean", "orchard", "palace", "pencil",
                        "pillow", "planet", "pocket", "puzzle", "rabbit", "river", "saddle", "shadow",
                        "spoon", "statue", "thunder", "tiger", "tower", "violin", "wagon", "window"};

std::string value_of(const std::string& task, std::mt19937_64& rng) {
  if (task != "s-niah-3") return std::to_string(std::uniform_int_distribution<int64_t>(1000000, 9999999)(rng));
  // uuid.UUID(int=random.getrandbits(128), version=4): version nibble 4, variant bits 10.
  uint8_t b[16];
  for (int i = 0; i < 16; i += 8) {
    const uint64_t r = rng();
    for (int j = 0; j < 8; ++j) b[i + j] = static_cast<uint8_t>(r >> (8 * j));
  }
  b[6] = (b[6] & 0x0F) | 0x40;
  b[8] = (b[8] & 0x3F) | 0x80;
  char s[37];
  std::snprintf(s, sizeof s, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return s;
}

// The needle's position: RULER's int(units * depth / 100).
int64_t needle_unit(int64_t units, double depth) { return static_cast<int64_t>(units * (depth / 100.0)); }

}  // namespace

const std::vector<std::string>& niah_tasks() {
  static const std::vector<std::string> names{"s-niah-1", "s-niah-2", "s-niah-3"};
  return names;
}

NiahGenerator::NiahGenerator(const std::string& task, const Tokenizer& tok, const std::string& haystack)
    : task_(task), tok_(tok), noise_(task == "s-niah-1") {
  const auto& names = niah_tasks();
  LT2_CHECK(std::find(names.begin(), names.end(), task) != names.end(), "unknown NIAH task '", task,
            "'; known: s-niah-1, s-niah-2, s-niah-3");
  if (noise_) {
    sentences_.assign(std::begin(kNoise), std::end(kNoise));
    return;
  }
  const std::string text = strip(collapse_whitespace(haystack));
  for (size_t b = 0; b < text.size();) {
    size_t e = text.find_first_of(".!?", b);
    while (e != std::string::npos && e + 1 < text.size() && text[e + 1] != ' ') e = text.find_first_of(".!?", e + 1);
    e = e == std::string::npos ? text.size() : e + 1;
    sentences_.push_back(text.substr(b, e - b));
    b = e + (e < text.size());  // skip the space after the sentence
  }
  LT2_CHECK(!sentences_.empty(), task, " needs an essay haystack: give --haystack FILE|FOLDER with text");
}

NiahSample NiahGenerator::build(int64_t units, double depth, const std::string& key, const std::string& value) const {
  const std::string type = task_ == "s-niah-3" ? "uuid" : "number";
  const std::string needle = "One of the special magic " + type + "s for " + key + " is: " + value + ".";
  NiahSample s;
  s.key = key;
  s.value = value;
  s.units = units;
  s.needle_unit = needle_unit(units, depth);
  std::string context;
  char sep = 0;  // what follows the last piece: RULER's noise puts each five-sentence block on its line
  auto add = [&](const std::string& piece, char after) {
    if (sep) context += sep;
    context += piece;
    sep = after;
  };
  const int64_t n = sentences_.size();
  for (int64_t i = 0; i <= units; ++i) {
    if (i == s.needle_unit) {
      s.needle_offset = context.size() + (sep ? 1 : 0);
      add(needle, ' ');
    }
    if (i == units) break;
    add(sentences_[i % n], noise_ && i % n == n - 1 ? '\n' : ' ');
  }
  const std::string head = "A special magic " + type + " is hidden within the following text. Make sure to memorize "
                           "it. I will quiz you about the " + type + " afterwards.\n";
  s.needle_offset += head.size();
  s.prompt = head + context + "\nWhat is the special magic " + type + " for " + key +
             " mentioned in the provided text? The special magic " + type + " for " + key +
             " mentioned in the provided text is";
  s.tokens = tok_.encode(s.prompt).size();
  return s;
}

NiahSample NiahGenerator::sample(int64_t length, double depth, int64_t index, uint64_t seed, int64_t reserve) const {
  LT2_CHECK(depth >= 0 && depth <= 100, "NIAH depth ", depth, " is outside [0, 100]");
  std::mt19937_64 rng(splitmix64(seed ^ splitmix64(length ^ splitmix64(std::llround(depth * 1000) ^
                                                                         splitmix64(index)))));
  const std::string key = std::string(kAdjectives[rng() % std::size(kAdjectives)]) + "-" + kNouns[rng() % std::size(kNouns)];
  const std::string value = value_of(task_, rng);
  const int64_t budget = length - reserve;
  NiahSample best = build(0, depth, key, value);
  LT2_CHECK(best.tokens <= budget, "NIAH length ", length, " is too short: the template, needle and question take ",
            best.tokens, " tokens and ", reserve, " more are generated");
  // The largest haystack that fits: every sentence adds at least one token, so `budget` bounds it.
  int64_t lo = 0, hi = budget;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    NiahSample s = build(mid, depth, key, value);
    if (s.tokens <= budget) {
      lo = mid;
      best = std::move(s);
    } else {
      hi = mid - 1;
    }
  }
  return best;  // built with `lo` sentences
}

std::string read_haystack(const std::string& path) {
  namespace fs = std::filesystem;
  LT2_CHECK(fs::exists(path), "haystack '", path, "' does not exist");
  if (!fs::is_directory(path)) return read_file(path);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(path))
    if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  LT2_CHECK(!files.empty(), "haystack folder '", path, "' has no .txt file");
  std::string text;
  for (const auto& f : files) text += (text.empty() ? "" : "\n\n") + read_file(f);
  return text;
}

double NiahResult::mean(size_t e) const {
  double sum = 0;
  int64_t n = 0;
  for (const auto& row : score[e])
    for (double v : row) sum += v, ++n;
  return n ? sum / n : 0;
}

json NiahResult::to_json() const {
  json per_exit = json::array();
  for (size_t e = 0; e < exits.size(); ++e) per_exit.push_back({{"exit", exits[e]}, {"scores", score[e]}, {"mean", mean(e)}});
  return {{"task", options.task}, {"lengths", options.lengths}, {"depths", options.depths},
          {"samples_per_cell", options.samples}, {"seed", options.seed}, {"max_new_tokens", options.max_new_tokens},
          {"exits", per_exit}, {"samples", samples}};
}

std::string NiahResult::markdown() const {
  std::string s;
  char buf[64];
  for (size_t e = 0; e < exits.size(); ++e) {
    s += cat("**", options.task, "**, ", exits[e], ": exact match in % (", options.samples,
             " samples per cell), rows = length in tokens, columns = needle depth in %\n\n| length |");
    for (double d : options.depths) s += cat(" ", d, " |");
    s += " mean |\n| --- |";
    for (size_t i = 0; i <= options.depths.size(); ++i) s += " --- |";
    s += "\n";
    for (size_t l = 0; l < options.lengths.size(); ++l) {
      s += cat("| ", options.lengths[l], " |");
      double row = 0;
      for (double v : score[e][l]) {
        std::snprintf(buf, sizeof buf, " %.1f |", 100 * v);
        s += buf;
        row += v / score[e][l].size();
      }
      std::snprintf(buf, sizeof buf, " %.1f |\n", 100 * row);
      s += buf;
    }
    std::snprintf(buf, sizeof buf, "\nmean %.1f%%\n\n", 100 * mean(e));
    s += buf;
  }
  return s;
}

bool NiahResult::plot(const std::string& png) const {
  const size_t E = exits.size();
  std::string script = cat("set multiplot layout 1,", E, "\nset cbrange [0:100]\nset palette defined (0 '#b2182b', 50 "
                           "'#f7f7f7', 100 '#2166ac')\nset xlabel 'needle depth (%)'\nset ylabel 'context length "
                           "(tokens)'\nset xtics (");
  for (size_t d = 0; d < options.depths.size(); ++d) script += cat(d ? ", " : "", "'", options.depths[d], "' ", d);
  script += ")\nset ytics (";
  for (size_t l = 0; l < options.lengths.size(); ++l) script += cat(l ? ", " : "", "'", options.lengths[l], "' ", l);
  script += cat(")\nset xrange [-0.5:", options.depths.size() - 0.5, "]\nset yrange [-0.5:",
                options.lengths.size() - 0.5, "]\n");
  for (size_t e = 0; e < E; ++e) {
    script += cat("$d", e, " << EOD\n");
    for (size_t l = 0; l < options.lengths.size(); ++l)
      for (size_t d = 0; d < options.depths.size(); ++d) script += cat(d, " ", l, " ", 100 * score[e][l][d], "\n");
    script += "EOD\n";
    script += cat("set title ", gnuplot_quote(cat(options.task, " — ", exits[e], " (exact match %)")), "\nplot $d", e,
                  " using 1:2:3 with image notitle, '' using 1:2:(sprintf('%.0f', $3)) with labels notitle\n");
  }
  script += "unset multiplot\n";
  return plot_png(png, script, 520 * E + 80, 420);
}

NiahResult run_niah(LoopedLM model, const Tokenizer& tok, const NiahGenerator& gen, const NiahOptions& opts,
                    bool quiet) {
  LT2_CHECK(!opts.lengths.empty() && !opts.depths.empty() && opts.samples > 0 && opts.max_new_tokens > 0 &&
                opts.batch > 0,
            "NIAH needs lengths, depths, samples > 0, max new tokens > 0 and batch > 0");
  const ModelConfig& cfg = model->config();
  // One run per exit setting: --exits all becomes each loop in turn (Ouro: its exit at that loop).
  std::vector<LoopOptions> runs;
  if (opts.loops.all_exits) {
    const int64_t loops = opts.loops.loops.value_or(cfg.n_loops);
    for (int64_t t = 1; t <= loops; ++t) {
      LoopOptions o;
      (cfg.exit_gate ? o.exit_step : o.loops) = t;
      runs.push_back(o);
    }
  } else {
    runs.push_back(opts.loops);
  }
  NiahResult res;
  res.options = opts;
  // Prompts first (they do not depend on the exit), in cell order.
  struct Job { size_t l, d; int64_t index; NiahSample s; };
  std::vector<Job> jobs;
  for (size_t l = 0; l < opts.lengths.size(); ++l)
    for (size_t d = 0; d < opts.depths.size(); ++d)
      for (int64_t i = 0; i < opts.samples; ++i)
        jobs.push_back({l, d, i, gen.sample(opts.lengths[l], opts.depths[d], i, opts.seed, opts.max_new_tokens)});
  const auto eos = tok.token_to_id("<|endoftext|>");
  const int64_t max_len = *std::max_element(opts.lengths.begin(), opts.lengths.end());
  for (const auto& run : runs) {
    const std::string exit = exit_names(cfg, run).at(0);
    res.exits.push_back(exit);
    EngineOptions eo;
    eo.max_batch = std::min<int64_t>(opts.batch, jobs.size());
    eo.max_len = max_len;
    eo.forward = forward_options(cfg, run);
    Engine engine(model, eo);
    std::vector<std::vector<double>> score(opts.lengths.size(), std::vector<double>(opts.depths.size(), 0.0));
    Progress progress("niah " + exit, jobs.size(), !quiet);
    for (size_t begin = 0; begin < jobs.size(); begin += eo.max_batch) {
      const int64_t n = std::min<int64_t>(eo.max_batch, jobs.size() - begin);
      std::vector<std::vector<int32_t>> out(n);
      std::vector<bool> done(n, false);
      std::vector<int64_t> next(n);
      for (int64_t b = 0; b < n; ++b) {
        const auto ids = tok.encode(jobs[begin + b].s.prompt);
        auto prompt = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong);
        next[b] = engine.prefill(b, prompt).argmax().item<int64_t>();
      }
      for (int64_t step = 0; step < opts.max_new_tokens; ++step) {
        bool any = false;  // a sequence still generating
        for (int64_t b = 0; b < n; ++b) {
          done[b] = done[b] || (eos && next[b] == *eos);
          if (done[b]) continue;
          out[b].push_back(static_cast<int32_t>(next[b]));
          any = true;
        }
        if (!any || step + 1 == opts.max_new_tokens) break;
        auto greedy = engine.decode(torch::tensor(next, torch::kLong)).argmax(-1).cpu();  // [n]
        for (int64_t b = 0; b < n; ++b) next[b] = greedy[b].item<int64_t>();
      }
      for (int64_t b = 0; b < n; ++b) {
        const Job& j = jobs[begin + b];
        const std::string text = tok.decode(out[b], /*skip_special=*/true);
        const bool hit = text.find(j.s.value) != std::string::npos;
        score[j.l][j.d] += hit ? 1.0 / opts.samples : 0.0;
        res.samples.push_back({{"exit", exit}, {"length", opts.lengths[j.l]}, {"depth", opts.depths[j.d]},
                               {"index", j.index}, {"prompt_tokens", j.s.tokens}, {"key", j.s.key},
                               {"value", j.s.value}, {"output", text}, {"correct", hit}});
      }
      progress.add(n);
    }
    progress.finish();
    res.score.push_back(std::move(score));
  }
  return res;
}

}  // namespace lt2::eval
