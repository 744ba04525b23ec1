#include "lt2/tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <sstream>

#include "lt2/tokenizer/added_vocabulary.h"
#include "lt2/tokenizer/bpe_model.h"
#include "lt2/tokenizer/chat_template.h"
#include "lt2/tokenizer/byte_level.h"
#include "lt2/tokenizer/normalizer.h"
#include "lt2/tokenizer/pre_tokenizer.h"
#include "lt2/tokenizer/utf8.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2 {

namespace {

// What add_special_tokens adds around a single sequence.
struct PostProcessor {
  std::vector<int32_t> prefix, suffix;
};

// Reads the post_processor config into prefix/suffix ids. `token_id` resolves a token by name.
void parse_post_processor(const json& j, const std::string& where, PostProcessor& pp,
                          const std::function<int32_t(const std::string&, const std::string&)>& token_id) {
  if (j.is_null()) return;
  LT2_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), where,
            ": expected an object with a string 'type', found ", j.dump());
  const std::string type = j["type"].get<std::string>();
  if (type == "ByteLevel") return;  // only adjusts offsets, adds no tokens
  if (type == "Sequence") {
    LT2_CHECK(j.contains("processors") && j["processors"].is_array(), where,
              ": Sequence needs an array 'processors'");
    for (size_t i = 0; i < j["processors"].size(); ++i)
      parse_post_processor(j["processors"][i], cat(where, ".processors[", i, "]"), pp, token_id);
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    // {"cls": ["<s>", 0], "sep": ["</s>", 2]}: cls, the sequence, sep.
    auto read = [&](const char* key) {
      LT2_CHECK(j.contains(key) && j[key].is_array() && j[key].size() == 2, where, ": ", type, " needs '", key,
                "' as [token, id]");
      return json_as<int32_t>(j[key][1], cat(where, ": '", key, "' id"));
    };
    pp.prefix.insert(pp.prefix.begin(), read("cls"));
    pp.suffix.push_back(read("sep"));
    return;
  }
  if (type == "TemplateProcessing") {
    LT2_CHECK(j.contains("single") && j["single"].is_array(), where,
              ": TemplateProcessing needs an array 'single'");
    std::vector<int32_t> before, after;
    bool seen_sequence = false;
    for (const json& item : j["single"]) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      LT2_CHECK(item.contains("SpecialToken") && item["SpecialToken"].contains("id") &&
                    item["SpecialToken"]["id"].is_string(),
                where,
                ": template item must be {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}, found ",
                item.dump());
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      std::vector<int32_t> ids;
      const json* specials = j.contains("special_tokens") ? &j["special_tokens"] : nullptr;
      if (specials && specials->contains(name) && (*specials)[name].contains("ids")) {
        ids = json_as<std::vector<int32_t>>((*specials)[name]["ids"], cat(where, ": special_tokens '", name, "' ids"));
      } else {
        ids.push_back(token_id(name, where));
      }
      std::vector<int32_t>& side = seen_sequence ? after : before;
      side.insert(side.end(), ids.begin(), ids.end());
    }
    pp.prefix.insert(pp.prefix.begin(), before.begin(), before.end());
    pp.suffix.insert(pp.suffix.end(), after.begin(), after.end());
    return;
  }
  throw Error(cat(where, ": unsupported post-processor type '", type,
                  "' (lt2 supports TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel "
                  "and Sequence)"));
}

bool bool_field(const json& obj, const char* key, bool fallback, const std::string& where) {
  bool v = fallback;
  json_get(obj, key, v, where);
  return v;
}

}  // namespace

struct Tokenizer::Impl {
  std::unique_ptr<BpeModel> model;
  std::vector<AddedToken> added;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  PostProcessor post_processor;
  bool byte_level_decoder = true;  // false: no decoder, tokens are joined with spaces (as HF)
  std::unique_ptr<AddedTokenMatcher> raw_matcher;         // added tokens with normalized=false
  std::unique_ptr<AddedTokenMatcher> normalized_matcher;  // added tokens with normalized=true
  std::unordered_map<int32_t, size_t> added_by_id;        // id -> index in `added`
  std::vector<std::string> decoded_bytes;                 // id -> the bytes the decoder gives it
  std::vector<bool> has_token;                            // id -> whether some token has it
  int32_t size = 0;
  // The config sections kept verbatim for save().
  json normalizer_json, pre_tokenizer_json, post_processor_json, decoder_json;
  // The chat template (none: ChatML), or why the checkpoint's could not be read, and the special
  // tokens it sees as variables.
  std::shared_ptr<const ChatTemplate> chat_template;
  std::string chat_template_origin, chat_template_error;
  json chat_variables = json::object();

  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
    pre_tokenizer.split(text, [&](std::string_view word) { model->encode_word(word, ids); });
  }

  void encode_raw_segment(std::string_view text, std::vector<int32_t>& ids) const {
    const std::string normalized_storage =
        normalizer.is_identity() ? std::string() : normalizer.apply(text);
    const std::string_view normalized =
        normalizer.is_identity() ? text : std::string_view(normalized_storage);
    if (normalized_matcher->empty()) {
      encode_plain(normalized, ids);
      return;
    }
    std::vector<Segment> segments;
    normalized_matcher->split(normalized, segments);
    for (const Segment& s : segments) {
      if (s.token >= 0)
        ids.push_back(normalized_matcher->token(s.token).id);
      else
        encode_plain(normalized.substr(s.begin, s.end - s.begin), ids);
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  LT2_CHECK(path_exists(path), "tokenizer file '", path, "' does not exist");
  const json doc = parse_json(read_file(path), path);
  Tokenizer tok = from_json(doc, path);
  const std::filesystem::path p(path);
  if (p.filename() == "tokenizer.json") tok.load_chat_config(p.parent_path().empty() ? "." : p.parent_path().string());
  return tok;
}

Tokenizer Tokenizer::from_json(const json& doc, const std::string& where) {
  // The checks below name the fields they expect; a field of an unexpected JSON type that slips
  // past them still becomes an lt2::Error naming the file.
  try {
    return from_json_checked(doc, where);
  } catch (const json::exception& e) {
    throw Error(cat(where, ": malformed tokenizer.json: ", e.what()));
  }
}

Tokenizer Tokenizer::from_json_checked(const json& doc, const std::string& where) {
  LT2_CHECK(doc.is_object(), where, ": expected a JSON object (a tokenizer.json), found ",
            json_type_name(doc));
  LT2_CHECK(doc.contains("model") && doc["model"].is_object(), where,
            ": no 'model' object (is this a Hugging Face tokenizer.json?)");
  const json& m = doc["model"];
  const std::string model_where = where + ": model";
  std::string type = "BPE";  // old files leave the type out
  json_get(m, "type", type, model_where);
  LT2_CHECK(type == "BPE", model_where, ": unsupported model type '", type,
            "' (lt2 reads byte-level BPE tokenizers only, not WordPiece, Unigram or WordLevel)");
  LT2_CHECK(m.contains("vocab") && m["vocab"].is_object(), model_where,
            ": 'vocab' must be an object mapping tokens to ids");
  LT2_CHECK(m.contains("merges") && m["merges"].is_array(), model_where,
            ": 'merges' must be an array");
  if (m.contains("dropout") && !m["dropout"].is_null())
    LT2_CHECK(m["dropout"].is_number() && m["dropout"].get<double>() == 0.0, model_where,
              ": BPE dropout is not supported (found ", m["dropout"].dump(), ")");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    std::string affix;
    json_get(m, key, affix, model_where);
    LT2_CHECK(affix.empty(), model_where, ": '", key, "' = '", affix,
              "' is not supported (byte-level BPE models leave it empty)");
  }

  // Vocabulary: ids may have gaps; a gap has no token.
  std::vector<std::string> vocab;
  for (const auto& [token, id_json] : m["vocab"].items()) {
    LT2_CHECK(id_json.is_number_integer() && id_json.get<int64_t>() >= 0 && id_json.get<int64_t>() < kMaxTokenIds,
              model_where, ": vocab entry '", token, "' has id ", id_json.dump(), " (expected an integer in [0, ",
              kMaxTokenIds, "))");
    const size_t id = id_json.get<size_t>();
    if (id >= vocab.size()) vocab.resize(id + 1);
    LT2_CHECK(vocab[id].empty(), model_where, ": id ", id, " is used by both '", vocab[id],
              "' and '", token, "'");
    vocab[id] = token;
  }

  // Merges: "left right" strings (older files) or ["left", "right"] pairs (newer files).
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(m["merges"].size());
  for (size_t i = 0; i < m["merges"].size(); ++i) {
    const json& e = m["merges"][i];
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t space = s.find(' ');
      LT2_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                model_where, ": merge ", i, " '", s, "' is not two tokens separated by one space");
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
    } else {
      throw Error(cat(model_where, ": merge ", i, " must be \"a b\" or [\"a\", \"b\"], found ", e.dump()));
    }
  }

  BpeOptions options;
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    std::string unk;
    json_get(m, "unk_token", unk, model_where);
    options.unk_token = unk;
  }
  options.byte_fallback = bool_field(m, "byte_fallback", false, model_where);
  options.ignore_merges = bool_field(m, "ignore_merges", false, model_where);

  auto impl = std::make_unique<Impl>();
  impl->model = std::make_unique<BpeModel>(std::move(vocab), merges, options);

  // Added tokens.
  if (doc.contains("added_tokens") && !doc["added_tokens"].is_null()) {
    LT2_CHECK(doc["added_tokens"].is_array(), where, ": 'added_tokens' must be an array");
    for (size_t i = 0; i < doc["added_tokens"].size(); ++i) {
      const json& t = doc["added_tokens"][i];
      const std::string at = cat(where, ": added_tokens[", i, "]");
      LT2_CHECK(t.is_object() && t.contains("id") && t["id"].is_number_integer() &&
                    t["id"].get<int64_t>() >= 0 && t["id"].get<int64_t>() < kMaxTokenIds && t.contains("content") &&
                    t["content"].is_string(),
                at, ": expected {\"id\": integer in [0, ", kMaxTokenIds, "), \"content\": string, ...}, found ",
                json_describe(t));
      AddedToken a;
      a.id = t["id"].get<int32_t>();
      a.content = t["content"].get<std::string>();
      LT2_CHECK(!a.content.empty(), at, ": empty content");
      a.special = bool_field(t, "special", false, at);
      a.lstrip = bool_field(t, "lstrip", false, at);
      a.rstrip = bool_field(t, "rstrip", false, at);
      a.single_word = bool_field(t, "single_word", false, at);
      a.normalized = bool_field(t, "normalized", !a.special, at);
      LT2_CHECK(!impl->added_by_id.count(a.id), at, ": id ", a.id, " appears twice");
      impl->added_by_id[a.id] = impl->added.size();
      impl->added.push_back(std::move(a));
    }
  }
  std::vector<const AddedToken*> raw, normalized;
  for (const AddedToken& a : impl->added) (a.normalized ? normalized : raw).push_back(&a);
  impl->raw_matcher = std::make_unique<AddedTokenMatcher>(raw);
  impl->normalized_matcher = std::make_unique<AddedTokenMatcher>(normalized);

  impl->normalizer_json = doc.value("normalizer", json());
  impl->pre_tokenizer_json = doc.value("pre_tokenizer", json());
  impl->post_processor_json = doc.value("post_processor", json());
  impl->decoder_json = doc.value("decoder", json());
  impl->normalizer = Normalizer::from_json(impl->normalizer_json, where + ": normalizer");
  impl->pre_tokenizer = PreTokenizer::from_json(impl->pre_tokenizer_json, where + ": pre_tokenizer");
  LT2_CHECK(impl->pre_tokenizer.has_byte_level(), where,
            ": the pre_tokenizer has no ByteLevel step, so this is not a byte-level BPE tokenizer "
            "(lt2 reads byte-level BPE only)");

  const json& dec = impl->decoder_json;
  if (dec.is_null()) {
    impl->byte_level_decoder = false;
  } else {
    LT2_CHECK(dec.is_object() && dec.value("type", "") == "ByteLevel", where,
              ": unsupported decoder ", dec.dump(), " (lt2 supports ByteLevel or none)");
  }

  // Size and per-id decoded bytes.
  int32_t size = impl->model->size();
  for (const AddedToken& a : impl->added) size = std::max(size, a.id + 1);
  impl->size = size;
  impl->decoded_bytes.resize(size);
  impl->has_token.assign(size, false);
  for (int32_t id = 0; id < size; ++id) {
    std::string token;
    if (auto it = impl->added_by_id.find(id); it != impl->added_by_id.end()) {
      token = impl->added[it->second].content;
    } else if (id < impl->model->size()) {
      token = impl->model->id_to_token(id);
    }
    if (token.empty()) continue;
    impl->has_token[id] = true;
    if (impl->byte_level_decoder) {
      // HF's ByteLevel decoder maps a token's characters back to bytes; a token with a character
      // outside the byte alphabet (e.g. an added token of plain spaces) keeps its UTF-8 bytes.
      auto bytes = byte_level::decode(token);
      impl->decoded_bytes[id] = bytes ? *bytes : token;
    } else {
      impl->decoded_bytes[id] = token;
    }
  }

  Impl* raw_impl = impl.get();
  auto token_id = [raw_impl](const std::string& name, const std::string& at) -> int32_t {
    for (const AddedToken& a : raw_impl->added)
      if (a.content == name) return a.id;
    if (auto id = raw_impl->model->token_to_id(name)) return *id;
    throw Error(cat(at, ": token '", name, "' is not in the vocabulary"));
  };
  parse_post_processor(impl->post_processor_json, where + ": post_processor", impl->post_processor,
                       token_id);
  for (const auto* ids : {&impl->post_processor.prefix, &impl->post_processor.suffix})
    for (int32_t id : *ids)
      LT2_CHECK(id >= 0 && id < impl->size && impl->has_token[id], where, ": post_processor adds id ", id,
                ", which is not a token of the vocabulary (", impl->size, " ids)");
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load_gpt2(const std::string& encoder_json, const std::string& vocab_bpe) {
  LT2_CHECK(path_exists(encoder_json), "GPT-2 encoder file '", encoder_json, "' does not exist");
  LT2_CHECK(path_exists(vocab_bpe), "GPT-2 merges file '", vocab_bpe, "' does not exist");
  const json vocab = parse_json(read_file(encoder_json), encoder_json);
  LT2_CHECK(vocab.is_object(), encoder_json, ": expected an object mapping tokens to ids");
  json merges = json::array();
  std::istringstream lines(read_file(vocab_bpe));
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    merges.push_back(line);
  }
  json doc = {
      {"version", "1.0"},
      {"added_tokens", json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  if (vocab.contains("<|endoftext|>"))
    doc["added_tokens"].push_back({{"id", vocab["<|endoftext|>"]},
                                   {"content", "<|endoftext|>"},
                                   {"special", true},
                                   {"normalized", false}});
  return from_json(doc, encoder_json);
}

Tokenizer Tokenizer::byte_level(const std::vector<std::string>& specials) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level::encode(std::string(1, static_cast<char>(b)))] = b;
  json added = json::array();
  for (size_t i = 0; i < specials.size(); ++i) {
    LT2_CHECK(!vocab.contains(specials[i]), "byte-level tokenizer: special token '", specials[i],
              "' is given twice or collides with a byte token");
    vocab[specials[i]] = 256 + i;
    added.push_back({{"id", 256 + i}, {"content", specials[i]}, {"special", true}, {"normalized", false}});
  }
  json doc = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  return from_json(doc, "byte-level tokenizer");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& im = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids = im.post_processor.prefix;
  if (im.raw_matcher->empty()) {
    im.encode_raw_segment(text, ids);
  } else {
    std::vector<Segment> segments;
    im.raw_matcher->split(text, segments);
    for (const Segment& s : segments) {
      if (s.token >= 0)
        ids.push_back(im.raw_matcher->token(s.token).id);
      else
        im.encode_raw_segment(text.substr(s.begin, s.end - s.begin), ids);
    }
  }
  if (add_special_tokens)
    ids.insert(ids.end(), im.post_processor.suffix.begin(), im.post_processor.suffix.end());
  return ids;
}

std::string Tokenizer::decode_bytes(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= im.size || !im.has_token[id]) continue;
    if (skip_special) {
      const auto it = im.added_by_id.find(id);
      if (it != im.added_by_id.end() && im.added[it->second].special) continue;
    }
    if (!im.byte_level_decoder && !first) out.push_back(' ');
    out += im.decoded_bytes[id];
    first = false;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  return utf8::to_valid_lossy(decode_bytes(ids, skip_special));
}

int32_t Tokenizer::vocab_size() const { return impl_->size; }

std::optional<int32_t> Tokenizer::token_to_id(const std::string& token) const {
  for (const AddedToken& a : impl_->added)
    if (a.content == token) return a.id;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  const Impl& im = *impl_;
  if (id < 0 || id >= im.size || !im.has_token[id]) return std::nullopt;
  if (auto it = im.added_by_id.find(id); it != im.added_by_id.end()) return im.added[it->second].content;
  return im.model->id_to_token(id);
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

std::string Tokenizer::to_json_text() const {
  const Impl& im = *impl_;
  const BpeModel& model = *im.model;
  // ordered_json keeps the fields (and the vocabulary, by id) in a readable order.
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int32_t id = 0; id < model.size(); ++id)
    if (!model.id_to_token(id).empty()) vocab[model.id_to_token(id)] = id;
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const auto& [a, b] : model.merges())
    merges.push_back({model.id_to_token(a), model.id_to_token(b)});
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (const AddedToken& a : im.added)
    added.push_back({{"id", a.id},
                     {"content", a.content},
                     {"single_word", a.single_word},
                     {"lstrip", a.lstrip},
                     {"rstrip", a.rstrip},
                     {"normalized", a.normalized},
                     {"special", a.special}});
  const BpeOptions& o = model.options();
  nlohmann::ordered_json doc = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nlohmann::ordered_json::parse(im.normalizer_json.dump())},
      {"pre_tokenizer", nlohmann::ordered_json::parse(im.pre_tokenizer_json.dump())},
      {"post_processor", nlohmann::ordered_json::parse(im.post_processor_json.dump())},
      {"decoder", nlohmann::ordered_json::parse(im.decoder_json.dump())},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", o.unk_token ? nlohmann::ordered_json(*o.unk_token) : nlohmann::ordered_json()},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", o.byte_fallback},
        {"ignore_merges", o.ignore_merges},
        {"vocab", vocab},
        {"merges", merges}}}};
  return doc.dump(1) + "\n";
}

void Tokenizer::save(const std::string& path) const { write_file_atomic(path, to_json_text()); }

void Tokenizer::load_chat_config(const std::string& dir) {
  const std::string config_path = dir + "/tokenizer_config.json";
  const std::string jinja_path = dir + "/chat_template.jinja";
  std::string source, origin;
  if (path_exists(config_path)) {
    const json config = parse_json(read_file(config_path), config_path);
    if (!config.is_object()) return;
    // Special tokens: a string, or an AddedToken object {"content": ...}.
    auto token_text = [](const json& t) -> std::optional<std::string> {
      if (t.is_string()) return t.get<std::string>();
      if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
      return std::nullopt;
    };
    for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
      if (config.contains(key))
        if (auto t = token_text(config[key])) impl_->chat_variables[key] = *t;
    if (config.contains("additional_special_tokens") && config["additional_special_tokens"].is_array()) {
      json list = json::array();
      for (const json& t : config["additional_special_tokens"])
        if (auto text = token_text(t)) list.push_back(*text);
      impl_->chat_variables["additional_special_tokens"] = list;
    }
    if (config.contains("chat_template")) {
      const json& t = config["chat_template"];
      origin = config_path;
      if (t.is_string()) {
        source = t.get<std::string>();
      } else if (t.is_array()) {
        for (const json& named : t)
          if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
              named["template"].is_string())
            source = named["template"].get<std::string>();
        if (source.empty()) impl_->chat_template_error = cat(config_path, ": 'chat_template' lists no template named 'default'");
      } else if (!t.is_null()) {
        impl_->chat_template_error = cat(config_path, ": 'chat_template' must be a string or a list of {name, template}, found ",
                                         json_type_name(t));
      }
    }
  }
  if (path_exists(jinja_path)) {
    source = read_file(jinja_path);
    origin = jinja_path;
    impl_->chat_template_error.clear();
  }
  if (source.empty()) return;
  try {
    set_chat_template(source, origin);
  } catch (const Error& e) {
    impl_->chat_template_error = e.what();
  }
}

void Tokenizer::set_chat_template(std::string_view source, const std::string& where) {
  impl_->chat_template = std::make_shared<const ChatTemplate>(source, where);
  impl_->chat_template_origin = where;
  impl_->chat_template_error.clear();
}

std::string Tokenizer::chat_template_origin() const {
  if (!impl_->chat_template_error.empty()) return cat("none: ", impl_->chat_template_error);
  return impl_->chat_template ? impl_->chat_template_origin : "ChatML (built in)";
}

std::string Tokenizer::apply_chat_template(const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt) const {
  LT2_CHECK(impl_->chat_template_error.empty(), "the chat template cannot be used: ", impl_->chat_template_error);
  if (impl_->chat_template) {
    // The variables transformers passes: the messages, the flag, no tools or documents, and the
    // special tokens.
    json context = impl_->chat_variables;
    context["messages"] = json::array();
    for (const ChatMessage& m : messages) context["messages"].push_back({{"role", m.role}, {"content", m.content}});
    context["add_generation_prompt"] = add_generation_prompt;
    context["tools"] = nullptr;
    context["documents"] = nullptr;
    return impl_->chat_template->render(context);
  }
  static const char* const kStart = "<|im_start|>";
  static const char* const kEnd = "<|im_end|>";
  for (const char* name : {kStart, kEnd}) {
    const bool found = std::any_of(impl_->added.begin(), impl_->added.end(),
                                   [&](const AddedToken& a) { return a.content == name; });
    LT2_CHECK(found, "the ChatML template needs the added token ", name,
              ", which this tokenizer does not have");
  }
  std::string out;
  for (const ChatMessage& m : messages) out += cat(kStart, m.role, "\n", m.content, kEnd, "\n");
  if (add_generation_prompt) out += cat(kStart, "assistant\n");
  return out;
}

}  // namespace lt2
