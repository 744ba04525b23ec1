#include "lt2/io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "lt2/util/error.h"
#include "lt2/util/json.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; lt2 reads and writes it as raw host memory");

namespace lt2 {

namespace {

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};

// Every safetensors dtype that torch has.
const std::vector<DtypeName>& dtype_table() {
  static const std::vector<DtypeName> table = {
      {"F64", torch::kFloat64},         {"F32", torch::kFloat32},
      {"F16", torch::kFloat16},         {"BF16", torch::kBFloat16},
      {"F8_E4M3", torch::kFloat8_e4m3fn}, {"F8_E5M2", torch::kFloat8_e5m2},
      {"I64", torch::kInt64},           {"I32", torch::kInt32},
      {"I16", torch::kInt16},           {"I8", torch::kInt8},
      {"U64", torch::kUInt64},          {"U32", torch::kUInt32},
      {"U16", torch::kUInt16},          {"U8", torch::kUInt8},
      {"BOOL", torch::kBool}};
  return table;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : dtype_table()) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Reads a non-negative JSON integer that fits in int64 (shape entries and offsets).
uint64_t json_uint(const json& j, const std::string& where, const char* what) {
  LT2_CHECK(j.is_number_unsigned() &&
                j.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
            where, ": ", what, " must be a non-negative integer, found ", j.dump());
  return j.get<uint64_t>();
}

// Parses and checks one header entry; offsets are checked against each other later.
TensorInfo parse_entry(const json& e, const std::string& where) {
  LT2_CHECK(e.is_object(), where, ": expected an object with dtype, shape and data_offsets, found ",
            json_type_name(e));
  json_reject_unknown(e, {"dtype", "shape", "data_offsets"}, where);
  for (const char* field : {"dtype", "shape", "data_offsets"})
    LT2_CHECK(e.contains(field), where, ": missing field '", field, "'");
  TensorInfo t;
  LT2_CHECK(e["dtype"].is_string(), where, ": 'dtype' must be a string, found ", e["dtype"].dump());
  try {
    t.dtype = safetensors_dtype(e["dtype"].get<std::string>());
  } catch (const Error& err) {
    throw Error(cat(where, ": ", err.what()));
  }
  LT2_CHECK(e["shape"].is_array(), where, ": 'shape' must be an array, found ", e["shape"].dump());
  LT2_CHECK(e["shape"].size() <= kMaxSafetensorsRank, where, ": 'shape' has ", e["shape"].size(),
            " dimensions, more than the ", kMaxSafetensorsRank, " a tensor may have");
  // numel * element size, checked for overflow. The product of the non-zero sizes must fit in
  // int64 as well: torch computes strides from it even for an empty tensor.
  constexpr uint64_t kLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t nonzero_bytes = c10::elementSize(t.dtype);
  bool empty = false, overflow = false;
  for (const auto& s : e["shape"]) {
    const uint64_t n = json_uint(s, where, "every 'shape' entry");
    t.shape.push_back(static_cast<int64_t>(n));
    if (n == 0) empty = true;
    else if (nonzero_bytes > kLimit / n) overflow = true;
    else nonzero_bytes *= n;
  }
  const uint64_t nbytes = empty ? 0 : nonzero_bytes;
  const json& off = e["data_offsets"];
  LT2_CHECK(off.is_array() && off.size() == 2, where,
            ": 'data_offsets' must be [begin, end], found ", off.dump());
  t.begin = json_uint(off[0], where, "'data_offsets' begin");
  t.end = json_uint(off[1], where, "'data_offsets' end");
  LT2_CHECK(t.begin <= t.end, where, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
  LT2_CHECK(!overflow, where, ": shape ", shape_str(t.shape), " x ", e["dtype"].get<std::string>(),
            ": its non-zero sizes multiply to more than 2^63 bytes");
  LT2_CHECK(t.end - t.begin == nbytes, where, ": shape ", shape_str(t.shape), " x ", e["dtype"].get<std::string>(),
            " needs ", nbytes, " bytes, but data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin);
  return t;
}

}  // namespace

torch::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : dtype_table())
    if (name == d.name) return d.type;
  throw Error(cat("unknown dtype \"", name, "\" (supported: ", supported_dtypes(), ")"));
}

std::string safetensors_dtype_name(torch::ScalarType t) {
  for (const auto& d : dtype_table())
    if (t == d.type) return d.name;
  throw Error(cat("dtype ", c10::toString(t), " has no safetensors equivalent (supported: ",
                  supported_dtypes(), ")"));
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(std::make_shared<MappedFile>(path)) {
  const std::string where = "safetensors file '" + path + "'";
  const uint64_t size = file_->size();
  LT2_CHECK(size >= 8, where, ": ", size, " bytes, too short for the 8-byte header length (truncated?)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file_->data(), 8);
  LT2_CHECK(header_len <= kMaxSafetensorsHeaderBytes, where, ": the header length (", header_len,
            " bytes) is more than the format's limit of ", kMaxSafetensorsHeaderBytes,
            " bytes; the file is corrupt or not a safetensors file");
  LT2_CHECK(header_len <= size - 8, where, ": the header length (", header_len,
            " bytes) goes beyond the end of the file (", size,
            " bytes); the file is truncated or not a safetensors file");
  data_start_ = 8 + header_len;
  const char* text = reinterpret_cast<const char*>(file_->data() + 8);
  json header;
  try {
    header = json::parse(text, text + header_len);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    throw Error(cat(where, ": the header is not valid JSON (", e.what(), ")"));
  }
  LT2_CHECK(header.is_object(), where, ": the header must be a JSON object, found ", json_type_name(header));

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      LT2_CHECK(it->is_object(), where, ": '__metadata__' must be an object of strings, found ",
                json_type_name(*it));
      for (auto m = it->begin(); m != it->end(); ++m) {
        LT2_CHECK(m->is_string(), where, ": '__metadata__' value of '", m.key(),
                  "' must be a string, found ", m->dump());
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    tensors_[it.key()] = parse_entry(*it, where + ", tensor '" + it.key() + "'");
  }

  // The tensors must tile the data section exactly: in offset order, each begins where the
  // previous one ends, and the last one ends at the end of the file.
  const uint64_t data_size = size - data_start_;
  std::vector<std::pair<const std::string*, const TensorInfo*>> order;
  for (const auto& [name, t] : tensors_) order.emplace_back(&name, &t);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.second->begin, a.second->end) < std::make_pair(b.second->begin, b.second->end);
  });
  uint64_t covered = 0;
  const std::string* prev = nullptr;
  for (const auto& [name, t] : order) {
    LT2_CHECK(t->begin >= covered, where, ": tensors '", *prev, "' (data_offsets ending at ", covered,
              ") and '", *name, "' (data_offsets [", t->begin, ", ", t->end, "]) overlap");
    LT2_CHECK(t->begin == covered, where, ": data bytes [", covered, ", ", t->begin,
              ") belong to no tensor (before tensor '", *name, "')");
    LT2_CHECK(t->end <= data_size, where, ": tensor '", *name, "' has data_offsets [", t->begin, ", ",
              t->end, "] but the file holds only ", data_size,
              " bytes of data; the file is truncated");
    covered = t->end;
    prev = name;
  }
  LT2_CHECK(covered == data_size, where, ": the tensors cover ", covered, " bytes of data but the file holds ",
            data_size, " (", data_size - covered, " trailing bytes)");
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  LT2_CHECK(it != tensors_.end(), "safetensors file '", path(), "' has no tensor '", name, "'");
  return it->second;
}

const uint8_t* SafetensorsFile::data_of(const TensorInfo& t) const {
  return file_->data() + data_start_ + t.begin;
}

bool SafetensorsFile::is_zero_copy(const std::string& name) const {
  const auto& t = info(name);
  return t.end > t.begin && reinterpret_cast<uintptr_t>(data_of(t)) % c10::elementSize(t.dtype) == 0;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto& t = info(name);
  auto opts = torch::TensorOptions().dtype(t.dtype);
  if (t.end == t.begin) return torch::empty(t.shape, opts);
  const uint8_t* p = data_of(t);
  if (t.dtype == torch::kBool) {  // torch assumes bools are 0 or 1; anything else is a corrupt file
    const uint64_t n = t.end - t.begin;
    LT2_CHECK(std::all_of(p, p + n, [](uint8_t b) { return b <= 1; }), "safetensors file '", path(),
              "', tensor '", name, "': BOOL data holds bytes other than 0 and 1");
  }
  if (is_zero_copy(name)) {
    // The deleter owns a reference to the mapping, so the view outlives this object safely.
    return torch::from_blob(const_cast<uint8_t*>(p), t.shape, [keep = file_](void*) {}, opts);
  }
  auto out = torch::empty(t.shape, opts);
  std::memcpy(out.data_ptr(), p, t.end - t.begin);
  return out;
}

void write_safetensors(std::ostream& out, const TensorMap& tensors, const Metadata& metadata) {
  // Largest element size first (then by name): every offset is then a multiple of its tensor's
  // element size, since all sizes are powers of two.
  std::vector<std::pair<std::string, torch::Tensor>> order;
  for (const auto& [name, t] : tensors) {
    LT2_CHECK(!name.empty() && name != "__metadata__", "cannot save a tensor named '", name,
              "' in safetensors");
    LT2_CHECK(t.defined(), "cannot save tensor '", name, "': it is undefined");
    try {
      safetensors_dtype_name(t.scalar_type());
    } catch (const Error& e) {
      throw Error(cat("cannot save tensor '", name, "': ", e.what()));
    }
    order.emplace_back(name, t.detach().to(torch::kCPU).contiguous());
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second.element_size() > b.second.element_size();
  });
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    throw Error(cat("cannot write a safetensors header: ", e.what(), " (tensor names and metadata must be UTF-8)"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t header_len = text.size();
  out.write(reinterpret_cast<const char*>(&header_len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, t] : order)
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  write_file_atomic(path, [&](std::ostream& out) { write_safetensors(out, tensors, metadata); });
}

}  // namespace lt2
