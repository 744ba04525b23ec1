// Reading a text corpus as documents, from files and folders.
//
//   - A folder is searched recursively for *.txt, *.jsonl and *.json files (in sorted path order).
//   - *.jsonl / *.json: one JSON object per line with a string field "text" = one document
//     (empty lines are skipped). A .json file that holds a JSON array instead takes each element
//     (an object with "text", or a string) as a document.
//   - Any other file is plain text, cut into documents by TextSplit: at blank lines (paragraphs,
//     the default), never (the whole file is one document), or at every line.
// The order of documents is deterministic: inputs in the order given, folder contents sorted.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace lt2 {

enum class TextSplit { Paragraph, File, Line };
// "paragraph", "file" or "line"; throws lt2::Error otherwise.
TextSplit parse_text_split(const std::string& name);

class Corpus {
 public:
  // Resolves `inputs` (files or folders) to files. Throws lt2::Error for a missing input or when
  // no file is found.
  Corpus(const std::vector<std::string>& inputs, TextSplit text_split = TextSplit::Paragraph);

  const std::vector<std::string>& files() const { return files_; }
  // Sum of the file sizes.
  int64_t total_bytes() const { return total_bytes_; }

  // Calls `fn` for every document in order, with the number of file bytes read so far (for
  // progress). Throws lt2::Error naming the file and line for malformed JSON lines.
  void for_each(const std::function<void(std::string_view document, int64_t bytes_read)>& fn) const;

 private:
  std::vector<std::string> files_;
  int64_t total_bytes_ = 0;
  TextSplit text_split_;
};

}  // namespace lt2
