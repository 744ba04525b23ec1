// `lt2 tokenizer train|encode|decode`: train a byte-level BPE, or use any HF tokenizer.json.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>

#include "commands.h"
#include "lt2/data/corpus.h"
#include "lt2/tokenizer/pre_tokenizer.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/tokenizer/trainer.h"
#include "lt2/util/error.h"

namespace lt2::cli {

namespace {

struct TokenizerTrainArgs {
  std::vector<std::string> inputs;
  int32_t vocab_size = 32000;
  std::string out = "tokenizer.json";
  std::vector<std::string> specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  int64_t min_frequency = 2;
  std::string pattern = "llama3";
  std::string text_split = "paragraph";
  int threads = 0;
};

void run_tokenizer_train(const TokenizerTrainArgs& a) {
  BpeTrainerOptions o;
  o.special_tokens.clear();
  o.vocab_size = a.vocab_size;
  o.min_frequency = a.min_frequency;
  for (const std::string& s : a.specials)
    if (!s.empty()) o.special_tokens.push_back(s);
  o.threads = a.threads;
  if (a.pattern == "llama3")
    o.split_pattern = kLlama3SplitPattern;
  else if (a.pattern == "gpt2")
    o.split_pattern = kGpt2SplitPattern;
  else
    o.split_pattern = a.pattern;
  o.progress = [](const std::string& line) { std::fprintf(stderr, "tokenizer train: %s\n", line.c_str()); };
  const auto start = std::chrono::steady_clock::now();
  const Corpus corpus(a.inputs, parse_text_split(a.text_split));
  BpeTrainer trainer(o);
  corpus.for_each([&](std::string_view doc, int64_t) { trainer.add_text(doc); });
  const Tokenizer tok = trainer.train();
  tok.save(a.out);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("trained a %d-token BPE on %.1f MB in %.1f s -> %s\n", tok.vocab_size(),
              trainer.bytes_added() / 1e6, secs, a.out.c_str());
}

std::string read_stdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

void add_tokenizer_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("tokenizer", "Train a byte-level BPE tokenizer, or encode/decode with a tokenizer.json");
  cmd->require_subcommand(1);

  auto train_args = std::make_shared<TokenizerTrainArgs>();
  CLI::App* train = cmd->add_subcommand("train", "Train a byte-level BPE tokenizer (HF tokenizer.json output)");
  train->add_option("--input", train_args->inputs,
                    "Text files, JSONL files (a \"text\" field per line) or folders (searched for "
                    "*.txt, *.jsonl, *.json)")
      ->required()->expected(1, -1);
  train->add_option("--vocab-size", train_args->vocab_size,
                    "Target vocabulary size, including the 256 byte tokens and the special tokens")
      ->capture_default_str();
  train->add_option("--out", train_args->out, "Output tokenizer.json")->capture_default_str();
  train->add_option("--special", train_args->specials,
                    "Special tokens, given ids 0, 1, ... in this order (--special \"\" for none)")
      ->capture_default_str()->expected(1, -1);
  train->add_option("--min-frequency", train_args->min_frequency,
                    "Never merge a pair seen fewer times than this")
      ->capture_default_str();
  train->add_option("--pattern", train_args->pattern,
                    "Word split regex: llama3 (digits in groups of 3, case-insensitive "
                    "contractions), gpt2, or a PCRE2 regex")
      ->capture_default_str();
  train->add_option("--text-split", train_args->text_split,
                    "How plain text files are cut into documents: paragraph (at blank lines), file, or line")
      ->capture_default_str();
  train->add_option("--threads", train_args->threads, "Word counting threads (0: all cores)")->capture_default_str();
  train->callback([train_args] { run_tokenizer_train(*train_args); });

  struct EncodeArgs {
    std::string tokenizer, text;
    bool json = false, add_special = false;
  };
  auto enc = std::make_shared<EncodeArgs>();
  CLI::App* encode = cmd->add_subcommand("encode", "Print the token ids of a text");
  encode->add_option("--tokenizer", enc->tokenizer, "A Hugging Face tokenizer.json")->required();
  encode->add_option("--text", enc->text, "Text to encode (default: read standard input)");
  encode->add_flag("--json", enc->json, "Print {\"ids\": [...], \"tokens\": [...]} instead of ids separated by spaces");
  encode->add_flag("--add-special-tokens", enc->add_special,
                   "Add the tokens of the tokenizer's post-processor (e.g. a BOS token)");
  encode->callback([enc, encode] {
    const Tokenizer tok = Tokenizer::load(enc->tokenizer);
    const std::string text = encode->count("--text") ? enc->text : read_stdin();
    const std::vector<int32_t> ids = tok.encode(text, enc->add_special);
    if (enc->json) {
      json tokens = json::array();
      for (int32_t id : ids) tokens.push_back(tok.id_to_token(id).value_or(""));
      std::printf("%s\n", json({{"ids", ids}, {"tokens", tokens}}).dump().c_str());
    } else {
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
      std::printf("%s\n", line.c_str());
    }
  });

  struct DecodeArgs {
    std::string tokenizer;
    std::vector<int64_t> ids;
    bool skip_special = false;
  };
  auto dec = std::make_shared<DecodeArgs>();
  CLI::App* decode = cmd->add_subcommand("decode", "Print the text of token ids");
  decode->add_option("--tokenizer", dec->tokenizer, "A Hugging Face tokenizer.json")->required();
  decode->add_option("ids", dec->ids, "Token ids")->expected(0, -1);
  decode->add_flag("--skip-special", dec->skip_special, "Leave out special tokens");
  decode->callback([dec] {
    const Tokenizer tok = Tokenizer::load(dec->tokenizer);
    std::vector<int32_t> ids;
    for (int64_t id : dec->ids) {
      LT2_CHECK(id >= 0 && id < tok.vocab_size(), "token id ", id, " is outside the vocabulary [0, ",
                tok.vocab_size(), ")");
      ids.push_back(static_cast<int32_t>(id));
    }
    const std::string text = tok.decode(ids, dec->skip_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  });
}

}  // namespace lt2::cli
