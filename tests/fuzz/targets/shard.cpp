// Token shards: the header, then every token of the body.
#include <algorithm>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "lt2/data/shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const lt2::fuzz::ScratchFile file("train.bin", lt2::fuzz::bytes(data, size));
  return lt2::fuzz::run([&] {
    const lt2::ShardReader r(file.path);
    std::vector<int64_t> tokens(4096);
    for (int64_t begin = 0; begin < r.size(); begin += 4096)
      r.read(begin, std::min<int64_t>(4096, r.size() - begin), tokens.data());
  });
}
