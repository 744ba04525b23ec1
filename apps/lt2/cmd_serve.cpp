// lt2 serve: an OpenAI-compatible HTTP server with continuous batching and a prefix-state cache.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "commands.h"
#include "lt2/infer/memory_plan.h"
#include "lt2/serve/server.h"
#include "lt2/util/fs.h"
#include "lt2/util/units.h"

namespace lt2::cli {

namespace {

struct ServeArgs {
  std::string model, tokenizer, chat_template, device = "auto", dtype = "auto", model_name;
  uint64_t seed = 0;
  serve::ServerOptions opts;
  double cache_gb = 2, cache_host_gb = 0, max_body_mb = 8, drain_timeout = 60;
  bool no_graphs = false, quiet = false;
  LoopFlags loops;
};

// The byte-level tokenizer with the end-of-text and ChatML tokens, for random-weight presets.
std::string byte_tokenizer_file() {
  const auto path = std::filesystem::temp_directory_path() / cat("lt2-serve-bytes-", ::getpid(), ".json");
  Tokenizer::byte_level({"<|endoftext|>", "<|im_start|>", "<|im_end|>"}).save(path.string());
  return path.string();
}

void run_serve(ServeArgs a) {
  // SIGTERM and SIGINT go to one thread that drains the server; block them before any other thread
  // (libtorch's, the server's) starts, so those inherit the mask.
  static sigset_t signals;  // outlives this function: the signal threads wait on it
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  eval::ModelSource src;
  src.model = a.model;
  src.tokenizer = a.tokenizer == "bytes" ? byte_tokenizer_file() : a.tokenizer;
  src.device = a.device;
  src.dtype = a.dtype;
  src.seed = a.seed;
  auto loaded = eval::load_model(src);
  if (a.tokenizer == "bytes") std::filesystem::remove(src.tokenizer);
  if (!a.chat_template.empty()) loaded.tokenizer.set_chat_template(read_file(a.chat_template), a.chat_template);
  LT2_CHECK(a.loops.exits == "final", "lt2 serve decodes with one exit; --exits is for lt2 eval");
  auto& so = a.opts.scheduler;
  so.forward = eval::forward_options(loaded.model->config(), a.loops.options());
  so.cuda_graphs = !a.no_graphs;
  so.cache_device_bytes = static_cast<int64_t>(a.cache_gb * (1 << 30));
  so.cache_host_bytes = static_cast<int64_t>(a.cache_host_gb * (1 << 30));
  LT2_CHECK(a.max_body_mb > 0, "--max-body-mb must be > 0");
  a.opts.max_body_bytes = static_cast<int64_t>(a.max_body_mb * (1 << 20));
  a.opts.log_requests = !a.quiet;
  if (a.model_name.empty()) {
    auto p = std::filesystem::path(a.model);
    if (!p.has_filename()) p = p.parent_path();
    a.opts.model_name = p.filename().string();
  } else {
    a.opts.model_name = a.model_name;
  }
  const auto param = loaded.model->parameters().front();
  const auto dev = param.device();
  {
    // As many sequences decode together as their states fit beside the weights and the prefix
    // cache's budget; requests beyond them wait in the queue.
    const int64_t available = device_free_bytes(dev) - so.cache_device_bytes;
    const int64_t fit = max_rows_that_fit(*loaded.model, so.max_context, param.scalar_type(), so.prefill_chunk,
                                          available) - so.prefill_rows;
    LT2_CHECK(fit >= 1, "lt2 serve: not one sequence of --max-context ", so.max_context, " tokens fits beside ",
              so.prefill_rows, " prefill rows in ", human_bytes(available),
              " (free device memory less --prefix-cache-gb): lower --max-context or --prefix-cache-gb");
    if (fit < so.max_batch) {
      std::fprintf(stderr,
                   "lt2 serve: %lld sequences of %lld tokens do not fit in %s of free device memory; %lld decode "
                   "together, the rest queue\n",
                   (long long)so.max_batch, (long long)so.max_context, human_bytes(available).c_str(), (long long)fit);
      so.max_batch = fit;
    }
  }
  const std::string chat_template = loaded.tokenizer.chat_template_origin();
  serve::Server server(loaded.model, std::move(loaded.tokenizer), a.opts);
  const int port = server.bind();
  std::fprintf(stderr,
               "lt2 serve: model '%s' (%s%s) on %s, max batch %lld, context %lld, prefill chunk %lld, "
               "prefix cache %.2f GB\n",
               a.opts.model_name.c_str(), a.model.c_str(), loaded.random_weights ? ", random weights" : "",
               dev.str().c_str(), (long long)so.max_batch, (long long)so.max_context, (long long)so.prefill_chunk,
               a.cache_gb);
  std::fprintf(stderr, "lt2 serve: chat template: %s\n", chat_template.c_str());
  std::fprintf(stderr, "lt2 serve: listening on http://%s:%d\n", a.opts.host.c_str(), port);
  std::fflush(stderr);

  std::atomic<bool> draining{false};
  std::thread signal_thread([&server, &draining, drain = a.drain_timeout] {
    int sig = 0;
    sigwait(&signals, &sig);
    draining = true;
    if (sig != 0) {
      std::fprintf(stderr, "lt2 serve: signal %d: draining (up to %.0f s; again to exit at once)\n", sig, drain);
      std::thread second([] {
        int s2 = 0;
        sigwait(&signals, &s2);
        std::fprintf(stderr, "lt2 serve: signal %d again: exiting now\n", s2);
        std::_Exit(1);
      });
      second.detach();
    }
    server.shutdown(drain);
  });
  server.listen();
  // listen() returns after shutdown() stopped it; should it have ended by itself, wake the signal
  // thread so that it shuts the rest down too.
  if (!draining) ::kill(::getpid(), SIGTERM);
  signal_thread.join();
  std::fprintf(stderr, "lt2 serve: stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto& o = a->opts;
  auto& s = o.scheduler;
  auto* cmd = app.add_subcommand(
      "serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) "
               "with continuous batching and a prefix-state cache");
  cmd->add_option("model", a->model, "Checkpoint folder (ours or Ouro), preset name or model-config JSON")->required();
  cmd->add_option("--tokenizer", a->tokenizer,
                  "tokenizer.json or folder (default: the checkpoint's); 'bytes': the byte-level tokenizer with "
                  "<|endoftext|>, <|im_start|>, <|im_end|> (random-weight presets, benchmarks)");
  cmd->add_option("--chat-template", a->chat_template,
                  "Jinja chat template file for /v1/chat/completions, replacing the checkpoint's (default: "
                  "chat_template.jinja or tokenizer_config.json's chat_template next to tokenizer.json, else ChatML)");
  cmd->add_option("--model-name", a->model_name, "The model id clients send and /v1/models lists (default: the "
                  "MODEL argument's last path part)");
  cmd->add_option("--host", o.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "Port to listen on (0: any free port, printed at start)")->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-batch", s.max_batch, "Sequences decoding together (engine slots); fewer when their states do not fit in "
                  "free device memory, said at start")->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--max-context", s.max_context, "Tokens per sequence, prompt + generated")->capture_default_str()
      ->check(at_least(2));
  cmd->add_option("--prefill-chunk", s.prefill_chunk, "Prompt tokens per prefill forward")->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--step-token-budget", s.step_token_budget,
                  "Tokens one scheduler step processes, decode and prefill together: long prompts prefill in "
                  "pieces between decode steps (0: max-batch + prefill-chunk)")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--prefill-rows", s.prefill_rows, "Prompts prefilling at once (extra state rows)")
      ->capture_default_str()->check(at_least(1));
  cmd->add_option("--max-queue", s.max_queue, "Requests waiting for a slot beyond which new ones get 503")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--prefix-cache-gb", a->cache_gb,
                  "Prefix-state cache on the model's device, GB (0: off): snapshots of whole decode states at "
                  "prompt chunk boundaries, resumed by prompts that extend them")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--prefix-cache-host-gb", a->cache_host_gb, "Host memory the prefix cache spills to, GB (GPU only)")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--prefix-cache-interval", s.cache_interval,
                  "Snapshot a prompt's state every this many tokens (0: every --prefill-chunk). Prefill chunks end "
                  "there too, so an interval below --prefill-chunk slows prefill")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--timeout", s.timeout_s, "Seconds a request may take from arrival to its last token (0: none)")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--read-timeout", o.read_timeout_s, "Seconds a client may stay silent while sending its request")
      ->capture_default_str()->check(at_least(1));
  cmd->add_option("--write-timeout", o.write_timeout_s, "Seconds a client may stop reading its response")
      ->capture_default_str()->check(at_least(1));
  cmd->add_option("--max-body-mb", a->max_body_mb, "Largest request body, MiB (larger: 413)")->capture_default_str();
  cmd->add_option("--http-threads", o.http_threads, "Connections served at once (0: max(64, 4 x max-batch))")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--drain-timeout", a->drain_timeout, "Seconds SIGTERM waits for running requests before exiting")
      ->capture_default_str()->check(at_least(0));
  cmd->add_option("--device", a->device, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "auto (bf16 on GPU, fp32 on CPU; fp64 checkpoints stay fp64) | fp32 | bf16")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Weights of a preset or config (random)")->capture_default_str();
  cmd->add_flag("--no-cuda-graphs", a->no_graphs, "Decode eagerly instead of replaying CUDA graphs");
  cmd->add_flag("--quiet", a->quiet, "No log line per request");
  add_loop_flags(cmd, a->loops, /*with_exits=*/false);
  cmd->callback([a] { run_serve(*a); });
}

}  // namespace lt2::cli
