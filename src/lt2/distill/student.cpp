#include "lt2/distill/student.h"

#include <cstdio>
#include <map>
#include <tuple>

#include "lt2/mixers/registry.h"
#include "lt2/model/pattern.h"

namespace lt2::distill {

namespace {

const std::string kFull = "full";

// The layer index of a parameter named "layers.<i>.mixer....", or -1 for any other name.
int64_t mixer_layer(const std::string& name) {
  const std::string head = "layers.";
  if (name.rfind(head, 0) != 0) return -1;
  const size_t dot = name.find('.', head.size());
  if (dot == std::string::npos || name.compare(dot, 7, ".mixer.") != 0) return -1;
  return std::stoll(name.substr(head.size(), dot - head.size()));
}

std::map<std::string, Tensor> tensors_by_name(const torch::nn::Module& m) {
  std::map<std::string, Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value();
  return out;
}

void copy_checked(Tensor& dst, const std::map<std::string, Tensor>& src, const std::string& name,
                  const std::string& source) {
  auto it = src.find(name);
  LT2_CHECK(it != src.end(), "distill: the student's '", name, "' has no counterpart in the ", source);
  LT2_CHECK(it->second.sizes() == dst.sizes(), "distill: '", name, "' is ", dst.sizes(), " in the student but ",
            it->second.sizes(), " in the ", source);
  dst.copy_(it->second);
}

// Rows of a K or V projection [H_kv * D, d] repeated for the query heads that share each KV head
// (GQA): [H * D, d], KV head j serving query heads j * g .. j * g + g - 1.
Tensor repeat_kv_rows(const Tensor& w, int64_t kv_heads, int64_t groups) {
  return w.view({kv_heads, w.size(0) / kv_heads, w.size(1)}).repeat_interleave(groups, 0).reshape({-1, w.size(1)});
}

// Copies the teacher attention's W_q, W_k, W_v and W_o (prefix "layers.<l>.mixer.") into the
// student mixer's q/k/v/o projections (names q_proj|wq, ...) where the shapes take them, directly
// or with the KV heads repeated. Returns the student names it filled.
std::vector<std::string> copy_attention(const ModelConfig& teacher_cfg, const std::map<std::string, Tensor>& teacher,
                                        std::map<std::string, Tensor>& student, int64_t layer) {
  const std::string prefix = "layers." + std::to_string(layer) + ".mixer.";
  const int64_t kv_heads = teacher_cfg.kv_heads(), groups = teacher_cfg.n_heads / kv_heads;
  const std::vector<std::tuple<std::string, std::vector<std::string>, bool>> roles{
      {"wq", {"q_proj", "wq"}, false}, {"wk", {"k_proj", "wk"}, true},
      {"wv", {"v_proj", "wv"}, true}, {"wo", {"o_proj", "wo"}, false}};
  std::vector<std::string> filled;
  for (const auto& [source, targets, repeatable] : roles) {
    const Tensor& w = teacher.at(prefix + source + ".weight");
    for (const auto& target : targets) {
      auto it = student.find(prefix + target + ".weight");
      if (it == student.end()) continue;
      if (it->second.sizes() == w.sizes()) {
        it->second.copy_(w);
      } else if (repeatable && groups > 1 && it->second.size(0) == w.size(0) * groups && it->second.size(1) == w.size(1)) {
        it->second.copy_(repeat_kv_rows(w, kv_heads, groups));
      } else {
        continue;
      }
      filled.push_back(target);
      break;
    }
  }
  return filled;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

}  // namespace

json StudentOptions::to_json() const {
  return json{{"mixer", mixer}, {"mixer_options", mixer_options}, {"keep", std::vector<int64_t>(keep.begin(), keep.end())},
              {"keep_fraction", keep_fraction}};
}

StudentOptions StudentOptions::from_json(const json& j, const std::string& where) {
  LT2_CHECK(j.is_object(), where, ": expected a JSON object, found ", json_describe(j));
  json_reject_unknown(j, {"mixer", "mixer_options", "keep", "keep_fraction", "comment"}, where);
  StudentOptions o;
  json_get(j, "mixer", o.mixer, where);
  if (j.contains("mixer_options")) {
    LT2_CHECK(j["mixer_options"].is_object(), where, ": field 'mixer_options' must be an object, found ",
              json_describe(j["mixer_options"]));
    o.mixer_options = j["mixer_options"];
  }
  std::vector<int64_t> keep;
  json_get(j, "keep", keep, where);
  o.keep = std::set<int64_t>(keep.begin(), keep.end());
  json_get(j, "keep_fraction", o.keep_fraction, where);
  LT2_CHECK(o.keep_fraction >= 0 && o.keep_fraction <= 1, where, ": keep_fraction must be in [0, 1], found ",
            o.keep_fraction);
  return o;
}

std::vector<int64_t> converted_layers(const ModelConfig& teacher, const std::set<int64_t>& keep) {
  const auto names = resolve_pattern(teacher);
  std::vector<int64_t> out;
  for (int64_t l = 0; l < static_cast<int64_t>(names.size()); ++l)
    if (names[l] == kFull && !keep.count(l)) out.push_back(l);
  return out;
}

json student_mixer_options(const ModelConfig& teacher, const std::string& mixer, const json& overrides) {
  const int64_t H = teacher.n_heads, D = teacher.dim_head();
  json o = json::object();
  if (mixer == "gdn") {
    o = {{"num_heads", H}, {"head_dim", D}, {"num_v_heads", H}, {"expand_v", 1.0}, {"use_gate", true}};
  } else if (mixer == "kda") {
    o = {{"num_heads", H}, {"head_dim", D}, {"num_v_heads", H}, {"expand_v", 1.0}};
  } else if (mixer == "deltanet" || mixer == "gla" || mixer == "retnet" || mixer == "linear_attention") {
    const double expand = static_cast<double>(H * D) / static_cast<double>(teacher.d_model);
    o = {{"num_heads", H}, {"expand_k", expand}, {"expand_v", expand}};
  }
  o.update(overrides);
  return o;
}

ModelConfig student_config(const ModelConfig& teacher, const StudentOptions& opts) {
  LT2_CHECK(opts.mixer != kFull, "distill: the student mixer must replace full attention, not be 'full'");
  LT2_CHECK(find_mixer(opts.mixer), "distill: unknown student mixer '", opts.mixer, "' (registered: ",
            registered_mixer_names(), ")");
  LT2_CHECK(!random_slots(teacher), "distill: the teacher's layer_pattern '", teacher.layer_pattern,
            "' draws its layers at random; a teacher needs a fixed mixer per layer");
  auto names = resolve_pattern(teacher);
  const int64_t N = teacher.n_layers;
  for (int64_t l : opts.keep) {
    LT2_CHECK(l >= 0 && l < N, "distill: keep lists layer ", l, " but the teacher has layers 0..", N - 1);
    LT2_CHECK(names[l] == kFull, "distill: keep lists layer ", l, ", which is '", names[l],
              "' in the teacher, not full attention");
  }
  const auto converted = converted_layers(teacher, opts.keep);
  const json options = student_mixer_options(teacher, opts.mixer, opts.mixer_options);
  for (int64_t l = 0; l < N; ++l)
    LT2_CHECK(names[l] != opts.mixer || teacher.options_for(opts.mixer) == options, "distill: the teacher's layer ",
              l, " is already '", opts.mixer, "' with options ", teacher.options_for(opts.mixer).dump(),
              ", which differ from the student's ", options.dump(), "; pick another student mixer or those options");
  for (int64_t l : converted) names[l] = opts.mixer;
  ModelConfig s = teacher;
  s.name = teacher.name + "-distill";
  s.layer_pattern = join(names, ",");
  if (!converted.empty()) s.mixer_options[opts.mixer] = options;
  return s;
}

LoopedLM build_student(LoopedLMImpl& teacher, const StudentOptions& opts, uint64_t seed) {
  const auto& tcfg = teacher.config();
  const auto cfg = student_config(tcfg, opts);
  torch::manual_seed(seed);
  LoopedLM student(cfg);
  const auto dtype = teacher.tok_embeddings->weight.scalar_type();
  student->to(dtype);
  torch::NoGradGuard ng;
  const auto source = tensors_by_name(teacher);
  auto target = tensors_by_name(*student);
  const auto converted = converted_layers(tcfg, opts.keep);
  const std::set<int64_t> converted_set(converted.begin(), converted.end());
  for (auto& [name, t] : target)
    if (!converted_set.count(mixer_layer(name))) copy_checked(t, source, name, "teacher");
  std::vector<std::string> filled, layers;
  for (int64_t l : converted) {
    filled = copy_attention(tcfg, source, target, l);
    layers.push_back(std::to_string(l));
  }
  if (!converted.empty())
    std::printf("student: layers %s -> %s, from the teacher's attention: %s\n", join(layers, ",").c_str(),
                opts.mixer.c_str(), filled.empty() ? "nothing (no q/k/v/o projection of a matching shape)"
                                                   : join(filled, ", ").c_str());
  return student;
}

LoopedLM hybrid_student(LoopedLMImpl& teacher, LoopedLMImpl& trained, const StudentOptions& opts) {
  check_student_of(teacher.config(), trained.config());
  LoopedLM student = build_student(teacher, opts);
  const auto& new_kinds = student->layer_mixers();
  const auto& trained_kinds = trained.layer_mixers();
  torch::NoGradGuard ng;
  const auto source = tensors_by_name(trained);
  for (auto& [name, t] : tensors_by_name(*student)) {
    const int64_t l = mixer_layer(name);
    if (l >= 0 && new_kinds[l] != trained_kinds[l]) continue;  // restored to the teacher's attention
    Tensor dst = t;
    copy_checked(dst, source, name, "trained student");
  }
  return student;
}

void check_student_of(const ModelConfig& t, const ModelConfig& s) {
  auto same = [](const char* what, auto a, auto b) {
    LT2_CHECK(a == b, "distill: the student does not match the teacher: ", what, " is ", b, " in the student but ", a,
              " in the teacher");
  };
  same("form", to_string(t.form), to_string(s.form));
  same("vocab_size", t.vocab_size, s.vocab_size);
  same("d_model", t.d_model, s.d_model);
  same("n_layers", t.n_layers, s.n_layers);
  same("n_loops", t.n_loops, s.n_loops);
  same("n_heads", t.n_heads, s.n_heads);
  same("ffn hidden size", t.ffn_dim(), s.ffn_dim());
  same("exit_gate", t.exit_gate, s.exit_gate);
}

std::vector<std::string> mixer_prefixes(const std::vector<int64_t>& layers) {
  std::vector<std::string> out;
  for (int64_t l : layers) out.push_back("layers." + std::to_string(l) + ".mixer.");
  return out;
}

bool has_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes)
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

}  // namespace lt2::distill
