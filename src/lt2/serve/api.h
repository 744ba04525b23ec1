// The OpenAI-compatible request side of `lt2 serve` (docs/serve.md): JSON bodies of
// POST /v1/completions and /v1/chat/completions checked field by field into a plain struct, and
// errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) with their HTTP status.
//
// Unknown fields are refused (400, naming the field), as OpenAI's API does ("Unrecognized request
// argument supplied"). Fields OpenAI defines that lt2 does not implement (n > 1, best_of, echo,
// logit_bias, penalties, tools, ...) are accepted only at their neutral value and refused with 400
// otherwise, so a client never silently gets something other than what it asked for.
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/json.h"

namespace lt2::serve {

// An error answered to the client: HTTP status and OpenAI's error object.
struct ApiError : std::runtime_error {
  ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = "",
           std::string code = "")
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
  json body() const;  // {"error": {...}}
};
json error_body(const std::string& message, const std::string& type, const std::string& param = "",
                const std::string& code = "");
// The text of a JSON answer. Bytes that are not UTF-8 (a client's body quoted in a parse error)
// become U+FFFD, so an answer always serializes.
std::string json_text(const json& j);

enum class Endpoint { Completions, Chat };

// A request after validation, before tokenization.
struct ApiRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;
  // Completions: the prompt as text, or as token ids (OpenAI accepts a list of ints).
  std::string prompt_text;
  std::optional<std::vector<int64_t>> prompt_ids;
  std::vector<ChatMessage> messages;  // chat
  std::optional<int64_t> max_tokens;  // unset: completions 16 (OpenAI's default), chat the rest of the context
  double temperature = 1.0;           // OpenAI's default
  double top_p = 1.0;
  int64_t top_k = 0;                  // extension (vLLM's name): 0 or -1 = off
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  int64_t logprobs = -1;              // top-n alternatives per token; -1 = no logprobs
  bool ignore_eos = false;            // extension (vLLM's name): generate exactly max_tokens
  bool return_token_ids = false;      // extension: each choice (and stream chunk) also carries "token_ids"
  std::string user;
};

// Limits of what a request may ask for.
constexpr int64_t kMaxLogprobs = 20;
constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 256;

// Parses and checks a request body. Throws ApiError (400: malformed JSON, a wrong type, an unknown
// field, a value out of range, naming the field in `param`).
ApiRequest parse_request(Endpoint endpoint, const std::string& body);

// A checked request's prompt as token ids, and how many tokens to generate after it.
struct TokenizedRequest {
  std::vector<int64_t> prompt;
  int64_t max_tokens = 0;
};

// Tokenizes a checked request for a model of `vocab_size` tokens and `max_context` tokens a
// sequence: the messages through the tokenizer's chat template, the prompt text encoded, or the
// given ids (each below vocab_size); max_tokens checked against the room the prompt leaves, or
// OpenAI's default (completions 16, chat the rest of the context). Throws ApiError (400: no chat
// template, an id outside the vocabulary, an empty prompt, a prompt or max_tokens that does not fit).
TokenizedRequest tokenize_request(const ApiRequest& a, const Tokenizer& tok, int64_t vocab_size, int64_t max_context);

}  // namespace lt2::serve
