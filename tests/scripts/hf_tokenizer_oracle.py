#!/usr/bin/env python3
"""Test oracle: Hugging Face `tokenizers` encodes, decodes and trains, so lt2's C++ tests compare
against the reference implementation instead of hand-written expectations.

Commands (all files are JSON unless said otherwise):
  check                                      exit 0 when `tokenizers` imports; print its version
  encode TOKENIZER TEXTS OUT                 TOKENIZER: a tokenizer.json
  encode-gpt2 VOCAB MERGES TEXTS OUT         GPT-2's vocab.json + merges.txt pair
  decode TOKENIZER IDS OUT                   IDS: a list of id lists; OUT: their decoded strings
  nfc TEXTS OUT                              OUT: the texts after HF's NFC normalizer
  train KIND CORPUS VOCAB_SIZE OUT           train a byte-level BPE on the text file CORPUS;
                                             KIND: gpt2 (ByteLevel regex) or llama3 (NFC, Split regex
                                             + ByteLevel, a template post-processor, extra added tokens)
TEXTS is a list of strings. OUT receives, per text, the ids without and with special tokens and
the decoded strings (with and without skipping special tokens):
  {"ids": [[...]], "ids_special": [[...]], "decoded": [...], "decoded_skip": [...]}
"""
import json
import sys


def encode_all(tok, texts_path, out_path):
    with open(texts_path, encoding="utf-8") as f:
        texts = json.load(f)
    result = {"ids": [], "ids_special": [], "decoded": [], "decoded_skip": []}
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        result["ids"].append(ids)
        result["ids_special"].append(tok.encode(text, add_special_tokens=True).ids)
        result["decoded"].append(tok.decode(ids, skip_special_tokens=False))
        result["decoded_skip"].append(tok.decode(ids, skip_special_tokens=True))
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train(kind, corpus, vocab_size, out_path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama3":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        raise SystemExit("unknown kind " + kind)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([corpus], trainer)
    if kind == "llama3":
        bos = tok.token_to_id("<|im_start|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", bos),
                                                                ("<|im_end|>", tok.token_to_id("<|im_end|>"))])
        # Added tokens of the other kinds: normalized, stripping, single-word, plain whitespace.
        tok.add_tokens([
            AddedToken("    ", normalized=True),
            AddedToken("<tab>", lstrip=True, rstrip=True, normalized=False),
            AddedToken("cat", single_word=True, normalized=True),
        ])
        tok.add_special_tokens([AddedToken("<|fim|>", normalized=False, special=True)])
    tok.save(out_path)


def main(argv):
    if len(argv) < 2:
        raise SystemExit(__doc__)
    cmd = argv[1]
    if cmd == "check":
        import tokenizers
        print(tokenizers.__version__)
    elif cmd == "encode":
        from tokenizers import Tokenizer
        encode_all(Tokenizer.from_file(argv[2]), argv[3], argv[4])
    elif cmd == "encode-gpt2":
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.BPE.from_file(argv[2], argv[3]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
        encode_all(tok, argv[4], argv[5])
    elif cmd == "decode":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(argv[2])
        with open(argv[3], encoding="utf-8") as f:
            id_lists = json.load(f)
        with open(argv[4], "w", encoding="utf-8") as f:
            json.dump([tok.decode(ids, skip_special_tokens=False) for ids in id_lists], f)
    elif cmd == "nfc":
        from tokenizers import normalizers
        nfc = normalizers.NFC()
        with open(argv[2], encoding="utf-8") as f:
            texts = json.load(f)
        with open(argv[3], "w", encoding="utf-8") as f:
            json.dump([nfc.normalize_str(t) for t in texts], f)
    elif cmd == "train":
        train(argv[2], argv[3], int(argv[4]), argv[5])
    else:
        raise SystemExit("unknown command " + cmd + "\n" + __doc__)


if __name__ == "__main__":
    main(sys.argv)
