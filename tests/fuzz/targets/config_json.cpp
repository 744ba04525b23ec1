// Model config JSON: lt2's own (ModelConfig::from_json, validated) and Hugging Face Ouro configs.
#include "fuzz/fuzz_target.h"
#include "lt2/config/model_config.h"
#include "lt2/io/ouro.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return lt2::fuzz::run([&] {
    const lt2::json j = lt2::parse_json(std::string(lt2::fuzz::bytes(data, size)), "config.json");
    if (lt2::is_ouro_config(j))
      lt2::ouro_model_config(j, "config.json").validate();
    else
      lt2::ModelConfig::from_json(j, "config.json");
  });
}
