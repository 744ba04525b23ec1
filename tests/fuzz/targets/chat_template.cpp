// The chat-template interpreter (tokenizer/chat_template.h), which parses templates from checkpoint
// files and `lt2 serve --chat-template`, and renders the messages of requests. The input is a
// template source, then optionally the line "@@messages@@" and the variables to render it with:
// a JSON array (the messages), a JSON object (variables such as messages, tools, bos_token, added
// to the context), or other text (its lines, the contents of alternating user and assistant
// messages). The template renders with a fixed conversation, or with the input's variables over
// it, add_generation_prompt false and true: two renders, each within the interpreter's step budget
// (1.5 s or so with the sanitizers), so that an input stays within the fuzzer's 10 s timeout.
#include <algorithm>
#include <optional>

#include "fuzz/fuzz_target.h"
#include "lt2/tokenizer/chat_template.h"

namespace {

// What `vars` (the part after the separator) adds to the context.
lt2::json fuzzed_context(std::string_view vars) {
  lt2::json context = lt2::json::object();
  try {
    const lt2::json j = lt2::parse_json(std::string(vars), "messages");
    if (j.is_object()) return j;
    if (j.is_array()) {
      context["messages"] = j;
      return context;
    }
  } catch (const lt2::Error&) {  // not JSON: lines of text
  }
  context["messages"] = lt2::json::array();
  size_t at = 0;
  for (int turn = 0; at <= vars.size(); ++turn) {
    const size_t end = std::min(vars.find('\n', at), vars.size());
    context["messages"].push_back({{"role", turn % 2 ? "assistant" : "user"}, {"content", vars.substr(at, end - at)}});
    at = end + 1;
  }
  return context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static constexpr std::string_view separator = "\n@@messages@@\n";
  const std::string_view input = lt2::fuzz::bytes(data, size);
  const size_t split = input.find(separator);
  const std::string_view source = input.substr(0, split);
  const std::optional<std::string_view> vars =
      split == std::string_view::npos ? std::nullopt : std::optional(input.substr(split + separator.size()));

  static const lt2::json fixed = {
      {"messages",
       {{{"role", "system"}, {"content", "You are terse."}},
        {{"role", "user"}, {"content", "Hi <|im_end|> {{ x }}"}},
        {{"role", "assistant"}, {"content", "<think>\nhm\n</think>\n\nHello."}},
        {{"role", "user"}, {"content", "Again \xc3\xa9\xf0\x9f\x98\x80"}}}},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"},
      {"tools", nullptr},
      {"documents", nullptr}};
  return lt2::fuzz::run([&] {
    const lt2::ChatTemplate tmpl(source, "chat_template.jinja");
    lt2::json context = fixed;
    if (vars) context.update(fuzzed_context(*vars));
    for (const bool add_generation_prompt : {false, true}) {
      context["add_generation_prompt"] = add_generation_prompt;
      lt2::fuzz::run([&] { tmpl.render(context); });  // a render that fails does not stop the other
    }
  });
}
