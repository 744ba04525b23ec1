// Zero-shot tasks in lm-evaluation-harness's conventions: each task's prompt, choices and gold
// answer are written down once, in the table of tasks.cpp, next to the file formats it reads.
// A multiple-choice item is scored by the summed log-likelihood of each choice's continuation:
// acc = argmax of the sums, acc_norm = argmax of sum / len(choice) in characters. LAMBADA scores
// the last word: acc = greedy decoding reproduces it, perplexity = exp(-mean log-likelihood).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "lt2/eval/records.h"
#include "lt2/eval/scorer.h"

namespace lt2::eval {

struct McItem {
  std::vector<LLRequest> requests;   // one per choice (LAMBADA: one)
  std::vector<std::string> choices;  // the choice strings acc_norm divides by (in characters)
  int64_t gold = 0;                  // index of the right choice
};

struct TaskSpec {
  std::string name;                // the harness's task name
  std::vector<std::string> files;  // data files tried under --data-dir, in order
  std::string prompt;              // the harness's context -> continuation, for --help and docs
  std::vector<std::string> metrics;  // reported metrics
  std::string primary;             // the metric the multi-task average uses
  bool last_word = false;          // LAMBADA-style: one continuation, greedy match + perplexity
  // The file's records, in the normalized field names format_item reads.
  std::function<std::vector<Record>(const std::string& path)> read;
  std::function<McItem(const Record& r)> format_item;
};

const std::vector<TaskSpec>& task_specs();
// Throws lt2::Error listing the known tasks when `name` is not one.
const TaskSpec& find_task(const std::string& name);
// The first of spec.files that exists under `dir`; throws naming the files tried.
std::string find_task_file(const TaskSpec& spec, const std::string& dir);
// Reads and formats the first `limit` items of `path` (limit < 0: all).
std::vector<McItem> load_task(const TaskSpec& spec, const std::string& path, int64_t limit = -1);

struct TaskResult {
  std::string task;
  int64_t items = 0;
  std::string primary;
  std::vector<std::string> exits;                    // what each column is
  std::vector<std::map<std::string, double>> metrics;  // [exit]: metric -> value (acc in [0, 1])
  json to_json() const;
};

// Scores every item with `ll` (all requests of the task in one call, so they batch together).
TaskResult score_task(const TaskSpec& spec, const std::vector<McItem>& items, const LoglikelihoodFn& ll,
                      const std::vector<std::string>& exits);

// Per exit, the mean over tasks of each task's primary metric.
std::vector<double> average_primary(const std::vector<TaskResult>& results);
// A Markdown table: one row per (task, metric), one column per exit, and the average row.
std::string tasks_markdown(const std::vector<TaskResult>& results);

}  // namespace lt2::eval
