// lt2 generate: prefill a prompt and decode from a checkpoint.
#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "lt2/eval/scorer.h"
#include "lt2/infer/generate.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/tokenizer/tokenizer.h"

namespace lt2::cli {

namespace {

struct GenerateArgs {
  std::string checkpoint, prompt = "The", tokenizer, device = "auto", dtype = "auto";
  GenerateOptions opts;
  bool json_out = false;
  bool ignore_eos = false;
  LoopFlags loops;
  int64_t logprobs = 0;  // print the chosen tokens' log-probabilities and the top-N alternatives
};

// The chosen tokens' log-probabilities with their top-N alternatives, as JSON.
json logprobs_json(const std::vector<eval::TokenLogprob>& lps, const Tokenizer& tok) {
  json out = json::array();
  for (const auto& lp : lps) {
    json top = json::array();
    for (const auto& [id, v] : lp.top) top.push_back({{"token", id}, {"text", tok.decode({(int32_t)id})}, {"logprob", v}});
    out.push_back({{"token", lp.token}, {"text", tok.decode({(int32_t)lp.token})}, {"logprob", lp.logprob}, {"top", top}});
  }
  return out;
}

// A token's text as a JSON string literal (quotes and escapes show spaces and newlines).
std::string quoted(const Tokenizer& tok, int64_t id) {
  return json(tok.decode({static_cast<int32_t>(id)})).dump(-1, ' ', false, json::error_handler_t::replace);
}

void run_generate(GenerateArgs a) {
  LT2_CHECK(std::filesystem::is_directory(a.checkpoint), "'", a.checkpoint,
            "' is not a checkpoint folder (expected config.json + model.safetensors)");
  std::string tok_path = a.tokenizer;
  if (tok_path.empty() && std::filesystem::exists(a.checkpoint + "/tokenizer.json"))
    tok_path = a.checkpoint + "/tokenizer.json";
  Tokenizer tok = tok_path.empty() ? Tokenizer::byte_level({"<|endoftext|>"}) : Tokenizer::load(tok_path);
  LoopedLM model = load_checkpoint(a.checkpoint);
  LT2_CHECK(tok.vocab_size() <= model->config().vocab_size, "tokenizer has ", tok.vocab_size(),
            " tokens but the model's vocab_size is ", model->config().vocab_size);
  const bool cuda = torch::cuda::is_available() && a.device != "cpu";
  LT2_CHECK(!(a.device == "cuda" && !cuda), "--device cuda: no CUDA GPU is available");
  model->to(cuda ? torch::kCUDA : torch::kCPU);
  if (cuda && a.dtype != "fp32") model->to(torch::kBFloat16);
  if (auto eos = tok.token_to_id("<|endoftext|>"); eos && !a.ignore_eos) a.opts.stop_tokens.push_back(*eos);
  LT2_CHECK(a.loops.exits == "final", "lt2 generate decodes with one exit; --exits is for lt2 eval");
  a.opts.forward = eval::forward_options(model->config(), a.loops.options());
  LT2_CHECK(a.logprobs >= 0, "--logprobs must be >= 0, found ", a.logprobs);

  auto ids32 = tok.encode(a.prompt);
  std::vector<int64_t> prompt(ids32.begin(), ids32.end());
  if (!a.json_out) {
    std::printf("%s", a.prompt.c_str());
    std::fflush(stdout);
  }
  // Print as we go: decode the whole continuation each time and emit what is new, so multi-byte
  // characters split across tokens appear once complete.
  std::vector<int32_t> generated;
  std::string shown;
  auto res = generate(model, prompt, a.opts, [&](int64_t t) {
    generated.push_back(static_cast<int32_t>(t));
    if (!a.json_out) {
      std::string text = tok.decode(generated, /*skip_special=*/true);
      if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
        std::printf("%s", text.c_str() + shown.size());
        std::fflush(stdout);
        shown = text;
      }
    }
    return true;
  });
  const std::string text = tok.decode(generated, true);
  std::vector<eval::TokenLogprob> lps;
  if (a.logprobs > 0) lps = eval::continuation_logprobs(*model, prompt, res.tokens, a.logprobs, a.opts.forward);
  if (a.json_out) {
    json j{{"prompt", a.prompt}, {"text", text}, {"tokens", res.tokens},
           {"prompt_tokens", res.prompt_tokens}, {"prefill_ms", res.prefill_ms},
           {"decode_ms", res.decode_ms}, {"decode_tokens_per_s", res.decode_tokens_per_s()},
           {"state_bytes", res.state_bytes}};
    if (a.logprobs > 0) j["logprobs"] = logprobs_json(lps, tok);
    std::printf("%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    return;
  }
  if (text.size() > shown.size()) std::printf("%s", text.c_str() + std::min(shown.size(), text.size()));
  std::fprintf(stderr, "\n\n[%lld prompt tokens: prefill %.1f ms (%.0f tok/s); %zu new tokens: %.1f ms (%.1f tok/s); state %.1f MiB]\n",
               (long long)res.prompt_tokens, res.prefill_ms, res.prefill_tokens_per_s(), res.tokens.size(),
               res.decode_ms, res.decode_tokens_per_s(), res.state_bytes / 1048576.0);
  if (a.logprobs > 0) std::printf("\nlogprobs (chosen token, then the top %lld):\n", (long long)a.logprobs);
  for (const auto& lp : lps) {
    std::printf("%-16s %8.4f  |", quoted(tok, lp.token).c_str(), lp.logprob);
    for (const auto& [id, v] : lp.top) std::printf(" %s %.4f", quoted(tok, id).c_str(), v);
    std::printf("\n");
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate text from a checkpoint (prefill, then decode with a preallocated state)");
  cmd->add_option("checkpoint", a->checkpoint, "Checkpoint folder (config.json + model.safetensors [+ tokenizer.json]); Ouro folders work too")
      ->required();
  cmd->add_option("-p,--prompt", a->prompt, "Prompt text")->capture_default_str();
  cmd->add_option("-n,--max-new-tokens", a->opts.max_new_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("-t,--temperature", a->opts.sampling.temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  cmd->add_option("--top-k", a->opts.sampling.top_k, "Sample among the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", a->opts.sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--seed", a->opts.seed, "Sampling seed")->capture_default_str()->check(at_least(0));
  cmd->add_option("--prefill-chunk", a->opts.prefill_chunk, "Prompt tokens per prefill call")->capture_default_str();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the checkpoint's, else bytes)");
  cmd->add_option("--device", a->device, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "auto (bf16 on GPU, fp32 on CPU) | fp32")->capture_default_str();
  cmd->add_flag("--ignore-eos", a->ignore_eos, "Keep generating past <|endoftext|> (document separators print as nothing)");
  cmd->add_flag("--json", a->json_out, "Print one JSON object (text, tokens, timings) instead of streaming");
  cmd->add_option("--logprobs", a->logprobs, "Print each chosen token's log-probability and the N most likely "
                  "alternatives (the model's distribution, before temperature; one forward over the result)")
      ->capture_default_str();
  add_loop_flags(cmd, a->loops, /*with_exits=*/false);
  cmd->callback([a] { run_generate(*a); });
}

}  // namespace lt2::cli
