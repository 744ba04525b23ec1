// Hugging Face tokenizer.json: the model, added tokens, normalizer, pre-tokenizer, post-processor;
// a tokenizer that loads then encodes and decodes text (the first bytes of the input itself).
#include <algorithm>

#include "fuzz/fuzz_target.h"
#include "lt2/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = lt2::fuzz::bytes(data, size);
  return lt2::fuzz::run([&] {
    const lt2::Tokenizer tok = lt2::Tokenizer::from_json(lt2::parse_json(std::string(input), "tokenizer.json"), "tokenizer.json");
    const auto ids = tok.encode(input.substr(0, std::min<size_t>(input.size(), 256)), /*add_special_tokens=*/true);
    tok.decode(ids);
  });
}
