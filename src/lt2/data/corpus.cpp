#include "lt2/data/corpus.h"

#include <algorithm>
#include <filesystem>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "lt2/util/json.h"

namespace lt2 {

namespace fs = std::filesystem;

namespace {

// Receives a document and the offset in its file where it ends (for progress).
using DocumentFn = std::function<void(std::string_view, size_t)>;

bool is_json_file(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

bool is_corpus_file(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".txt" || ext == ".jsonl" || ext == ".json";
}

std::string document_text(const json& j, const std::string& where) {
  if (j.is_string()) return j.get<std::string>();
  LT2_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(), where,
            ": expected a JSON object with a string field \"text\", found ",
            j.dump().substr(0, 200));
  return j["text"].get<std::string>();
}

void for_each_json_document(const std::string& path, const std::string& content,
                            const DocumentFn& fn) {
  const size_t first = content.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && content[first] == '[') {
    const json array = parse_json(content, path);
    for (size_t i = 0; i < array.size(); ++i)
      fn(document_text(array[i], cat(path, ": element ", i)), content.size());
    return;
  }
  size_t begin = 0, line_no = 0;
  while (begin < content.size()) {
    size_t end = content.find('\n', begin);
    if (end == std::string::npos) end = content.size();
    ++line_no;
    const std::string_view line(content.data() + begin, end - begin);
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) {
      const std::string where = cat(path, ":", line_no);
      fn(document_text(parse_json(std::string(line), where), where), end);
    }
    begin = end + 1;
  }
}

// Plain text cut at blank lines (lines with only whitespace); each paragraph keeps its inner
// newlines but not the line end after its last line.
void for_each_paragraph(const std::string& content, const DocumentFn& fn) {
  size_t para_begin = std::string::npos, para_end = 0;  // the paragraph being collected
  size_t begin = 0;
  while (begin < content.size()) {
    size_t end = content.find('\n', begin);
    const size_t line_end = end == std::string::npos ? content.size() : end;
    const std::string_view line(content.data() + begin, line_end - begin);
    if (line.find_first_not_of(" \t\r\f\v") == std::string_view::npos) {
      if (para_begin != std::string::npos)
        fn(std::string_view(content).substr(para_begin, para_end - para_begin), para_end);
      para_begin = std::string::npos;
    } else {
      if (para_begin == std::string::npos) para_begin = begin;
      // A CRLF file's paragraph ends before its last '\r'.
      para_end = line_end > begin && content[line_end - 1] == '\r' ? line_end - 1 : line_end;
    }
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  if (para_begin != std::string::npos)
    fn(std::string_view(content).substr(para_begin, para_end - para_begin), para_end);
}

void for_each_line(const std::string& content, const DocumentFn& fn) {
  size_t begin = 0;
  while (begin < content.size()) {
    size_t end = content.find('\n', begin);
    if (end == std::string::npos) end = content.size();
    std::string_view line(content.data() + begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) fn(line, end);
    begin = end + 1;
  }
}

}  // namespace

TextSplit parse_text_split(const std::string& name) {
  if (name == "paragraph") return TextSplit::Paragraph;
  if (name == "file") return TextSplit::File;
  if (name == "line") return TextSplit::Line;
  throw Error(cat("unknown text split '", name, "' (expected paragraph, file or line)"));
}

Corpus::Corpus(const std::vector<std::string>& inputs, TextSplit text_split) : text_split_(text_split) {
  LT2_CHECK(!inputs.empty(), "no input files or folders given");
  for (const std::string& input : inputs) {
    std::error_code ec;
    const auto status = fs::status(input, ec);
    LT2_CHECK(!ec && fs::exists(status), "input '", input, "' does not exist");
    if (fs::is_directory(status)) {
      std::vector<std::string> found;
      for (fs::recursive_directory_iterator it(input, fs::directory_options::follow_directory_symlink, ec), end;
           !ec && it != end; it.increment(ec)) {
        if (it->is_regular_file() && is_corpus_file(it->path())) found.push_back(it->path().string());
      }
      LT2_CHECK(!ec, "cannot list folder '", input, "': ", ec.message());
      LT2_CHECK(!found.empty(), "folder '", input, "' has no *.txt, *.jsonl or *.json files");
      std::sort(found.begin(), found.end());
      files_.insert(files_.end(), found.begin(), found.end());
    } else {
      files_.push_back(input);
    }
  }
  for (const std::string& f : files_) total_bytes_ += static_cast<int64_t>(fs::file_size(f));
}

void Corpus::for_each(const std::function<void(std::string_view, int64_t)>& fn) const {
  int64_t bytes_before = 0;
  for (const std::string& path : files_) {
    const std::string content = read_file(path);
    auto emit = [&](std::string_view doc, size_t end_in_file) {
      fn(doc, bytes_before + static_cast<int64_t>(end_in_file));
    };
    if (is_json_file(path)) {
      for_each_json_document(path, content, emit);
    } else if (text_split_ == TextSplit::File) {
      if (!content.empty()) emit(content, content.size());
    } else if (text_split_ == TextSplit::Line) {
      for_each_line(content, emit);
    } else {
      for_each_paragraph(content, emit);
    }
    bytes_before += static_cast<int64_t>(content.size());
  }
}

}  // namespace lt2
