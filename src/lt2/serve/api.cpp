#include "lt2/serve/api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "lt2/util/error.h"

namespace lt2::serve {

json error_body(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  return json{{"error",
               {{"message", message},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

json ApiError::body() const { return error_body(what(), type, param, code); }

std::string json_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, message, "invalid_request_error", param); }

std::string type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

bool get_bool(const json& v, const std::string& name) {
  if (!v.is_boolean()) throw bad(name, cat("'", name, "' must be a boolean, found ", type_name(v)));
  return v.get<bool>();
}

double get_number(const json& v, const std::string& name, double lo, double hi) {
  if (!v.is_number()) throw bad(name, cat("'", name, "' must be a number, found ", type_name(v)));
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw bad(name, cat("'", name, "' must be in [", lo, ", ", hi, "], found ", v.dump()));
  return x;
}

// An integer in [lo, hi]; integral floats (2.0) are accepted, as JSON does not tell them apart.
int64_t get_int(const json& v, const std::string& name, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) throw bad(name, cat("'", name, "' must be in [", lo, ", ", hi, "], found ", u));
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto x = v.get<int64_t>();
    if (x < lo || x > hi) throw bad(name, cat("'", name, "' must be in [", lo, ", ", hi, "], found ", x));
    return x;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && d >= static_cast<double>(lo) && d <= static_cast<double>(hi))
      return static_cast<int64_t>(d);
    throw bad(name, cat("'", name, "' must be an integer in [", lo, ", ", hi, "], found ", v.dump()));
  }
  throw bad(name, cat("'", name, "' must be an integer, found ", type_name(v)));
}

std::string get_string(const json& v, const std::string& name) {
  if (!v.is_string()) throw bad(name, cat("'", name, "' must be a string, found ", type_name(v)));
  return v.get<std::string>();
}

std::vector<std::string> get_stop(const json& v) {
  std::vector<std::string> out;
  if (v.is_null()) return out;
  if (v.is_string()) {
    out.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    for (const auto& s : v) {
      if (!s.is_string()) throw bad("stop", cat("'stop' must be a string or an array of strings, found an element that is ", type_name(s)));
      out.push_back(s.get<std::string>());
    }
  } else {
    throw bad("stop", cat("'stop' must be a string or an array of strings, found ", type_name(v)));
  }
  if (out.size() > kMaxStops) throw bad("stop", cat("'stop' holds at most ", kMaxStops, " strings, found ", out.size()));
  for (const auto& s : out) {
    if (s.empty()) throw bad("stop", "'stop' strings must not be empty");
    if (s.size() > kMaxStopBytes) throw bad("stop", cat("'stop' strings are at most ", kMaxStopBytes, " bytes"));
  }
  return out;
}

// The text of a chat message's content: a string, or an array of {"type": "text", "text": ...} parts.
std::string message_content(const json& c, size_t i) {
  const std::string where = cat("messages[", i, "].content");
  if (c.is_string()) return c.get<std::string>();
  if (c.is_null()) return "";
  if (!c.is_array()) throw bad(where, cat("'", where, "' must be a string or an array of text parts, found ", type_name(c)));
  std::string text;
  for (const auto& part : c) {
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
        !part["text"].is_string())
      throw bad(where, cat("'", where, "': only parts of type \"text\" with a string 'text' are supported"));
    text += part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

ApiRequest parse_request(Endpoint endpoint, const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw ApiError(400, cat("the request body is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw ApiError(400, cat("the request body must be a JSON object, found ", type_name(j)));
  const bool chat = endpoint == Endpoint::Chat;
  ApiRequest r;
  r.endpoint = endpoint;
  bool have_input = false;
  bool chat_logprobs = false;
  int64_t top_logprobs = -1;
  for (const auto& [key, v] : j.items()) {
    if (key == "model") {
      r.model = get_string(v, key);
    } else if (key == "prompt" && !chat) {
      have_input = true;
      if (v.is_string()) {
        r.prompt_text = v.get<std::string>();
      } else if (v.is_array() && !v.empty() && v[0].is_number()) {
        std::vector<int64_t> ids;
        for (const auto& t : v) ids.push_back(get_int(t, "prompt", 0, std::numeric_limits<int32_t>::max()));
        r.prompt_ids = std::move(ids);
      } else if (v.is_array() && v.size() == 1 && v[0].is_string()) {
        r.prompt_text = v[0].get<std::string>();
      } else if (v.is_array()) {
        throw bad("prompt", "'prompt' must be a string, an array of token ids, or an array of one string "
                            "(one prompt per request)");
      } else {
        throw bad("prompt", cat("'prompt' must be a string or an array of token ids, found ", type_name(v)));
      }
    } else if (key == "messages" && chat) {
      have_input = true;
      if (!v.is_array() || v.empty()) throw bad("messages", "'messages' must be a non-empty array of messages");
      for (size_t i = 0; i < v.size(); ++i) {
        const auto& m = v[i];
        if (!m.is_object()) throw bad(cat("messages[", i, "]"), cat("messages[", i, "] must be an object"));
        ChatMessage msg;
        for (const auto& [mk, mv] : m.items()) {
          if (mk == "role") {
            msg.role = get_string(mv, cat("messages[", i, "].role"));
          } else if (mk == "content") {
            msg.content = message_content(mv, i);
          } else if (mk == "name") {
            get_string(mv, cat("messages[", i, "].name"));
          } else {
            throw bad(cat("messages[", i, "].", mk), cat("unrecognized message field: 'messages[", i, "].", mk, "'"));
          }
        }
        static const std::set<std::string> roles{"system", "developer", "user", "assistant"};
        if (!roles.count(msg.role))
          throw bad(cat("messages[", i, "].role"), cat("messages[", i, "].role must be one of system, developer, user, "
                                                       "assistant; found '", msg.role, "'"));
        r.messages.push_back(std::move(msg));
      }
    } else if (key == "max_tokens" || (key == "max_completion_tokens" && chat)) {
      if (!v.is_null()) r.max_tokens = get_int(v, key, 0, int64_t{1} << 40);
    } else if (key == "temperature") {
      if (!v.is_null()) r.temperature = get_number(v, key, 0, 2);
    } else if (key == "top_p") {
      if (!v.is_null()) r.top_p = get_number(v, key, 0, 1);
      if (r.top_p == 0) throw bad(key, "'top_p' must be in (0, 1]");
    } else if (key == "top_k") {
      if (!v.is_null()) r.top_k = get_int(v, key, -1, int64_t{1} << 30);
      if (r.top_k < 0) r.top_k = 0;
    } else if (key == "seed") {
      if (!v.is_null()) {
        const int64_t s = get_int(v, key, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
        r.seed = static_cast<uint64_t>(s);
      }
    } else if (key == "stop") {
      r.stop = get_stop(v);
    } else if (key == "stream") {
      if (!v.is_null()) r.stream = get_bool(v, key);
    } else if (key == "stream_options") {
      if (v.is_null()) continue;
      if (!v.is_object()) throw bad(key, "'stream_options' must be an object");
      for (const auto& [sk, sv] : v.items()) {
        if (sk == "include_usage") r.include_usage = get_bool(sv, "stream_options.include_usage");
        else throw bad("stream_options." + sk, cat("unrecognized field: 'stream_options.", sk, "'"));
      }
    } else if (key == "logprobs") {
      if (v.is_null()) continue;
      if (chat) chat_logprobs = get_bool(v, key);
      else r.logprobs = get_int(v, key, 0, kMaxLogprobs);
    } else if (key == "top_logprobs" && chat) {
      if (!v.is_null()) top_logprobs = get_int(v, key, 0, kMaxLogprobs);
    } else if (key == "ignore_eos") {
      r.ignore_eos = get_bool(v, key);
    } else if (key == "return_token_ids") {
      r.return_token_ids = get_bool(v, key);
    } else if (key == "user") {
      if (!v.is_null()) r.user = get_string(v, key);
    } else if (key == "n" || key == "best_of") {
      if (!v.is_null() && get_int(v, key, 1, 1 << 20) != 1) throw bad(key, cat("'", key, "' must be 1 (one choice per request)"));
    } else if (key == "echo" && !chat) {
      if (!v.is_null() && get_bool(v, key)) throw bad(key, "'echo' is not supported");
    } else if (key == "presence_penalty" || key == "frequency_penalty") {
      if (!v.is_null() && get_number(v, key, -2, 2) != 0) throw bad(key, cat("'", key, "' is not supported (only 0)"));
    } else if (key == "logit_bias") {
      if (!v.is_null() && !(v.is_object() && v.empty())) throw bad(key, "'logit_bias' is not supported");
    } else if (key == "suffix" && !chat) {
      if (!v.is_null() && !(v.is_string() && v.get<std::string>().empty())) throw bad(key, "'suffix' is not supported");
    } else if (chat && (key == "tools" || key == "functions")) {
      if (!v.is_null() && !(v.is_array() && v.empty())) throw bad(key, cat("'", key, "' is not supported"));
    } else if (chat && (key == "tool_choice" || key == "function_call")) {
      if (!v.is_null() && !(v.is_string() && v.get<std::string>() == "none")) throw bad(key, cat("'", key, "' is not supported"));
    } else if (chat && key == "parallel_tool_calls") {
      if (!v.is_null()) get_bool(v, key);
    } else if (chat && key == "response_format") {
      if (!v.is_null() && !(v.is_object() && v.value("type", "") == "text" && v.size() == 1))
        throw bad(key, "'response_format' supports only {\"type\": \"text\"}");
    } else {
      throw bad(key, cat("unrecognized request argument supplied: '", key, "'"));
    }
  }
  if (!have_input) {
    const std::string field = chat ? "messages" : "prompt";
    throw bad(field, cat("'", field, "' is required"));
  }
  if (chat) {
    if (top_logprobs >= 0 && !chat_logprobs) throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (chat_logprobs) r.logprobs = std::max<int64_t>(top_logprobs, 0);
  }
  if (r.include_usage && !r.stream) throw bad("stream_options", "'stream_options' is only allowed with 'stream': true");
  return r;
}

TokenizedRequest tokenize_request(const ApiRequest& a, const Tokenizer& tok, int64_t vocab_size, int64_t max_context) {
  const bool chat = a.endpoint == Endpoint::Chat;
  TokenizedRequest t;
  if (chat) {
    std::string text;
    try {
      text = tok.apply_chat_template(a.messages, /*add_generation_prompt=*/true);
    } catch (const Error& e) {
      throw bad("messages", cat("this model has no chat template: ", e.what()));
    }
    for (auto id : tok.encode(text)) t.prompt.push_back(id);
  } else if (a.prompt_ids) {
    for (auto id : *a.prompt_ids) {
      if (id >= vocab_size) throw bad("prompt", cat("prompt token ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
      t.prompt.push_back(id);
    }
  } else {
    for (auto id : tok.encode(a.prompt_text)) t.prompt.push_back(id);
  }
  const int64_t T = static_cast<int64_t>(t.prompt.size()), C = max_context;
  if (T == 0) throw bad("prompt", "the prompt is empty");
  if (T >= C)
    throw ApiError(400, cat("this model's maximum context length is ", C, " tokens; the prompt has ", T,
                            " tokens, which leaves no room to generate"),
                   "invalid_request_error", chat ? "messages" : "prompt", "context_length_exceeded");
  if (a.max_tokens) {
    if (*a.max_tokens < 1) throw bad("max_tokens", "'max_tokens' must be >= 1");
    if (*a.max_tokens > C - T)
      throw ApiError(400, cat("this model's maximum context length is ", C, " tokens; you requested ", T + *a.max_tokens,
                              " tokens (", T, " in the prompt, ", *a.max_tokens, " to generate)"),
                     "invalid_request_error", "max_tokens", "context_length_exceeded");
    t.max_tokens = *a.max_tokens;
  } else {
    t.max_tokens = chat ? C - T : std::min<int64_t>(16, C - T);
  }
  return t;
}

}  // namespace lt2::serve
