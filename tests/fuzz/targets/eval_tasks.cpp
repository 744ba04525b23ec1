// The task files `lt2 eval --task NAME --data FILE` reads, in every format of every task (JSONL,
// JSON arrays, PIQA's labels file, HellaSwag's six-line text, OpenBookQA's TSV, COPA's XML), read
// and formatted into the requests that get scored. The input's first line is "TASK FILE"; the rest
// is the folder FILE is in (fuzz_target.h: ScratchFolder), so a task can read a file beside it.
#include "fuzz/fuzz_target.h"
#include "lt2/eval/tasks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = lt2::fuzz::bytes(data, size);
  const size_t line_end = input.find('\n');
  if (line_end == std::string_view::npos) return 0;
  const std::string_view first = input.substr(0, line_end);
  const size_t space = first.find(' ');
  if (space == std::string_view::npos) return 0;
  const std::string task(first.substr(0, space)), file(first.substr(space + 1));
  if (file.empty() || file.find('/') != std::string::npos) return 0;
  lt2::fuzz::ScratchFolder folder("eval_tasks", input.substr(line_end + 1));
  if (!folder.ok) return 0;
  return lt2::fuzz::run([&] { lt2::eval::load_task(lt2::eval::find_task(task), folder.path + "/" + file); });
}
