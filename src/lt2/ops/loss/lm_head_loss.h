// The LM head and its loss in one chunked pass: the loss of softmax(hidden W^T) against a target
// and its gradients w.r.t. hidden and W, without the [tokens x vocab] logits ever existing whole
// (at a 128k vocabulary they are the largest activation of a training step).
//
// The walk takes the tokens a chunk at a time. For each chunk it forms the chunk's logits
// (hidden_c W^T, in fp32), hands them to the target, which returns the chunk's summed loss and
// G_c = d(loss)/d(logits) in the products' dtype, and, while the chunk is at hand, forms the
// gradients: d hidden_c = G_c W and dW += G_c^T hidden_c. The forward pass thus does the backward's
// products too (the same three products as the reference's forward and backward), so backward only
// scales the two saved gradients by the incoming gradient. Memory: a chunk's logits, log-probs and
// gradient, plus the saved d hidden [N, d] and dW [V, d], instead of the reference's [N, V]
// logits, log-probabilities and their gradients.
//
// Cost beyond the products: each chunk's logits are written once and read by log_softmax, exp and
// the cast to the products' dtype (about 30 bytes a logit under bf16 autocast against the
// reference's ~50), and dW, in fp32, is read and written once a chunk (8 V d bytes): the larger the
// chunk, the less that traffic weighs against the chunk's 6 n V d FLOPs. The target side is a small
// policy (HeadLossTarget), so the same walk serves hard labels (the LM loss) and a teacher's
// distribution (logit distillation).
#pragma once
#include <torch/torch.h>

#include <optional>

namespace lt2::ops {

using torch::Tensor;

// What a chunk scores: its loss summed over its rows, and that sum's gradient w.r.t. its logits.
struct ChunkScore {
  Tensor loss;  // 0-dim, the logits' dtype
  Tensor grad;  // [n, V] in the dtype asked for; undefined when none was
};

// What each chunk of the student's logits is scored against.
class HeadLossTarget {
 public:
  virtual ~HeadLossTarget() = default;
  // Throws lt2::Error unless the target scores `rows` rows of `vocab` logits on `device`.
  virtual void check(int64_t rows, int64_t vocab, torch::Device device) const = 0;
  // logits: the [n, V] logits of rows [begin, begin + n), fp32 (float64 for float64 inputs), handed
  // over so the target can free them once read. grad_dtype: the gradient's dtype, none for no
  // gradient.
  virtual ChunkScore score(Tensor logits, int64_t begin, std::optional<torch::ScalarType> grad_dtype) const = 0;
  // The rows that count: the denominator of the mean (0-dim, on the target's device).
  virtual Tensor count() const = 0;
};

// Cross-entropy against hard labels: -log softmax(logits)[label] per row, gradient
// softmax - onehot(label). labels: [N] int64, each in [0, vocab) or ignore_index; rows labelled
// ignore_index score 0 and do not count. The constructor checks the labels (one host sync).
class HardLabels final : public HeadLossTarget {
 public:
  HardLabels(Tensor labels, int64_t vocab, int64_t ignore_index = -100);
  void check(int64_t rows, int64_t vocab, torch::Device device) const override;
  ChunkScore score(Tensor logits, int64_t begin, std::optional<torch::ScalarType> grad_dtype) const override;
  Tensor count() const override;

 private:
  Tensor labels_;  // [N]
  int64_t vocab_, ignore_index_;
  bool any_ignored_;  // whether any row is ignored: only then do gradients need a row mask
};

// KL(teacher || student) = sum_v p_t,v (log p_t,v - log p_s,v) per row, gradient
// softmax(student) - p_t. teacher_log_probs: [N, V] normalised log-probabilities (-inf where the
// teacher gives a token no mass, as a top-k teacher does), any float dtype and device: each chunk
// is read and converted as the walk reaches it. No gradient flows to the teacher. Every row counts.
class TeacherLogProbs final : public HeadLossTarget {
 public:
  explicit TeacherLogProbs(Tensor teacher_log_probs);
  void check(int64_t rows, int64_t vocab, torch::Device device) const override;
  ChunkScore score(Tensor logits, int64_t begin, std::optional<torch::ScalarType> grad_dtype) const override;
  Tensor count() const override;

 private:
  Tensor log_probs_;  // [N, V]
};

// KL(teacher || student) like TeacherLogProbs, with the teacher given as its head's inputs: normed
// hidden states [N, d_t] and head weight [V, d_t]. Each chunk's teacher logits are formed as the walk
// reaches it (in the products' dtype the teacher's inputs would take, logits in fp32, float64 for
// float64 inputs), so neither model's [N x V] logits ever exist whole: the logit distillation of
// long sequences. No gradient flows to the teacher. Every row counts.
class TeacherHead final : public HeadLossTarget {
 public:
  TeacherHead(Tensor teacher_hidden, Tensor teacher_weight);
  void check(int64_t rows, int64_t vocab, torch::Device device) const override;
  ChunkScore score(Tensor logits, int64_t begin, std::optional<torch::ScalarType> grad_dtype) const override;
  Tensor count() const override;

 private:
  Tensor hidden_;  // [N, d_t], the products' dtype
  Tensor weight_;  // [V, d_t], the products' dtype
};

struct HeadLossOptions {
  // Tokens per chunk; 0: as many as keep one chunk's fp32 logits within kAutoChunkBytes.
  int64_t chunk_tokens = 0;
};

// The automatic chunk's budget for its fp32 logits (its log-probs, briefly, and its gradient in the
// products' dtype come on top): 1024 tokens at a 128k vocabulary, 4096 at 32k.
constexpr int64_t kAutoChunkBytes = int64_t{512} << 20;

// Tokens per chunk for a vocabulary of `vocab` logits of `logit_bytes` bytes each.
int64_t head_loss_chunk_tokens(int64_t vocab, int64_t logit_bytes, const HeadLossOptions& opts);

struct HeadLoss {
  Tensor sum;    // 0-dim: the loss summed over the rows; differentiable w.r.t. hidden and weight
  Tensor count;  // 0-dim: the rows that count
  Tensor mean() const { return sum / count; }
};

// The loss of the head hidden W^T (hidden [N, d], weight [V, d], no bias) against `target`. The
// products run in the autocast dtype under autocast (as at::linear would), otherwise in the
// inputs' common dtype; logits, softmax and loss in fp32 (float64 for float64 inputs); the
// gradients come back in the inputs' dtypes (a tied weight's gradient adds up through autograd).
// `target` needs to live only through this call.
HeadLoss lm_head_loss(const Tensor& hidden, const Tensor& weight, const HeadLossTarget& target,
                      const HeadLossOptions& opts = {});

// Mean cross-entropy over the tokens not labelled ignore_index: hidden [..., d], labels [...].
Tensor lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                             const HeadLossOptions& opts = {}, int64_t ignore_index = -100);

}  // namespace lt2::ops
