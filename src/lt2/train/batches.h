// Training and evaluation batches from a token shard. A batch depends only on (seed, step, micro),
// never on what ran before or on which rank runs it, so a resumed run sees exactly the batches an
// uninterrupted one would, whatever the number of data-parallel ranks (each rank runs its share of
// a step's micro-batches: lt2/train/distributed.h).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <utility>

#include "lt2/data/shard.h"

namespace lt2 {

class BatchSampler {
 public:
  BatchSampler(std::shared_ptr<const ShardReader> shard, int64_t seq_len, uint64_t seed);
  // inputs, targets: [batch, seq_len] int64 (targets = inputs shifted by one token), on the CPU.
  // Sequence i of the batch starts at a uniformly random offset drawn from (seed, step, micro, i).
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t step, int64_t micro, int64_t batch) const;
  // Evaluation batch `index`: consecutive non-overlapping windows from the start of the shard
  // (wrapping around), so every evaluation sees the same tokens.
  std::pair<torch::Tensor, torch::Tensor> eval_batch(int64_t index, int64_t batch) const;
  int64_t seq_len() const { return seq_len_; }

 private:
  std::pair<torch::Tensor, torch::Tensor> gather(const std::vector<int64_t>& starts) const;
  std::shared_ptr<const ShardReader> shard_;
  int64_t seq_len_;
  uint64_t seed_;
};

}  // namespace lt2
