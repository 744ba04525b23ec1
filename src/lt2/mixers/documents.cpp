#include "lt2/mixers/documents.h"

#include "lt2/util/error.h"

namespace lt2 {

Tensor mixer_forward(MixerImpl& mixer, const Tensor& x, const Positions& pos, MixerState* state) {
  if (!pos.documents) return mixer.forward(x, pos, state);
  const auto& docs = *pos.documents;
  LT2_CHECK(!state && pos.start == 0 && !pos.seq_pos.defined(), mixer.kind(),
            ": packed documents run in a parallel forward from position 0 without a state");
  LT2_CHECK(x.dim() == 3 && x.size(0) == docs.rows() && x.size(1) == docs.T, mixer.kind(), ": packed documents of ",
            docs.rows(), " rows of ", docs.T, " tokens, but the input is ", x.sizes());
  if (mixer.caps().packed_documents) return mixer.forward(x, pos);
  const Positions alone{0, pos.loop, {}, pos.slot};
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < docs.rows(); ++b) {
    const auto& starts = docs.starts[b];
    std::vector<Tensor> parts;
    for (size_t d = 0; d < starts.size(); ++d) {
      const int64_t end = d + 1 < starts.size() ? starts[d + 1] : docs.T;
      parts.push_back(mixer.forward(x.narrow(0, b, 1).narrow(1, starts[d], end - starts[d]), alone));
    }
    rows.push_back(torch::cat(parts, 1));
  }
  return torch::cat(rows, 0);
}

}  // namespace lt2
