#include "lt2/nn/positions.h"

#include "lt2/util/error.h"

namespace lt2 {

PackedDocuments::PackedDocuments(std::vector<std::vector<int64_t>> starts_, int64_t T_)
    : starts(std::move(starts_)), T(T_) {
  const int64_t B = rows();
  LT2_CHECK(B > 0 && T > 0, "packed documents: need at least one row of at least one token, found ", B, " rows of ",
            T, " tokens");
  offsets = torch::empty({B, T}, torch::kLong);
  auto off = offsets.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = starts[b];
    LT2_CHECK(!s.empty() && s[0] == 0, "packed documents: row ", b, "'s document starts must begin with 0");
    for (size_t d = 0; d < s.size(); ++d) {
      const int64_t end = d + 1 < s.size() ? s[d + 1] : T;
      LT2_CHECK(s[d] < end && end <= T, "packed documents: row ", b, "'s document starts must ascend strictly and "
                "stay below the row length ", T, "; found ", s[d], " then ", end);
      cu_seqlens.push_back(b * T + s[d]);
      for (int64_t t = s[d]; t < end; ++t) off[b][t] = t - s[d];
    }
  }
  cu_seqlens.push_back(B * T);
}

PackedDocuments PackedDocuments::at_separator(const torch::Tensor& tokens, int64_t separator) {
  LT2_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong && tokens.device().is_cpu(),
            "packed documents: tokens must be [B, T] int64 on the CPU, found ", tokens.sizes(), " ",
            tokens.scalar_type(), " on ", tokens.device());
  const auto tok = tokens.contiguous();
  const auto a = tok.accessor<int64_t, 2>();
  std::vector<std::vector<int64_t>> starts(tok.size(0));
  for (int64_t b = 0; b < tok.size(0); ++b) {
    starts[b].push_back(0);
    for (int64_t t = 1; t < tok.size(1); ++t)
      if (a[b][t] == separator) starts[b].push_back(t);
  }
  return PackedDocuments(std::move(starts), tok.size(1));
}

}  // namespace lt2
