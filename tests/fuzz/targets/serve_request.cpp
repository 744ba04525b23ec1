// `lt2 serve`'s request side: the input is a request body, checked as a /v1/completions and as a
// /v1/chat/completions request (serve/api.h), each request that passes tokenized for a small model
// (a byte-level tokenizer with ChatML's tokens, 4096 tokens of context), and the prompt's tokens
// then streamed back, one token's bytes at a time, through the request's stop strings
// (serve/text_stream.h). A refused request is an ApiError; the streamed text must be valid UTF-8 and
// equal the whole text's (invalid bytes as U+FFFD) up to the first stop string, without it.
#include <algorithm>
#include <stdexcept>

#include "fuzz/fuzz_target.h"
#include "lt2/serve/api.h"
#include "lt2/serve/text_stream.h"

namespace {

using namespace lt2::serve;

void check(bool ok, const char* what) {
  if (!ok) throw std::logic_error(what);  // not an lt2::Error: escapes as a finding
}

void stream_back(const std::vector<int64_t>& prompt, const std::vector<std::string>& stops, const lt2::Tokenizer& tok) {
  TextStream stream(stops);
  std::string raw, streamed;
  bool stopped = false;
  for (int64_t id : prompt) {
    const std::string bytes = tok.decode_bytes({static_cast<int32_t>(id)}, /*skip_special=*/true);
    raw += bytes;
    const auto u = stream.push(bytes);
    streamed += u.text;
    if (u.stopped) {
      stopped = true;
      break;
    }
  }
  if (!stopped) streamed += stream.flush();
  check(streamed == stream.emitted(), "the updates add up to emitted()");
  check(valid_utf8(streamed), "the streamed text is valid UTF-8");
  std::string whole;
  utf8_sanitize(raw, 0, /*final=*/true, whole);
  size_t first_stop = std::string::npos;
  for (const auto& s : stops) first_stop = std::min(first_stop, whole.find(s));
  check(stopped == (first_stop != std::string::npos), "a stream stops exactly when its text holds a stop string");
  check(streamed == whole.substr(0, first_stop), "the streamed text is the whole text up to the first stop string");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const lt2::Tokenizer tok = lt2::Tokenizer::byte_level({"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  const std::string body(lt2::fuzz::bytes(data, size));
  for (const Endpoint endpoint : {Endpoint::Completions, Endpoint::Chat}) {
    lt2::fuzz::run([&] {
      try {
        const ApiRequest a = parse_request(endpoint, body);
        const TokenizedRequest t = tokenize_request(a, tok, tok.vocab_size(), /*max_context=*/4096);
        check(!t.prompt.empty() && t.max_tokens >= 1 && static_cast<int64_t>(t.prompt.size()) + t.max_tokens <= 4096,
              "a tokenized request fits the context");
        stream_back(t.prompt, a.stop, tok);
      } catch (const ApiError& e) {
        check(e.status == 400, "a refused request is a 400");
        json_text(e.body());  // the answer to the client serializes
      }
    });
  }
  return 0;
}
