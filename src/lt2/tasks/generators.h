// Synthetic tasks of the state-tracking + recall curriculum (the LT2 paper): seeded,
// reproducible generators whose train and eval streams never share an example.
//
// Vocabulary (fixed per task kind, independent of n, so one model serves every stage):
//   PAD = 0 (target of unscored positions), BOS = 1, SEP = 2 (segment separator);
//   swap-recall and MQAR: key tokens [3, 3 + pool), value tokens [3 + pool, 3 + 2 * pool);
//     vocab_size = 3 + 2 * pool (pool = 256 by default, n <= pool);
//   S5: permutation tokens [3, 123): token 3 + i is the i-th permutation of {0..4} in
//     lexicographic order (index 0 = identity); vocab_size = 123.
//
// Layouts (q = number of queries = min(n, max_queries), max_queries = 32 by default):
//   swap-recall, m = n swaps:
//     BOS, k_1 v_1 ... k_n v_n, SEP, a_1 b_1 ... a_m b_m, SEP, x_1 y_1 ... x_q y_q
//     n distinct keys bound to n distinct values (both drawn at random from their pools, in
//     random order); swap j exchanges the values held by keys a_j != b_j; query j asks key x_j
//     (distinct keys) and y_j is the value x_j holds after all swaps. L = 3 + 4n + 2q.
//   MQAR: BOS, k_1 v_1 ... k_n v_n, SEP, x_1 y_1 ... x_q y_q
//     n distinct keys, values drawn independently (repeats allowed); queries ask distinct keys
//     and y_j is the value bound to x_j. L = 2 + 2n + 2q.
//   S5 word problem: BOS, g_1 ... g_n
//     g_i uniform over the 120 permutations; the answer at g_i is the running composition
//     p_i = g_i o p_{i-1} (p_0 = identity, (g o p)(x) = g(p(x))). L = 1 + n.
// Scored positions (mask = 1): recall tasks: the position of each query key x_j, whose target
// is y_j (the next token); S5: the position of each g_i, whose target is p_i's token. Targets
// are PAD wherever mask = 0.
//
// Streams: example (stream, index) is drawn from an RNG seeded by (seed, stream, index,
// attempt); an attempt is kept only if content_hash(tokens) % 2 equals the stream (train 0,
// eval 1), so no token sequence can occur in both streams. Answers are a function of the
// tokens, hence no example is shared either.
#pragma once
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace lt2::tasks {

enum class TaskKind { SwapRecall, Mqar, S5 };
enum class Stream : int { Train = 0, Eval = 1 };

std::string task_name(TaskKind kind);   // "swap-recall", "mqar", "s5"
TaskKind parse_task(const std::string& name);  // throws lt2::Error on an unknown name

inline constexpr int64_t kPad = 0, kBos = 1, kSep = 2, kFirstTaskToken = 3;
inline constexpr int64_t kS5Size = 120;

struct TaskParams {
  TaskKind kind = TaskKind::SwapRecall;
  int64_t n = 8;             // pairs (and swaps) for recall tasks, steps for S5
  int64_t pool = 256;        // key and value pool size of the recall tasks (n <= pool)
  int64_t max_queries = 32;  // q = min(n, max_queries), recall tasks only
};

int64_t vocab_size(const TaskParams& p);
int64_t num_queries(const TaskParams& p);  // q (recall tasks); n for S5 (one answer per step)
int64_t seq_len(const TaskParams& p);      // L, per the formulas above

// One example: tokens, targets [L] and mask [L] (1 on scored positions).
struct Sequence {
  std::vector<int64_t> tokens, targets;
  std::vector<uint8_t> mask;
};

// A batch: tokens [B, L] int64, targets [B, L] int64, mask [B, L] bool.
struct Example {
  torch::Tensor tokens, targets, mask;
};

// Example `index` of `stream` for this task and seed (deterministic).
Sequence generate(const TaskParams& p, uint64_t seed, Stream stream, int64_t index);
// Examples first_index .. first_index + batch_size - 1 of the stream, stacked.
Example make_batch(const TaskParams& p, uint64_t seed, Stream stream, int64_t first_index,
                   int64_t batch_size);

// 64-bit hash of a token sequence (FNV-1a over the tokens, then a SplitMix64 finaliser).
uint64_t content_hash(const std::vector<int64_t>& tokens);

// The 120 permutations of {0..4} in lexicographic order; perm[x] is the image of x.
using Perm5 = std::array<int, 5>;
const std::vector<Perm5>& s5_permutations();
int64_t s5_index(const Perm5& perm);

}  // namespace lt2::tasks
