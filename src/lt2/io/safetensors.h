// Safetensors files (https://github.com/huggingface/safetensors, "Format"):
//   [u64 little-endian N][N bytes of JSON header][data]
//   header: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"key": "value", ...}}   offsets are relative to the data start.
// Reading maps the file (mmap) and hands out CPU tensors that view the mapping without a copy
// when the offset is aligned for the dtype. Writing lays tensors out by element size (largest
// first) after a header padded to 8 bytes, so every tensor we write can be viewed without a copy.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "lt2/util/fs.h"

namespace lt2 {

// Named tensors, ordered by name.
using TensorMap = std::map<std::string, torch::Tensor>;
// The header's "__metadata__": string keys and string values only (as the format requires).
using Metadata = std::map<std::string, std::string>;

// The header may be at most 100 MB (the reference implementation's limit), and a tensor may have
// at most 64 dimensions; both are checked before anything is parsed or allocated.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
inline constexpr size_t kMaxSafetensorsRank = 64;

// "F32" <-> torch::kFloat32, ... Throws naming the dtype and the supported ones.
torch::ScalarType safetensors_dtype(const std::string& name);
std::string safetensors_dtype_name(torch::ScalarType t);

// A tensor's dtype and shape: what a header says of it, without its data.
struct TensorSpec {
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
};
using TensorSpecs = std::map<std::string, TensorSpec>;

struct TensorInfo : TensorSpec {
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

class SafetensorsFile {
 public:
  // Maps and validates the whole header (offsets in range, contiguous, non-overlapping, sizes
  // matching shape x dtype); throws lt2::Error naming the file, the tensor and the problem.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return tensors_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  const Metadata& metadata() const { return metadata_; }
  // A CPU tensor with the stored dtype and shape. It views the read-only mapping (which it keeps
  // alive) when the data is aligned for the dtype, else it is a copy. Never write into it:
  // clone() first, or use load_tensor_map() for owned tensors.
  torch::Tensor tensor(const std::string& name) const;
  // True when tensor(name) is a view of the mapping rather than a copy.
  bool is_zero_copy(const std::string& name) const;

 private:
  const uint8_t* data_of(const TensorInfo& t) const;

  std::shared_ptr<MappedFile> file_;
  uint64_t data_start_ = 0;  // 8 + header length
  std::map<std::string, TensorInfo> tensors_;
  Metadata metadata_;
};

// Writes a whole safetensors file into `out`. Tensors may live on any device and have any
// strides; they are written as contiguous little-endian CPU data.
void write_safetensors(std::ostream& out, const TensorMap& tensors, const Metadata& metadata = {});
// write_safetensors into `path`, atomically (temporary name, then rename).
void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata = {});

}  // namespace lt2
