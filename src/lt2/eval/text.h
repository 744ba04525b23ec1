// Text rules of lm-evaluation-harness that the evaluations reproduce exactly (Python semantics:
// `\s` is Unicode whitespace, lengths count code points).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lt2::eval {

// Python's len(s) for a UTF-8 string: code points (invalid bytes count one each).
int64_t count_chars(std::string_view s);
// The harness's word count, len(re.split(r"\s+", s)): one more than the runs of whitespace, so
// leading and trailing whitespace each add an empty "word" as in Python.
int64_t count_words(std::string_view s);
// Python's str.strip(), str.lstrip() and str.rstrip() (Unicode whitespace).
std::string strip(std::string_view s);
std::string lstrip(std::string_view s);
std::string rstrip(std::string_view s);
// Python's str.replace(from, to): every non-overlapping occurrence, left to right.
std::string replace_all(std::string_view s, std::string_view from, std::string_view to);
// re.sub(r"\s+", " ", s): every whitespace run becomes one space.
std::string collapse_whitespace(std::string_view s);

// The harness's `wikitext` task (EleutherAI/wikitext_document_level): a file is cut into
// articles at each line that, after "= = =" -> "===" and "= =" -> "==" and stripping, starts with
// "= " and ends with " =" (a level-1 heading " = Title = "); the heading line starts its article.
// Articles with only whitespace are dropped.
std::vector<std::string> split_wikitext_articles(std::string_view raw);
// The harness's wikitext_detokenizer (preprocess_wikitext.py): undoes WikiText's tokenisation
// (" @-@ " -> "-", " , " -> ", ", spaces inside brackets and quotes, " 's" -> "'s", ...).
std::string wikitext_detokenize(std::string_view page);

// HellaSwag's preprocess (harness hellaswag/utils.py): strip, " [title]" -> ". ", remove every
// "[...]" (shortest match), "  " -> " ".
std::string hellaswag_preprocess(std::string_view text);

}  // namespace lt2::eval
