#include "lt2/train/batches.h"

#include "lt2/util/error.h"
#include "lt2/util/hash.h"

namespace lt2 {

BatchSampler::BatchSampler(std::shared_ptr<const ShardReader> shard, int64_t seq_len, uint64_t seed)
    : shard_(std::move(shard)), seq_len_(seq_len), seed_(seed) {
  LT2_CHECK(shard_->size() > seq_len_ + 1, "token shard has ", shard_->size(),
            " tokens; training with seq_len ", seq_len_, " needs more than ", seq_len_ + 1);
}

std::pair<torch::Tensor, torch::Tensor> BatchSampler::gather(const std::vector<int64_t>& starts) const {
  const int64_t B = static_cast<int64_t>(starts.size());
  auto buf = torch::empty({B, seq_len_ + 1}, torch::kLong);
  for (int64_t i = 0; i < B; ++i) shard_->read(starts[i], seq_len_ + 1, buf[i].data_ptr<int64_t>());
  return {buf.narrow(1, 0, seq_len_).contiguous(), buf.narrow(1, 1, seq_len_).contiguous()};
}

std::pair<torch::Tensor, torch::Tensor> BatchSampler::sample(int64_t step, int64_t micro, int64_t batch) const {
  const uint64_t span = static_cast<uint64_t>(shard_->size() - seq_len_ - 1);
  std::vector<int64_t> starts(batch);
  for (int64_t i = 0; i < batch; ++i) {
    // SplitMix64 of (step, micro, i): nearby indices give independent offsets.
    uint64_t h = splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(step) ^ splitmix64(static_cast<uint64_t>(micro) ^ splitmix64(i))));
    starts[i] = static_cast<int64_t>(h % (span + 1));
  }
  return gather(starts);
}

std::pair<torch::Tensor, torch::Tensor> BatchSampler::eval_batch(int64_t index, int64_t batch) const {
  const int64_t windows = (shard_->size() - 1) / seq_len_;
  std::vector<int64_t> starts(batch);
  for (int64_t i = 0; i < batch; ++i) starts[i] = ((index * batch + i) % windows) * seq_len_;
  return gather(starts);
}

}  // namespace lt2
