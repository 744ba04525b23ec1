// Needle-in-a-haystack in RULER's single-needle forms:
//   s-niah-1  a 7-digit number in RULER's repeated noise ("The grass is green. The sky is blue. ...")
//   s-niah-2  a 7-digit number in an essay haystack (any text the user gives)
//   s-niah-3  a UUID in an essay haystack
// RULER's templates: the needle "One of the special magic {numbers|uuids} for {key} is: {value}."
// sits at a sentence boundary at the depth asked (0: before the first sentence, 100: after the
// last), and the prompt ends with the question and RULER's answer prefix, so greedy generation
// continues with the value. A sample scores 1 when the generated text contains the value. Each
// prompt holds as many haystack sentences as fit in `length` tokens minus the tokens to generate
// (RULER counts those into the length too). Keys are adjective-noun pairs as in RULER, drawn from
// lt2's own word lists.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/eval/model.h"
#include "lt2/util/json.h"

namespace lt2::eval {

// The names of the tasks: s-niah-1, s-niah-2, s-niah-3.
const std::vector<std::string>& niah_tasks();

struct NiahSample {
  std::string prompt, key, value;
  int64_t units = 0;          // haystack sentences in the prompt
  int64_t needle_unit = 0;    // the needle comes before sentence `needle_unit` (== units: at the end)
  size_t needle_offset = 0;   // byte offset of the needle in the prompt
  int64_t tokens = 0;         // prompt tokens
};

class NiahGenerator {
 public:
  // `haystack`: the essay text (s-niah-2/3; whitespace runs become single spaces, then it is cut
  // into sentences after '.', '!' or '?'); s-niah-1 ignores it.
  NiahGenerator(const std::string& task, const Tokenizer& tok, const std::string& haystack = "");
  // Sample `index` of cell (length, depth): key and value drawn from a generator seeded by
  // (seed, length, depth, index), so a cell's samples do not depend on the other cells. Throws when
  // not even an empty haystack fits in length - reserve tokens.
  NiahSample sample(int64_t length, double depth, int64_t index, uint64_t seed, int64_t reserve) const;
  // The prompt with exactly `units` haystack sentences and the needle at `depth` percent.
  NiahSample build(int64_t units, double depth, const std::string& key, const std::string& value) const;
  const std::string& task() const { return task_; }

 private:
  std::string task_;
  const Tokenizer& tok_;
  std::vector<std::string> sentences_;  // the haystack's sentences, cycled as needed
  bool noise_ = false;                  // s-niah-1: RULER's noise block, one block per line
};

// The text of a haystack file, or of every *.txt file of a folder (sorted by name, joined by a
// blank line).
std::string read_haystack(const std::string& file_or_folder);

struct NiahOptions {
  std::string task = "s-niah-1";
  std::vector<int64_t> lengths{1024, 2048, 4096};
  std::vector<double> depths{0, 25, 50, 75, 100};
  int64_t samples = 5;          // per (length, depth)
  uint64_t seed = 42;
  int64_t max_new_tokens = 32;  // greedy tokens generated per sample (counted into each length)
  int64_t batch = 4;            // sequences decoded together
  LoopOptions loops;            // --exits all runs once per loop
};

struct NiahResult {
  NiahOptions options;
  std::vector<std::string> exits;
  std::vector<std::vector<std::vector<double>>> score;  // [exit][length][depth], in [0, 1]
  json samples = json::array();                          // one object per (exit, sample)
  double mean(size_t e) const;
  json to_json() const;
  std::string markdown() const;
  // A heatmap per exit (length x depth); false when gnuplot is missing.
  bool plot(const std::string& png) const;
};

// Generates every sample and decodes it greedily through the inference Engine on the model's
// device (prefill + batched decode), once per exit setting.
NiahResult run_niah(LoopedLM model, const Tokenizer& tok, const NiahGenerator& gen, const NiahOptions& opts,
                    bool quiet = false);

}  // namespace lt2::eval
