// `lt2 data prepare`: text corpora -> token shards; `lt2 data info`: a shard's header.
#include <cstdio>
#include <memory>

#include "commands.h"
#include "lt2/data/prepare.h"
#include "lt2/data/shard.h"

namespace lt2::cli {

void add_data_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("data", "Prepare training data: tokenize corpora into token shards");
  cmd->require_subcommand(1);

  struct PrepareArgs {
    PrepareOptions options;
    std::string text_split = "paragraph";
  };
  auto a = std::make_shared<PrepareArgs>();
  CLI::App* prepare = cmd->add_subcommand(
      "prepare",
      "Tokenize documents into DIR/train.bin and DIR/val.bin (+ tokenizer.json, summary.json).\n"
      "Documents: each line of a *.jsonl/*.json file (its \"text\" field); plain text files are cut\n"
      "at blank lines into paragraphs (see --text-split). Each document is followed by the\n"
      "separator token. With f = --val-fraction, every (1/f)-th document (evenly spread,\n"
      "deterministic) goes to val.bin.");
  prepare->add_option("--input", a->options.inputs,
                      "Text files, JSONL files or folders (searched recursively for *.txt, *.jsonl, *.json)")
      ->required()->expected(1, -1);
  prepare->add_option("--tokenizer", a->options.tokenizer_path, "A Hugging Face tokenizer.json")->required();
  prepare->add_option("--out", a->options.out_dir, "Output folder (created if missing)")->required();
  prepare->add_option("--val-fraction", a->options.val_fraction,
                      "Fraction of documents held out for validation, in [0, 1)")
      ->capture_default_str();
  prepare->add_option("--separator", a->options.separator,
                      "Token written after every document (\"\" for none); must be a token of the tokenizer")
      ->capture_default_str();
  prepare->add_option("--text-split", a->text_split,
                      "How plain text files are cut into documents: paragraph (at blank lines), file "
                      "(whole file), or line")
      ->capture_default_str();
  prepare->add_option("--threads", a->options.threads, "Encoding threads (0: all cores)")->capture_default_str();
  prepare->callback([a] {
    a->options.text_split = parse_text_split(a->text_split);
    const PrepareSummary s = prepare_data(a->options);
    std::printf("%s\n", s.to_json().dump(2).c_str());
  });

  auto shard_path = std::make_shared<std::string>();
  CLI::App* info = cmd->add_subcommand("info", "Print the header of a token shard as JSON");
  info->add_option("shard", *shard_path, "A .bin token shard")->required();
  info->callback([shard_path] {
    const ShardReader r(*shard_path);
    std::printf("%s\n", json({{"path", r.path()},
                              {"tokens", r.size()},
                              {"vocab_size", r.vocab_size()},
                              {"bytes_per_token", r.token_bytes()}})
                            .dump(2)
                            .c_str());
  });
}

}  // namespace lt2::cli
