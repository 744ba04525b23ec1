// PackedDocuments (nn/positions.h): documents found at the separator, the flat cu_seqlens and the
// per-token offsets they give, and clear errors for boundaries that do not describe the rows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "lt2/nn/positions.h"
#include "lt2/util/error.h"

using lt2::PackedDocuments;

TEST(PackedDocuments, AtSeparator) {
  const auto tokens = torch::tensor({9, 0, 5, 6, 0, 0, 7, 0, 4, 4, 4, 4}, torch::kLong).view({2, 6});
  const auto docs = PackedDocuments::at_separator(tokens, 0);
  EXPECT_EQ(docs.starts, (std::vector<std::vector<int64_t>>{{0, 1, 4, 5}, {0, 1}}));
  EXPECT_EQ(docs.cu_seqlens, (std::vector<int64_t>{0, 1, 4, 5, 6, 7, 12}));
  EXPECT_TRUE(torch::equal(docs.offsets, torch::tensor({0, 0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 4}, torch::kLong).view({2, 6})));
}

TEST(PackedDocuments, RejectsBadStarts) {
  auto error_of = [](std::vector<std::vector<int64_t>> starts, int64_t T) -> std::string {
    try {
      PackedDocuments docs(std::move(starts), T);
    } catch (const lt2::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({{1, 3}}, 5).find("must begin with 0"), std::string::npos);
  EXPECT_NE(error_of({{0, 3, 3}}, 5).find("ascend strictly"), std::string::npos);
  EXPECT_NE(error_of({{0, 5}}, 5).find("below the row length 5"), std::string::npos);
  EXPECT_NE(error_of({}, 5).find("at least one row"), std::string::npos);
  EXPECT_THROW(PackedDocuments::at_separator(torch::zeros({2, 3}, torch::kInt), 0), lt2::Error);
}
