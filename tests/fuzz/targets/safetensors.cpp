// Safetensors files: the header (length, JSON, dtypes, shapes, offsets) and every tensor's data.
#include "fuzz/fuzz_target.h"
#include "lt2/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const lt2::fuzz::ScratchFile file("model.safetensors", lt2::fuzz::bytes(data, size));
  return lt2::fuzz::run([&] {
    lt2::SafetensorsFile f(file.path);
    for (const auto& name : f.names()) f.tensor(name).clone();
  });
}
