#include "lt2/eval/tasks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include "lt2/eval/text.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::eval {

namespace {

bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ---- Readers: a file in one of the formats a task accepts -> records with normalized fields ----

// .jsonl: one object per line; .json: an array of objects.
std::vector<Record> read_json_records(const std::string& path) {
  return has_suffix(path, ".json") ? read_json_array(path) : read_jsonl(path);
}

// PIQA as its authors publish it: valid.jsonl (goal, sol1, sol2) and valid-labels.lst (0 or 1 a
// line) beside it; records that carry "label" themselves (HF form) need no labels file.
std::vector<Record> read_piqa(const std::string& path) {
  auto records = read_jsonl(path);
  if (records[0].doc.contains("label")) return records;
  const std::string labels_path = (has_suffix(path, ".jsonl") ? path.substr(0, path.size() - 6) : path) + "-labels.lst";
  LT2_CHECK(path_exists(labels_path), "'", path, "' has no \"label\" field and its labels file '", labels_path,
            "' does not exist");
  const auto labels = read_lines(labels_path);
  LT2_CHECK(labels.size() >= records.size(), "'", labels_path, "' has ", labels.size(), " lines; expected one label for "
            "each of the ", records.size(), " items of '", path, "'");
  for (size_t i = 0; i < records.size(); ++i) {
    LT2_CHECK(labels[i] == "0" || labels[i] == "1", "'", labels_path, "', line ", i + 1,
              ": expected the label 0 or 1, found '", labels[i], "'");
    records[i].doc["label"] = std::stoi(labels[i]);
  }
  return records;
}

// HellaSwag: the original JSONL (activity_label, ctx_a, ctx_b, endings, label), or the six-line
// text layout of llama.cpp's scorer (context line, gold index, four endings) -> fields
// "context", "endings", "label". That layout joins ctx_a and ctx_b, so the harness's capitalisation
// of ctx_b cannot be redone: its context is taken as the file gives it.
std::vector<Record> read_hellaswag(const std::string& path) {
  if (has_suffix(path, ".jsonl")) return read_jsonl(path);
  const auto lines = read_lines(path);
  LT2_CHECK(!lines.empty(), "'", path, "' is empty (expected 6 lines per HellaSwag item)");
  LT2_CHECK(lines.size() % 6 == 0, "'", path, "' has ", lines.size(), " lines; the six-line layout needs a multiple of 6 "
            "(context, gold index, four endings)");
  std::vector<Record> out;
  for (size_t i = 0; i < lines.size(); i += 6) {
    Record r{json::object(), cat("'", path, "', line ", i + 1)};
    r.doc["context"] = lines[i];
    r.doc["label"] = lines[i + 1];
    r.doc["endings"] = {lines[i + 2], lines[i + 3], lines[i + 4], lines[i + 5]};
    out.push_back(std::move(r));
  }
  return out;
}

// OpenBookQA's release TSV (ID, Question Stem, Choices "(A) .. (B) ..", Complete Question, Answer
// Key) -> question_stem, choices {text, label}, answerKey; JSONL (AI2 or HF form) is read as is.
std::vector<Record> read_openbookqa(const std::string& path) {
  if (!has_suffix(path, ".tsv")) return read_json_records(path);
  const auto lines = read_lines(path);
  LT2_CHECK(lines.size() >= 2, "'", path, "' holds no question (expected a header line and one question a line)");
  std::vector<Record> out;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    const std::string where = cat("'", path, "', line ", i + 1);
    std::vector<std::string> cols;
    for (size_t b = 0;;) {
      const size_t e = lines[i].find('\t', b);
      cols.push_back(lines[i].substr(b, e == std::string::npos ? std::string::npos : e - b));
      if (e == std::string::npos) break;
      b = e + 1;
    }
    LT2_CHECK(cols.size() >= 5, where, ": expected 5 tab-separated columns (ID, Question Stem, Choices, Complete "
              "Question, Answer Key), found ", cols.size());
    const std::string& choices = cols[2];
    json text = json::array(), label = json::array();
    size_t pos = 0;
    for (char letter = 'A'; ; ++letter) {
      const std::string mark = cat("(", letter, ") ");
      LT2_CHECK(choices.compare(pos, mark.size(), mark) == 0, where, ": field 'Choices' must read \"(A) .. (B) ..\", "
                "found '", choices, "'");
      const size_t next = choices.find(cat(" (", char(letter + 1), ") "), pos);
      text.push_back(choices.substr(pos + mark.size(), next == std::string::npos ? std::string::npos
                                                                                  : next - pos - mark.size()));
      label.push_back(std::string(1, letter));
      if (next == std::string::npos) break;
      pos = next + 1;
    }
    out.push_back({{{"question_stem", cols[1]}, {"choices", {{"text", text}, {"label", label}}}, {"answerKey", cols[4]}},
                   where});
  }
  return out;
}

// Text of the first <tag>...</tag> inside `xml`, with XML's five entities decoded.
std::string xml_element(const std::string& xml, const std::string& tag, const std::string& where) {
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  const size_t b = xml.find(open), e = xml.find(close);
  LT2_CHECK(b != std::string::npos && e != std::string::npos && e > b, where, ": missing element <", tag, ">");
  std::string s = xml.substr(b + open.size(), e - b - open.size());
  for (const auto& [from, to] : std::vector<std::pair<const char*, const char*>>{
           {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&apos;", "'"}, {"&amp;", "&"}})
    s = replace_all(s, from, to);
  return s;
}

std::string xml_attribute(const std::string& tag_text, const std::string& name, const std::string& where) {
  const std::string key = " " + name + "=\"";
  const size_t b = tag_text.find(key);
  LT2_CHECK(b != std::string::npos, where, ": missing attribute '", name, "'");
  const size_t e = tag_text.find('"', b + key.size());
  LT2_CHECK(e != std::string::npos, where, ": attribute '", name, "' is not closed");
  return tag_text.substr(b + key.size(), e - b - key.size());
}

// COPA's original XML (<item asks-for most-plausible-alternative><p/><a1/><a2/></item>) ->
// SuperGLUE's fields premise, choice1, choice2, question, label; JSONL (SuperGLUE) is read as is.
std::vector<Record> read_copa(const std::string& path) {
  if (!has_suffix(path, ".xml")) return read_json_records(path);
  const std::string xml = read_file(path);
  std::vector<Record> out;
  for (size_t b = xml.find("<item "); b != std::string::npos; b = xml.find("<item ", b + 1)) {
    const std::string where = cat("'", path, "', line ", 1 + std::count(xml.begin(), xml.begin() + b, '\n'));
    const size_t tag_end = xml.find('>', b), e = xml.find("</item>", b);
    LT2_CHECK(tag_end != std::string::npos && e != std::string::npos, where, ": <item> is not closed");
    const std::string tag = xml.substr(b, tag_end - b), body = xml.substr(tag_end, e - tag_end);
    const std::string answer = xml_attribute(tag, "most-plausible-alternative", where);
    LT2_CHECK(answer == "1" || answer == "2", where, ": attribute 'most-plausible-alternative' must be 1 or 2, found '",
              answer, "'");
    out.push_back({{{"premise", xml_element(body, "p", where)}, {"choice1", xml_element(body, "a1", where)},
                    {"choice2", xml_element(body, "a2", where)}, {"question", xml_attribute(tag, "asks-for", where)},
                    {"label", answer == "1" ? 0 : 1}},
                   where});
  }
  LT2_CHECK(!out.empty(), "'", path, "' holds no COPA <item>");
  return out;
}

// ---- Formatters: a record -> the harness's requests ----

// The harness's multiple_choice requests: (context, " " + choice) for each choice.
McItem choices_item(const std::string& context, const std::vector<std::string>& choices, int64_t gold,
                    const Record& r, const char* gold_field) {
  LT2_CHECK(gold >= 0 && gold < static_cast<int64_t>(choices.size()), r.where, ": field '", gold_field, "' selects ",
            "choice ", gold, " of ", choices.size());
  McItem item;
  for (const auto& c : choices) item.requests.push_back({context, " " + c});
  item.choices = choices;
  item.gold = gold;
  return item;
}

std::vector<std::string> string_list(const Record& r, const json& v, const char* name) {
  LT2_CHECK(v.is_array() && !v.empty(), r.where, ": field '", name, "' must be a non-empty list, found ", json_describe(v));
  std::vector<std::string> out;
  for (const auto& e : v) {
    LT2_CHECK(e.is_string(), r.where, ": field '", name, "' must hold strings, found ", json_describe(e));
    out.push_back(e.get<std::string>());
  }
  return out;
}

// Question, choice texts and labels of an AI2-style item (ARC, OpenBookQA JSONL):
// {"question": {"stem", "choices": [{"text", "label"}]}} or HF's {"question"/"question_stem": str,
// "choices": {"text": [...], "label": [...]}}. Returns the gold index of answerKey (left-stripped).
McItem ai2_item(const Record& r, const char* stem_field, const std::string& prefix, const std::string& suffix) {
  std::string stem;
  std::vector<std::string> texts, labels;
  const json& q = field(r, r.doc.contains(stem_field) ? stem_field : "question");
  if (q.is_object()) {  // AI2's original form
    Record qr{q, r.where + ", field 'question'"};
    stem = str_field(qr, "stem");
    const json& choices = field(qr, "choices");
    LT2_CHECK(choices.is_array() && !choices.empty(), qr.where, ": field 'choices' must be a non-empty list");
    for (const auto& c : choices) {
      Record cr{c, qr.where + ", a choice"};
      texts.push_back(str_field(cr, "text"));
      labels.push_back(str_field(cr, "label"));
    }
  } else {
    stem = str_field(r, r.doc.contains(stem_field) ? stem_field : "question");
    const json& choices = field(r, "choices");
    LT2_CHECK(choices.is_object(), r.where, ": field 'choices' must be an object {\"text\": [...], \"label\": [...]}");
    texts = string_list(r, choices.value("text", json()), "choices.text");
    labels = string_list(r, choices.value("label", json()), "choices.label");
  }
  std::string key = str_field(r, "answerKey");
  key.erase(0, key.find_first_not_of(' '));
  const auto it = std::find(labels.begin(), labels.end(), key);
  LT2_CHECK(it != labels.end(), r.where, ": field 'answerKey' is '", key, "', not one of the choice labels");
  return choices_item(prefix + stem + suffix, texts, it - labels.begin(), r, "answerKey");
}

// Python's str.capitalize() for ASCII letters: first upper, the rest lower.
std::string capitalize(std::string s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) s[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
  }
  return s;
}

McItem format_hellaswag(const Record& r) {
  const std::string context =
      r.doc.contains("ctx_a")
          ? str_field(r, "activity_label") + ": " + str_field(r, "ctx_a") + " " + capitalize(str_field(r, "ctx_b"))
          : str_field(r, "context");
  std::vector<std::string> endings;
  for (const auto& e : string_list(r, field(r, "endings"), "endings")) endings.push_back(hellaswag_preprocess(e));
  return choices_item(hellaswag_preprocess(context), endings, int_field(r, "label"), r, "label");
}

McItem format_winogrande(const Record& r) {
  const std::string sentence = str_field(r, "sentence");
  const size_t blank = sentence.find('_');
  LT2_CHECK(blank != std::string::npos, r.where, ": field 'sentence' has no '_' blank: '", sentence, "'");
  const char* answer_field = r.doc.contains("answer") ? "answer" : "correct_option";
  const int64_t answer = int_field(r, answer_field);
  LT2_CHECK(answer == 1 || answer == 2, r.where, ": field '", answer_field, "' must be 1 or 2, found ", answer);
  // Partial scoring: the sentence up to the blank with each option filled in is the context; the
  // shared rest of the sentence is the continuation scored for both.
  const std::string target = " " + strip(sentence.substr(blank + 1));
  McItem item;
  for (const char* option : {"option1", "option2"}) {
    const std::string context = sentence.substr(0, blank) + str_field(r, option);
    item.requests.push_back({context, target});
    item.choices.push_back(context);
  }
  item.gold = answer - 1;
  return item;
}

McItem format_copa(const Record& r) {
  const std::string question = str_field(r, "question");
  LT2_CHECK(question == "cause" || question == "effect", r.where, ": field 'question' must be cause or effect, found '",
            question, "'");
  const std::string premise = strip(str_field(r, "premise"));
  LT2_CHECK(!premise.empty(), r.where, ": field 'premise' is empty");
  // The harness drops the premise's final period and joins with a connector; each choice starts lower-case.
  const std::string context = premise.substr(0, premise.size() - 1) + (question == "cause" ? " because" : " therefore");
  std::vector<std::string> choices;
  for (const char* name : {"choice1", "choice2"}) {
    std::string c = str_field(r, name);
    LT2_CHECK(!c.empty(), r.where, ": field '", name, "' is empty");
    if (static_cast<unsigned char>(c[0]) < 0x80) c[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(c[0])));
    choices.push_back(c);
  }
  return choices_item(context, choices, int_field(r, "label"), r, "label");
}

McItem format_lambada(const Record& r) {
  const std::string text = str_field(r, "text");
  const size_t last = text.rfind(' ');  // Python's text.split(' '): the last word follows the last space
  LT2_CHECK(last != std::string::npos, r.where, ": field 'text' has a single word; LAMBADA needs a context");
  McItem item;
  item.requests.push_back({text.substr(0, last), text.substr(last)});
  return item;
}

std::vector<TaskSpec> make_specs() {
  const auto mc = std::vector<std::string>{"acc", "acc_norm"};
  return {
      {"piqa", {"piqa/valid.jsonl"}, "Question: {goal}\\nAnswer: -> \" {sol1|sol2}\"", mc, "acc", false, read_piqa,
       [](const Record& r) {
         return choices_item("Question: " + str_field(r, "goal") + "\nAnswer:", {str_field(r, "sol1"), str_field(r, "sol2")},
                             int_field(r, "label"), r, "label");
       }},
      {"arc_easy", {"arc-easy/ARC-Easy-Test.jsonl"}, "Question: {question}\\nAnswer: -> \" {choice}\"", mc, "acc", false,
       read_json_records, [](const Record& r) { return ai2_item(r, "question", "Question: ", "\nAnswer:"); }},
      {"arc_challenge", {"arc-challenge/ARC-Challenge-Test.jsonl"}, "Question: {question}\\nAnswer: -> \" {choice}\"", mc,
       "acc_norm", false, read_json_records,
       [](const Record& r) { return ai2_item(r, "question", "Question: ", "\nAnswer:"); }},
      {"hellaswag", {"hellaswag/hellaswag_val.jsonl", "hellaswag/hellaswag_val_full.txt"},
       "preprocess({activity_label}: {ctx_a} {ctx_b.capitalize()}) -> \" {preprocess(ending)}\"", mc, "acc_norm", false,
       read_hellaswag, format_hellaswag},
      {"winogrande", {"winogrande/dev.jsonl", "winogrande/dev.json"},
       "{sentence up to _}{option} -> \" {rest of sentence}\" (partial scoring)", {"acc"}, "acc", false,
       read_json_records, format_winogrande},
      {"openbookqa", {"openbookqa/test.jsonl", "openbookqa/test.tsv"}, "{question_stem} -> \" {choice}\"", mc, "acc_norm",
       false, read_openbookqa, [](const Record& r) { return ai2_item(r, "question_stem", "", ""); }},
      {"boolq", {"boolq/val.jsonl", "boolq/dev.jsonl"}, "{passage}\\nQuestion: {question}?\\nAnswer: -> \" no|yes\"",
       {"acc"}, "acc", false, read_json_records,
       [](const Record& r) {
         const char* label = r.doc.contains("label") ? "label" : "answer";
         return choices_item(str_field(r, "passage") + "\nQuestion: " + str_field(r, "question") + "?\nAnswer:",
                             {"no", "yes"}, bool_field(r, label) ? 1 : 0, r, label);
       }},
      {"sciq", {"sciq/test.json", "sciq/test.jsonl"},
       "{support.lstrip()}\\nQuestion: {question}\\nAnswer: -> \" {distractor1..3|correct_answer}\"", mc, "acc", false,
       read_json_records,
       [](const Record& r) {
         return choices_item(lstrip(str_field(r, "support")) + "\nQuestion: " + str_field(r, "question") + "\nAnswer:",
                             {str_field(r, "distractor1"), str_field(r, "distractor2"), str_field(r, "distractor3"),
                              str_field(r, "correct_answer")},
                             3, r, "correct_answer");
       }},
      {"copa", {"copa/copa-test.xml", "copa/val.jsonl"},
       "{premise without its period} because|therefore -> \" {choice, first letter lower-case}\"", {"acc"}, "acc", false,
       read_copa, format_copa},
      {"lambada_openai", {"lambada/lambada_test.jsonl"}, "{text up to its last word} -> \" {last word}\"",
       {"acc", "perplexity"}, "acc", true, read_jsonl, format_lambada},
  };
}

}  // namespace

const std::vector<TaskSpec>& task_specs() {
  static const std::vector<TaskSpec> specs = make_specs();
  return specs;
}

const TaskSpec& find_task(const std::string& name) {
  std::string known;
  for (const auto& s : task_specs()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  throw Error(cat("unknown task '", name, "'; known tasks: ", known));
}

std::string find_task_file(const TaskSpec& spec, const std::string& dir) {
  std::string tried;
  for (const auto& f : spec.files) {
    const std::string path = dir + "/" + f;
    if (path_exists(path)) return path;
    tried += (tried.empty() ? "" : ", ") + path;
  }
  throw Error(cat("task '", spec.name, "': no data file under '", dir, "' (tried ", tried, "); give --data FILE"));
}

std::vector<McItem> load_task(const TaskSpec& spec, const std::string& path, int64_t limit) {
  const auto records = spec.read(path);
  const size_t n = limit < 0 ? records.size() : std::min<size_t>(records.size(), limit);
  std::vector<McItem> items;
  for (size_t i = 0; i < n; ++i) items.push_back(spec.format_item(records[i]));
  return items;
}

TaskResult score_task(const TaskSpec& spec, const std::vector<McItem>& items, const LoglikelihoodFn& ll,
                      const std::vector<std::string>& exits) {
  LT2_CHECK(!items.empty(), "task '", spec.name, "' has no items");
  std::vector<LLRequest> requests;
  for (const auto& item : items) requests.insert(requests.end(), item.requests.begin(), item.requests.end());
  const auto results = ll(requests);
  LT2_CHECK(results.size() == requests.size(), "the log-likelihood function returned ", results.size(),
            " results for ", requests.size(), " requests");
  const size_t E = exits.size();
  TaskResult res{spec.name, static_cast<int64_t>(items.size()), spec.primary, exits, {}};
  std::vector<double> acc(E, 0), acc_norm(E, 0), ll_sum(E, 0);
  size_t at = 0;
  for (const auto& item : items) {
    const size_t n = item.requests.size();
    for (size_t e = 0; e < E; ++e) {
      if (spec.last_word) {
        acc[e] += results[at].greedy.at(e);
        ll_sum[e] += results[at].logprob.at(e);
        continue;
      }
      // np.argmax: the first of equal maxima.
      size_t best = 0, best_norm = 0;
      double best_norm_value = -INFINITY;
      for (size_t c = 0; c < n; ++c) {
        const double v = results[at + c].logprob.at(e);
        if (v > results[at + best].logprob.at(e)) best = c;
        const double norm = v / static_cast<double>(count_chars(item.choices[c]));
        if (norm > best_norm_value) best_norm = c, best_norm_value = norm;
      }
      acc[e] += best == static_cast<size_t>(item.gold);
      acc_norm[e] += best_norm == static_cast<size_t>(item.gold);
    }
    at += n;
  }
  const double count = items.size();
  for (size_t e = 0; e < E; ++e) {
    std::map<std::string, double> m{{"acc", acc[e] / count}};
    if (std::count(spec.metrics.begin(), spec.metrics.end(), "acc_norm")) m["acc_norm"] = acc_norm[e] / count;
    if (spec.last_word) m["perplexity"] = std::exp(-ll_sum[e] / count);
    res.metrics.push_back(m);
  }
  return res;
}

json TaskResult::to_json() const {
  json per_exit = json::array();
  for (size_t e = 0; e < exits.size(); ++e) per_exit.push_back({{"exit", exits[e]}, {"metrics", metrics[e]}});
  return {{"task", task}, {"items", items}, {"primary", primary}, {"exits", per_exit}};
}

std::vector<double> average_primary(const std::vector<TaskResult>& results) {
  LT2_CHECK(!results.empty(), "no task results to average");
  std::vector<double> avg(results[0].exits.size(), 0.0);
  for (const auto& r : results)
    for (size_t e = 0; e < avg.size(); ++e) avg[e] += r.metrics.at(e).at(r.primary) / results.size();
  return avg;
}

std::string tasks_markdown(const std::vector<TaskResult>& results) {
  LT2_CHECK(!results.empty(), "no task results to tabulate");
  const auto& exits = results[0].exits;
  std::string s = "| task | items | metric |";
  for (const auto& e : exits) s += " " + e + " |";
  s += "\n| --- | --- | --- |";
  for (size_t e = 0; e < exits.size(); ++e) s += " --- |";
  s += "\n";
  char buf[64];
  auto value = [&](const std::string& metric, double v) {
    std::snprintf(buf, sizeof buf, metric == "perplexity" ? " %.3f |" : " %.2f |", metric == "perplexity" ? v : 100 * v);
    return std::string(buf);
  };
  for (const auto& r : results) {
    for (const auto& [metric, unused] : r.metrics[0]) {
      s += "| " + r.task + " | " + std::to_string(r.items) + " | " + metric + (metric == r.primary ? " *" : "") + " |";
      for (size_t e = 0; e < exits.size(); ++e) s += value(metric, r.metrics[e].at(metric));
      s += "\n";
    }
  }
  if (results.size() > 1) {
    s += "| **average** | | * |";
    for (double v : average_primary(results)) s += value("acc", v);
    s += "\n";
  }
  return s + "\nAccuracies in %; * marks each task's metric in the average.\n";
}

}  // namespace lt2::eval
