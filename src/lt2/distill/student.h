// The student of a distillation (spec/models.md §4): the teacher's looped model with every
// full-attention layer outside a `keep` set replaced by a linear mixer (GDN by default) in the
// distillation shape, initialised from the teacher: W_q, W_k, W_v (GQA heads repeated) and W_o
// copied into the student mixer; embeddings, norms, MLPs, loop gates, the exit gate and every
// kept or already-linear layer copied as they are. The loop structure (T loops, the Ouro form
// and its exits) stays the teacher's.
#pragma once
#include <set>
#include <string>
#include <vector>

#include "lt2/model/looped_lm.h"
#include "lt2/util/json.h"

namespace lt2::distill {

struct StudentOptions {
  std::string mixer = "gdn";  // registered mixer replacing full attention (not "full")
  // Settings of that mixer over its distillation defaults (student_mixer_options).
  json mixer_options = json::object();
  std::set<int64_t> keep;     // layers that stay full attention in every loop (0-based)
  double keep_fraction = 0.25;  // layer selection keeps round(fraction x N) layers full attention

  json to_json() const;
  static StudentOptions from_json(const json& j, const std::string& where);
};

// The layers of `teacher` a student converts: its full-attention layers outside `keep`.
std::vector<int64_t> converted_layers(const ModelConfig& teacher, const std::set<int64_t>& keep);

// The distillation shape of `mixer` for `teacher` (spec §4: GDN head dim d/H = the teacher's head
// dim, H heads, expand_v 1, output gate on; KDA alike; the expand_k/expand_v mixers at 1), with
// `overrides` on top. Mixers without a known shape take their defaults plus the overrides.
json student_mixer_options(const ModelConfig& teacher, const std::string& mixer, const json& overrides);

// The student's model config: the teacher's, with an explicit per-layer pattern and the student
// mixer's options. Throws lt2::Error for a teacher it cannot convert (a random pattern) or a
// student mixer that is "full" or unregistered.
ModelConfig student_config(const ModelConfig& teacher, const StudentOptions& opts);

// A student built from `teacher` (weights copied as the file comment says); in the teacher's
// parameter dtype, on the CPU. What the teacher has no counterpart for (a GDN's gates and short
// convolutions) is initialised from `seed` (it reseeds torch's global generator).
LoopedLM build_student(LoopedLMImpl& teacher, const StudentOptions& opts, uint64_t seed = 0);

// The student of `opts` (its keep set) with the converted layers' mixers taken from `trained`, a
// student of the same teacher (e.g. after alignment) whose keep set is a subset of opts.keep:
// everything else (kept mixers, and every non-mixer parameter) comes from `trained` too, except the
// mixers of layers `trained` converted but `opts` keeps, which come from the teacher.
LoopedLM hybrid_student(LoopedLMImpl& teacher, LoopedLMImpl& trained, const StudentOptions& opts);

// Throws lt2::Error naming the first difference when `student` cannot be `teacher`'s student: form,
// vocabulary, width, layers, loops, heads, exit gate.
void check_student_of(const ModelConfig& teacher, const ModelConfig& student);

// The parameter-name prefixes of the student mixers ("layers.<i>.mixer.") of `layers`.
std::vector<std::string> mixer_prefixes(const std::vector<int64_t>& layers);
// Whether `name` starts with one of `prefixes`.
bool has_prefix(const std::string& name, const std::vector<std::string>& prefixes);

}  // namespace lt2::distill
