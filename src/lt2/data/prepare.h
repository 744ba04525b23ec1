// Corpus preparation: documents (see corpus.h) -> tokenized train/val shards (see shard.h).
//
// Output folder:
//   train.bin, val.bin   token shards; every document is followed by the separator token
//   tokenizer.json       a byte-for-byte copy of the tokenizer used
//   summary.json         documents, tokens, bytes and bytes per token of each split
// The validation split holds a fixed fraction of the documents, spread evenly over the corpus:
// document i (counting from 0 in corpus order) is held out when floor((i+1) f) > floor(i f).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/data/corpus.h"
#include "lt2/util/json.h"

namespace lt2 {

struct PrepareOptions {
  std::vector<std::string> inputs;     // files and folders
  std::string tokenizer_path;          // a tokenizer.json
  std::string out_dir;
  double val_fraction = 0.01;          // in [0, 1)
  std::string separator = "<|endoftext|>";  // a token of the tokenizer; empty: no separator
  TextSplit text_split = TextSplit::Paragraph;
  int threads = 0;                     // encoding threads; 0: all cores
  bool progress = true;                // progress lines on stderr
};

struct SplitStats {
  int64_t documents = 0, tokens = 0, bytes = 0;
};

struct PrepareSummary {
  SplitStats train, val;
  int32_t vocab_size = 0;
  json to_json() const;
};

PrepareSummary prepare_data(const PrepareOptions& options);

}  // namespace lt2
