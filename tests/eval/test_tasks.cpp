// Every task's prompt against a golden string (one item each, in the file formats the task reads),
// bad input errors that name the file, line and field, and the real task files when present.
#include "eval_testing.h"
#include "lt2/eval/perplexity.h"
#include "lt2/eval/tasks.h"

using namespace lt2;
using namespace lt2::eval;
using eval_testing::expect_error;
using eval_testing::ScratchDir;

namespace {

// The single item of `spec` read from `contents` written as `file`.
McItem one_item(const std::string& task, const std::string& file, const std::string& contents,
                const std::vector<std::pair<std::string, std::string>>& extra = {}) {
  ScratchDir dir;
  for (const auto& [name, text] : extra) dir.write(name, text);
  const auto items = load_task(find_task(task), dir.write(file, contents));
  EXPECT_EQ(items.size(), 1u);
  return items.at(0);
}

void expect_item(const McItem& item, const std::vector<std::pair<std::string, std::string>>& requests, int64_t gold) {
  ASSERT_EQ(item.requests.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(item.requests[i].context, requests[i].first) << "choice " << i;
    EXPECT_EQ(item.requests[i].continuation, requests[i].second) << "choice " << i;
  }
  EXPECT_EQ(item.gold, gold);
}

}  // namespace

TEST(EvalTasks, PiqaWithItsLabelsFile) {
  auto item = one_item("piqa", "valid.jsonl", R"({"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Hit it."})",
                       {{"valid-labels.lst", "1\n"}});
  expect_item(item, {{"Question: Open a jar\nAnswer:", " Twist the lid."}, {"Question: Open a jar\nAnswer:", " Hit it."}}, 1);
  EXPECT_EQ(item.choices[0], "Twist the lid.");
}

TEST(EvalTasks, ArcWithNumericLabels) {
  auto item = one_item("arc_challenge", "arc.jsonl",
                       R"({"id": "x", "question": {"stem": "Which is a gas?", "choices": [{"text": "ice", "label": "1"},)"
                       R"( {"text": "steam", "label": "2"}]}, "answerKey": "2"})");
  expect_item(item, {{"Question: Which is a gas?\nAnswer:", " ice"}, {"Question: Which is a gas?\nAnswer:", " steam"}}, 1);
}

TEST(EvalTasks, HellaswagBothLayouts) {
  auto item = one_item("hellaswag", "val.jsonl",
                       R"({"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",)"
                       R"( "endings": ["is using wrap [step] to wrap.", "starts pulling up roofing."], "label": 1})");
  const std::string ctx = "Roof shingle removal: A man is sitting on a roof. He";
  expect_item(item, {{ctx, " is using wrap to wrap."}, {ctx, " starts pulling up roofing."}}, 1);
  item = one_item("hellaswag", "val.txt", "Clean and jerk: A lady walks. the lady\n3\na\nb\nc\nd\n");
  const std::string ctx6 = "Clean and jerk: A lady walks. the lady";
  expect_item(item, {{ctx6, " a"}, {ctx6, " b"}, {ctx6, " c"}, {ctx6, " d"}}, 3);
}

TEST(EvalTasks, WinograndePartialScoring) {
  auto item = one_item("winogrande", "dev.json",
                       R"([{"sentence": "Sarah was better than Maria so _ got the easy cases.", "option1": "Sarah",)"
                       R"( "option2": "Maria", "correct_option": "2"}])");
  expect_item(item, {{"Sarah was better than Maria so Sarah", " got the easy cases."},
                     {"Sarah was better than Maria so Maria", " got the easy cases."}}, 1);
}

TEST(EvalTasks, OpenBookQaTsv) {
  auto item = one_item("openbookqa", "test.tsv",
                       "ID\tQuestion Stem\tChoices\tComplete Question\tAnswer Key\n"
                       "8-343\tThe sun is\t(A) cold (B) a star (C) wet (D) small\tThe sun is (A) cold\tB\n");
  expect_item(item, {{"The sun is", " cold"}, {"The sun is", " a star"}, {"The sun is", " wet"}, {"The sun is", " small"}}, 1);
}

TEST(EvalTasks, BoolQ) {
  auto item = one_item("boolq", "val.jsonl",
                       R"({"question": "is the sky blue", "passage": "Sky -- The sky is blue.", "label": "true"})");
  const std::string ctx = "Sky -- The sky is blue.\nQuestion: is the sky blue?\nAnswer:";
  expect_item(item, {{ctx, " no"}, {ctx, " yes"}}, 1);
}

TEST(EvalTasks, SciQ) {
  auto item = one_item("sciq", "test.json",
                       R"([{"question": "What is H2O?", "distractor1": "salt", "distractor2": "air", "distractor3": "fire",)"
                       R"( "correct_answer": "water", "support": "  Water is H2O."}])");
  const std::string ctx = "Water is H2O.\nQuestion: What is H2O?\nAnswer:";
  expect_item(item, {{ctx, " salt"}, {ctx, " air"}, {ctx, " fire"}, {ctx, " water"}}, 3);
}

TEST(EvalTasks, CopaXml) {
  auto item = one_item("copa", "copa.xml",
                       "<copa-corpus>\n  <item id=\"1\" asks-for=\"cause\" most-plausible-alternative=\"1\">\n"
                       "    <p>My body cast a shadow over the grass.</p>\n    <a1>The sun was rising.</a1>\n"
                       "    <a2>The grass was cut.</a2>\n  </item>\n</copa-corpus>\n");
  const std::string ctx = "My body cast a shadow over the grass because";
  expect_item(item, {{ctx, " the sun was rising."}, {ctx, " the grass was cut."}}, 0);
  item = one_item("copa", "val.jsonl",
                  R"({"premise": "I emptied my pockets.", "choice1": "I found a key.", "choice2": "I sang.", "question": "effect", "label": 0})");
  expect_item(item, {{"I emptied my pockets therefore", " i found a key."}, {"I emptied my pockets therefore", " i sang."}}, 0);
}

TEST(EvalTasks, LambadaLastWord) {
  auto item = one_item("lambada_openai", "test.jsonl", R"({"text": "He said hello to Harlin"})");
  expect_item(item, {{"He said hello to", " Harlin"}}, 0);
}

TEST(EvalTasks, BadInputNamesFileLineAndField) {
  ScratchDir dir;
  const auto bad_field = dir.write("p.jsonl", "{\"goal\": \"a\", \"sol1\": \"b\", \"sol2\": \"c\", \"label\": 0}\n"
                                              "{\"goal\": \"a\", \"sol1\": \"b\", \"label\": 1}\n");
  expect_error([&] { load_task(find_task("piqa"), bad_field); }, {bad_field, "line 2", "'sol2'"});
  const auto empty = dir.write("e.jsonl", "");
  expect_error([&] { load_task(find_task("boolq"), empty); }, {empty, "no JSON object"});
  const auto not_json = dir.write("n.jsonl", "{\"question\": \"a\",\n");
  expect_error([&] { load_task(find_task("boolq"), not_json); }, {not_json, "line 1", "not JSON"});
  const auto wrong_type = dir.write("w.jsonl", "{\"question\": 3, \"passage\": \"p\", \"label\": true}\n");
  expect_error([&] { load_task(find_task("boolq"), wrong_type); }, {wrong_type, "line 1", "'question'", "string"});
  const auto key = dir.write("k.jsonl", R"({"question": {"stem": "q", "choices": [{"text": "a", "label": "A"}]}, "answerKey": "E"})");
  expect_error([&] { load_task(find_task("arc_easy"), key); }, {key, "line 1", "'answerKey'", "E"});
  const auto sciq = dir.write("s.json", R"([{"question": "q", "distractor1": "a", "distractor2": "b", "distractor3": "c",)"
                                        R"( "correct_answer": "d"}])");
  expect_error([&] { load_task(find_task("sciq"), sciq); }, {sciq, "item 1", "'support'"});
  const auto labels = dir.write("v.jsonl", R"({"goal": "a", "sol1": "b", "sol2": "c"})");
  expect_error([&] { load_task(find_task("piqa"), labels); }, {"v-labels.lst", "does not exist"});
  expect_error([] { find_task("mmlu"); }, {"unknown task 'mmlu'", "piqa"});
  expect_error([&] { load_task(find_task("piqa"), dir.path + "/missing.jsonl"); }, {"missing.jsonl", "does not exist"});
  auto tok = eval_testing::byte_tokenizer();
  expect_error([&] { read_documents(empty, {}, tok); }, {empty, "no JSON object"});
  const auto empty_text = dir.write("e.txt", "");
  expect_error([&] { read_documents(empty_text, {}, tok); }, {empty_text, "no document"});
  const auto ppl_field = dir.write("d.jsonl", "{\"body\": \"x\"}\n");
  expect_error([&] { read_documents(ppl_field, {}, tok); }, {ppl_field, "line 1", "'text'"});
}

// The real task files, when the data folder is beside the checkout: the first 20 items of each
// through the formatter and a tiny model (a format check: the model is random).
TEST(EvalTasks, RealTaskFilesFormatAndScore) {
  const std::string dir = eval_testing::shared_data() + "/zeroshot";
  if (!path_exists(dir)) GTEST_SKIP() << "no " << dir;
  auto tok = eval_testing::byte_tokenizer();
  auto model = eval_testing::tiny_model();
  Scorer scorer(*model, {/*max_length=*/256, /*batch_tokens=*/8192, {}});
  auto ll = model_loglikelihood(scorer, tok, 256, "", /*quiet=*/true);
  for (const auto& spec : task_specs()) {
    SCOPED_TRACE(spec.name);
    const auto items = load_task(spec, find_task_file(spec, dir), 20);
    ASSERT_EQ(items.size(), 20u);
    for (const auto& item : items) {
      ASSERT_FALSE(item.requests.empty());
      for (const auto& r : item.requests) EXPECT_FALSE(r.continuation.empty());
    }
    const auto res = score_task(spec, items, ll, scorer.exit_names());
    EXPECT_GE(res.metrics[0].at("acc"), 0.0);
    EXPECT_LE(res.metrics[0].at("acc"), 1.0);
  }
}
