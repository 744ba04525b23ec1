// lt2::ChatTemplate: the Jinja subset that Hugging Face chat templates use, rendered as
// transformers renders them (jinja2 with trim_blocks, lstrip_blocks and the loop controls).
//
// Supported:
//   - {{ expr }}, {% statement %}, {# comment #}; whitespace control with '-' ({%- -%}) and '+'
//     ({%+, which keeps lstrip_blocks from stripping); one trailing newline of the source dropped;
//   - statements: if/elif/else, for (tuple unpacking, an inline `if` filter, `else`, loop.index,
//     index0, revindex, revindex0, first, last, length, previtem, nextitem), break, continue, set
//     (names, tuples, `ns.attr` on a namespace(), and block form), macro with defaults and call,
//     generation (rendered as its body);
//   - expressions: string/number/bool/none literals, lists, tuples, dicts, attribute and item
//     access, slices (messages[1:], s[::-1]), calls, filters (|), tests (is / is not), ternary
//     `a if c else b`, and/or/not, in / not in, comparisons, + - * / // % **, ~ concatenation;
//   - globals: raise_exception(msg) (throws lt2::Error with msg), range, namespace, dict,
//     strftime_now;
//   - filters: abs, capitalize, count, default/d, first, float, indent, int, items, join, last,
//     length, list, lower, map, reject, rejectattr, replace, reverse, round, safe, select,
//     selectattr, sort, string, sum, title, tojson (transformers': ensure_ascii=False, indent,
//     sort_keys), trim, unique, upper;
//   - tests: defined, undefined, none, boolean, true, false, string, number, integer, float,
//     mapping, sequence, iterable, callable, odd, even, divisibleby, eq/equalto/==, ne/!=, lt, le,
//     gt, ge, in, lower, upper;
//   - methods: str strip/lstrip/rstrip/split/rsplit/startswith/endswith/upper/lower/title/
//     capitalize/replace/find/count/join/splitlines, dict get/items/keys/values.
// Unlike jinja2, a namespace() cannot hold another namespace() (nor a list or dict holding one), and
// lists and dicts nest at most 200 levels: values stay acyclic and shallow.
// Errors (a syntax error, an unknown filter, an undefined value used in arithmetic, a step or
// output budget exceeded) are lt2::Error naming the construct and its line:column.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "lt2/util/json.h"

namespace lt2 {

class ChatTemplate {
 public:
  // Parses `source`; `where` names it in error messages (e.g. the file it came from).
  explicit ChatTemplate(std::string_view source, std::string where = "chat template");
  // Renders with the variables of the JSON object `context` (messages, add_generation_prompt,
  // bos_token, ...). Thread-safe.
  std::string render(const json& context) const;

  struct Program;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace lt2
