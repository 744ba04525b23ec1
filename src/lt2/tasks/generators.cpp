#include "lt2/tasks/generators.h"

#include <algorithm>
#include <numeric>

#include "lt2/util/error.h"
#include "lt2/util/hash.h"

namespace lt2::tasks {
namespace {

// SplitMix64 stream: platform-independent, unlike the std:: distributions.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return splitmix64(state_ - 0x9E3779B97F4A7C15ull);
  }
  // Uniform in [0, bound), by rejection (no modulo bias).
  int64_t below(int64_t bound) {
    const uint64_t b = static_cast<uint64_t>(bound);
    const uint64_t limit = UINT64_MAX - UINT64_MAX % b;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return static_cast<int64_t>(x % b);
  }
  // `count` distinct values of [0, range), in random order (partial Fisher-Yates).
  std::vector<int64_t> distinct(int64_t count, int64_t range) {
    std::vector<int64_t> all(range);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t i = 0; i < count; ++i) std::swap(all[i], all[i + below(range - i)]);
    all.resize(count);
    return all;
  }

 private:
  uint64_t state_;
};

void check_params(const TaskParams& p) {
  LT2_CHECK(p.n >= 1, "task n must be >= 1, got ", p.n);
  if (p.kind == TaskKind::S5) return;
  LT2_CHECK(p.pool >= 2, "task pool must be >= 2, got ", p.pool);
  LT2_CHECK(p.n <= p.pool, task_name(p.kind), ": n = ", p.n, " exceeds the key/value pool (", p.pool, ")");
  LT2_CHECK(p.max_queries >= 1, "max_queries must be >= 1, got ", p.max_queries);
  LT2_CHECK(p.kind != TaskKind::SwapRecall || p.n >= 2, "swap-recall needs n >= 2, got ", p.n);
}

int64_t key_token(int64_t k) { return kFirstTaskToken + k; }
int64_t value_token(const TaskParams& p, int64_t v) { return kFirstTaskToken + p.pool + v; }

// Appends a query segment: for each query key, its token (scored, target = value) then the value.
void append_queries(Sequence& s, const std::vector<int64_t>& query_keys,
                    const std::vector<int64_t>& answers) {
  for (size_t j = 0; j < query_keys.size(); ++j) {
    s.tokens.push_back(query_keys[j]);
    s.targets.push_back(answers[j]);
    s.mask.push_back(1);
    s.tokens.push_back(answers[j]);
    s.targets.push_back(kPad);
    s.mask.push_back(0);
  }
}

void append_unscored(Sequence& s, int64_t token) {
  s.tokens.push_back(token);
  s.targets.push_back(kPad);
  s.mask.push_back(0);
}

Sequence gen_recall(const TaskParams& p, Rng& rng) {
  const int64_t n = p.n, q = num_queries(p);
  const std::vector<int64_t> keys = rng.distinct(n, p.pool);
  std::vector<int64_t> values(n);  // values[i] is held by keys[i]
  if (p.kind == TaskKind::SwapRecall) {
    values = rng.distinct(n, p.pool);
  } else {
    for (auto& v : values) v = rng.below(p.pool);
  }
  Sequence s;
  append_unscored(s, kBos);
  for (int64_t i = 0; i < n; ++i) {
    append_unscored(s, key_token(keys[i]));
    append_unscored(s, value_token(p, values[i]));
  }
  append_unscored(s, kSep);
  if (p.kind == TaskKind::SwapRecall) {
    for (int64_t j = 0; j < n; ++j) {  // m = n swaps of two distinct bound keys
      const int64_t a = rng.below(n);
      const int64_t b = (a + 1 + rng.below(n - 1)) % n;
      std::swap(values[a], values[b]);
      append_unscored(s, key_token(keys[a]));
      append_unscored(s, key_token(keys[b]));
    }
    append_unscored(s, kSep);
  }
  std::vector<int64_t> query_keys, answers;
  for (int64_t i : rng.distinct(q, n)) {
    query_keys.push_back(key_token(keys[i]));
    answers.push_back(value_token(p, values[i]));
  }
  append_queries(s, query_keys, answers);
  return s;
}

Sequence gen_s5(const TaskParams& p, Rng& rng) {
  const auto& perms = s5_permutations();
  Sequence s;
  append_unscored(s, kBos);
  Perm5 state = perms[0];
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t g = rng.below(kS5Size);
    Perm5 next;
    for (int x = 0; x < 5; ++x) next[x] = perms[g][state[x]];
    state = next;
    s.tokens.push_back(kFirstTaskToken + g);
    s.targets.push_back(kFirstTaskToken + s5_index(state));
    s.mask.push_back(1);
  }
  return s;
}

}  // namespace

std::string task_name(TaskKind kind) {
  switch (kind) {
    case TaskKind::SwapRecall: return "swap-recall";
    case TaskKind::Mqar: return "mqar";
    case TaskKind::S5: return "s5";
  }
  return "?";
}

TaskKind parse_task(const std::string& name) {
  for (TaskKind k : {TaskKind::SwapRecall, TaskKind::Mqar, TaskKind::S5})
    if (task_name(k) == name) return k;
  throw Error(cat("unknown task '", name, "' (expected swap-recall, mqar or s5)"));
}

int64_t vocab_size(const TaskParams& p) {
  return p.kind == TaskKind::S5 ? kFirstTaskToken + kS5Size : kFirstTaskToken + 2 * p.pool;
}

int64_t num_queries(const TaskParams& p) {
  return p.kind == TaskKind::S5 ? p.n : std::min(p.n, p.max_queries);
}

int64_t seq_len(const TaskParams& p) {
  check_params(p);
  const int64_t n = p.n, q = num_queries(p);
  switch (p.kind) {
    case TaskKind::SwapRecall: return 3 + 4 * n + 2 * q;
    case TaskKind::Mqar: return 2 + 2 * n + 2 * q;
    case TaskKind::S5: return 1 + n;
  }
  return 0;
}

uint64_t content_hash(const std::vector<int64_t>& tokens) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (int64_t t : tokens) {
    h ^= static_cast<uint64_t>(t);
    h *= 0x100000001B3ull;
  }
  return splitmix64(h);
}

Sequence generate(const TaskParams& p, uint64_t seed, Stream stream, int64_t index) {
  check_params(p);
  LT2_CHECK(index >= 0, "example index must be >= 0, got ", index);
  const uint64_t parity = static_cast<uint64_t>(stream);
  const uint64_t base = splitmix64(splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(p.kind)) ^
                                   (static_cast<uint64_t>(index) * 2 + parity));
  for (uint64_t attempt = 0;; ++attempt) {
    Rng rng(splitmix64(base + attempt));
    Sequence s = p.kind == TaskKind::S5 ? gen_s5(p, rng) : gen_recall(p, rng);
    if (content_hash(s.tokens) % 2 == parity) return s;
  }
}

Example make_batch(const TaskParams& p, uint64_t seed, Stream stream, int64_t first_index,
                   int64_t batch_size) {
  LT2_CHECK(batch_size >= 1, "batch size must be >= 1, got ", batch_size);
  const int64_t L = seq_len(p);
  Example ex;
  ex.tokens = torch::empty({batch_size, L}, torch::kInt64);   // [B, L]
  ex.targets = torch::empty({batch_size, L}, torch::kInt64);  // [B, L]
  ex.mask = torch::empty({batch_size, L}, torch::kBool);      // [B, L]
  auto tok = ex.tokens.accessor<int64_t, 2>();
  auto tgt = ex.targets.accessor<int64_t, 2>();
  auto msk = ex.mask.accessor<bool, 2>();
  for (int64_t b = 0; b < batch_size; ++b) {
    const Sequence s = generate(p, seed, stream, first_index + b);
    for (int64_t i = 0; i < L; ++i) {
      tok[b][i] = s.tokens[i];
      tgt[b][i] = s.targets[i];
      msk[b][i] = s.mask[i] != 0;
    }
  }
  return ex;
}

const std::vector<Perm5>& s5_permutations() {
  static const std::vector<Perm5> perms = [] {
    std::vector<Perm5> all;
    Perm5 p = {0, 1, 2, 3, 4};
    do all.push_back(p);
    while (std::next_permutation(p.begin(), p.end()));
    return all;
  }();
  return perms;
}

int64_t s5_index(const Perm5& perm) {
  // Lehmer code: rank in lexicographic order.
  static const int64_t factorial[5] = {24, 6, 2, 1, 1};
  int64_t rank = 0;
  for (int i = 0; i < 5; ++i) {
    LT2_CHECK(perm[i] >= 0 && perm[i] < 5, "not a permutation of {0..4}");
    int smaller_after = 0;
    for (int j = i + 1; j < 5; ++j) smaller_after += perm[j] < perm[i];
    rank += smaller_after * factorial[i];
  }
  return rank;
}

}  // namespace lt2::tasks
