// GPT-2's vocab.json + merges.txt pair: the input up to its first NUL byte is vocab.json, the rest
// merges.txt.
#include <algorithm>

#include "fuzz/fuzz_target.h"
#include "lt2/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = lt2::fuzz::bytes(data, size);
  const size_t nul = std::min(input.find('\0'), input.size());
  const lt2::fuzz::ScratchFile vocab("vocab.json", input.substr(0, nul));
  const lt2::fuzz::ScratchFile merges("merges.txt", input.substr(std::min(nul + 1, input.size())));
  return lt2::fuzz::run([&] {
    const lt2::Tokenizer tok = lt2::Tokenizer::load_gpt2(vocab.path, merges.path);
    tok.decode(tok.encode("Hello, world! 123"));
  });
}
