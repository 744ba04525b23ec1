#include "oracle.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::test {

namespace fs = std::filesystem;

namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

// Runs a shell command; returns its exit status and combined output.
int run_command(const std::string& command, std::string& output) {
  output.clear();
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  const int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string oracle_script() { return std::string(LT2_SOURCE_DIR) + "/tests/scripts/hf_tokenizer_oracle.py"; }

}  // namespace

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "lt2-test-XXXXXX").string();
  LT2_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary folder");
  path_ = tmpl;
}

TempDir::~TempDir() {
  try {
    lt2::remove_tree(path_);
  } catch (...) {  // a destructor must not throw; a left-over temp folder is harmless
  }
}

std::string oracle_unavailable() {
  static const std::string reason = [] {
    std::string out;
    if (run_command("python3 --version", out) != 0) return std::string("python3 is not installed");
    if (run_command("python3 " + shell_quote(oracle_script()) + " check", out) != 0)
      return "python3 cannot import Hugging Face `tokenizers` (run scripts/setup.sh): " + out;
    return std::string();
  }();
  return reason;
}

void run_oracle(const std::vector<std::string>& args) {
  std::string command = "python3 " + shell_quote(oracle_script());
  for (const std::string& a : args) command += " " + shell_quote(a);
  std::string output;
  LT2_CHECK(run_command(command, output) == 0, "oracle failed: ", command, "\n", output);
}

OracleResult oracle_encode(const std::string& tokenizer, const std::vector<std::string>& texts,
                           const std::optional<std::string>& merges) {
  TempDir dir;
  write_file_atomic(dir.file("texts.json"), json(texts).dump());
  if (merges)
    run_oracle({"encode-gpt2", tokenizer, *merges, dir.file("texts.json"), dir.file("out.json")});
  else
    run_oracle({"encode", tokenizer, dir.file("texts.json"), dir.file("out.json")});
  const json out = load_json_file(dir.file("out.json"));
  OracleResult r;
  r.ids = out["ids"].get<std::vector<std::vector<int32_t>>>();
  r.ids_special = out["ids_special"].get<std::vector<std::vector<int32_t>>>();
  r.decoded = out["decoded"].get<std::vector<std::string>>();
  r.decoded_skip = out["decoded_skip"].get<std::vector<std::string>>();
  return r;
}

std::string write_english_corpus(const std::string& path, size_t bytes) {
  std::string out;
  const std::string full = path + ".austen";
  if (run_command("Rscript -e " +
                      shell_quote("library(janeaustenr); writeLines(austen_books()$text, '" + full + "')"),
                  out) == 0 &&
      path_exists(full)) {
    std::string text = read_file(full);
    std::remove(full.c_str());
    if (text.size() > bytes) text.resize(text.rfind('\n', bytes) + 1);
    write_file_atomic(path, text);
    return "Jane Austen's novels (r-cran-janeaustenr)";
  }
  // Fallback: sentences assembled from a small word list with a fixed seed, so the BPE still
  // sees a Zipf-like English distribution.
  static const char* const words[] = {
      "the", "of", "and", "to", "a", "in", "was", "her", "it", "that", "she", "not", "be", "as",
      "had", "with", "for", "his", "you", "he", "but", "have", "at", "is", "my", "on", "by", "all",
      "which", "so", "could", "been", "would", "Elizabeth", "Darcy", "Emma", "Mr.", "Mrs.", "very",
      "said", "much", "must", "there", "such", "every", "sister", "happiness", "letter", "never",
      "think", "before", "herself", "Bennet", "Bingley", "Jane", "Harriet", "Knightley", "Anne"};
  std::mt19937 rng(1234);
  std::string text;
  while (text.size() < bytes) {
    const int len = 5 + static_cast<int>(rng() % 15);
    for (int i = 0; i < len; ++i) {
      // Squaring a uniform draw favours the first (most common) words.
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      std::string w = words[static_cast<size_t>(u * u * (sizeof(words) / sizeof(*words)))];
      if (i == 0) w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
      text += (i ? " " : "") + w;
    }
    text += (rng() % 4 == 0) ? ".\n\n" : ". ";
  }
  write_file_atomic(path, text);
  return "generated English-like text (R or janeaustenr not available)";
}

std::vector<std::string> varied_texts(const std::vector<std::string>& specials) {
  std::vector<std::string> t = {
      "",
      " ",
      "Hello world",
      " Hello world",
      "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
      "must be in want of a wife.",
      "I'm sure you'll agree: WE'RE fine, they'd've LEFT. Don't! Isn't it?",
      "Numbers: 1 12 123 1234 12345678901234567890 3.14159 -42 1,000,000 ¼ ½ ² ³ ٣٤٥ ⅷ",
      "中文测试：我爱自然语言处理。今天天气很好！",
      "日本語のテキスト、カタカナとひらがな。",
      "한국어 텍스트 처리 테스트입니다.",
      "العربية: مرحبا بالعالم! كيف حالك؟",
      "हिन्दी में पाठ: नमस्ते दुनिया।",
      "Ελληνικά και Русский текст, עברית.",
      "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇩🇪🇫🇷 ❤️ ✨",
      "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n\tprint(f(i))\n",
      "int main() {\n  std::vector<int> v{1, 2, 3};\n  return v[0] + v.size();\n}\n",
      "{\"key\": [1, 2.5, null], \"s\": \"a\\\\b\"}",
      "Spaces:          end.   \n\n\n   \t\t\t  mixed\t \t",
      "                                                            long run",
      "line one\r\nline two\r\n\r\n  line three\r\n",
      "\n\nleading newlines and trailing spaces   ",
      "Unicode spaces:\u00a0no-break\u2003em\u3000ideographic\u2009thin\u0085nel\u2028ls",
      "Not spaces: a \u180e b\u180e\u180e c \u200b d\ufeff \u180e",
      "Controls: \x01\x02\x1b[31mred\x1b[0m \x7f",
      "Combining: e\u0301 E\u0301 \u00e9 A\u030a \u212b o\u0308\u0304 \u1100\u1161\u11a8 \uac00\u11a8",
      "Accents: café naïve résumé Ångström Øresund ß ﬁ ﬀ",
      "Math: ∀x∈ℝ: x²≥0, ∑_{i=1}^{n} i = n(n+1)/2 ≤ ∞",
      "URL https://example.com/path?q=1&x=%20 and mail a.b@c.de",
      "Mixed: ABCdef123ghi_456 __init__ snake_case camelCase kebab-case",
      "Quotes: “double” ‘single’ «guillemets» „low“ 's 'S 'll",
      "cat concatenate cat_ cats the cat sat; catalog (cat) cat.",
      "²cat cat² Ⓐcat catⅫ cat\u200d 1cat cat1 ٣cat éc\u0301cat cat\u0301 -cat- _cat",
      "Tabs<tab>and <tab> spaced  <tab>  tokens    four spaces        eight",
  };
  for (const std::string& s : specials) {
    t.push_back(s);
    t.push_back("Hello" + s + "world");
    t.push_back("Before " + s + " after " + s + s + "\n" + s);
    t.push_back("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4" + s);
    t.push_back(" " + s + "  x" + s + " ");
  }
  // Seeded random strings over tricky characters.
  static const char* const pool[] = {
      "a", "Z", "e", "0", "7", " ", "  ", "\t", "\n", "\r\n", "'", "'s", "'LL", "!", "?", ".", ",",
      "-", "_", "$", "<", ">", "|", "中", "文", "😀", "🏽", "\u200d", "é", "e\u0301", "\u0301",
      "ß", "ي", "न", "\u094d", "\u00a0", "\u3000", "\u180e", "\u0085", "²", "½", "٣", "\u2028", "ǅ", "ﬁ", "Ω", "\x01",
      "<|", "|>", "endoftext"};
  std::mt19937 rng(42);
  for (int n = 0; n < 300; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 24);
    for (int i = 0; i < len; ++i) {
      if (!specials.empty() && rng() % 40 == 0) {
        s += specials[rng() % specials.size()];
      } else {
        s += pool[rng() % (sizeof(pool) / sizeof(*pool))];
      }
    }
    t.push_back(s);
  }
  return t;
}

std::string published_tokenizers_dir() {
  const std::string dir = std::string(LT2_SOURCE_DIR) + "/../shared/data/tokenizers";
  return path_exists(dir) ? dir : std::string();
}

}  // namespace lt2::test
