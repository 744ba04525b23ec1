// `lt2 serve` on a loopback port (docs/serve.md): requests are parsed strictly, outputs equal the
// engine's (`lt2 generate`'s) token for token, streaming equals non-streaming, stop strings work
// across tokens, concurrent clients get what they would alone, disconnects free their slots, the
// prefix cache resumes exactly, and hostile input gets a 4xx or a closed connection in bounded time.
#include <atomic>
#include <mutex>
#include <numeric>
#include <thread>

#include "lt2/infer/generate.h"
#include "lt2/serve/api.h"
#include "lt2/serve/prefix_cache.h"
#include "lt2/serve/text_stream.h"
#include "serve/serve_testing.h"

using namespace lt2;
using namespace lt2::testing;
using serve::Endpoint;

namespace {

LoopedLM hybrid_model(const std::string& pattern = "interleaved:1:1:gdn:full", ModelForm form = ModelForm::LT2) {
  return make_test_model(serve_config(pattern, form), 5);
}

std::vector<int64_t> encode(const std::string& text) {
  auto ids = chat_tokenizer().encode(text);
  return {ids.begin(), ids.end()};
}

// What `lt2 generate` produces: the engine, one sequence.
std::vector<int64_t> reference(LoopedLM m, const std::vector<int64_t>& prompt, int64_t n, double temperature = 0,
                               uint64_t seed = 0, int64_t top_k = 0, double top_p = 1) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.prefill_chunk = 8;
  o.sampling.temperature = temperature;
  o.sampling.top_k = top_k;
  o.sampling.top_p = top_p;
  o.seed = seed;
  return generate(m, prompt, o).tokens;
}

std::vector<int64_t> ids_of(const json& choice) { return choice.at("token_ids").get<std::vector<int64_t>>(); }

json completion(const std::string& prompt, int64_t max_tokens, json extra = json::object()) {
  json j{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0},
         {"ignore_eos", true}, {"return_token_ids", true}};
  for (auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

// The text and ids of a streamed response.
struct Streamed {
  std::string text;
  std::vector<int64_t> ids;
  std::string finish_reason;
  json usage;
  bool done = false;
};
Streamed stream(int port, const std::string& path, json body) {
  body["stream"] = true;
  const auto r = post(port, path, body);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.headers.find("text/event-stream"), std::string::npos);
  Streamed s;
  for (const auto& ev : sse_events(r.body, &s.done)) {
    if (ev.contains("usage") && !ev["usage"].is_null()) s.usage = ev["usage"];
    if (ev["choices"].empty()) continue;
    const auto& c = ev["choices"][0];
    if (c.contains("text")) s.text += c["text"].get<std::string>();
    if (c.contains("delta") && c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
    if (c.contains("token_ids"))
      for (auto id : c["token_ids"]) s.ids.push_back(id.get<int64_t>());
    if (!c["finish_reason"].is_null()) s.finish_reason = c["finish_reason"];
  }
  return s;
}

void expect_error(const HttpResult& r, int status, const std::string& param_or_empty, const std::string& what) {
  EXPECT_EQ(r.status, status) << what << ": " << r.body;
  ASSERT_FALSE(r.body.empty()) << what;
  json j;
  ASSERT_NO_THROW(j = r.json_body()) << what << ": " << r.body;
  ASSERT_TRUE(j.contains("error")) << what;
  for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(j["error"].contains(k)) << what << ": " << k;
  if (!param_or_empty.empty()) {
    EXPECT_EQ(j["error"]["param"], param_or_empty) << what;
  }
}

}  // namespace

// ---- request parsing and text ----

TEST(ServeApi, RefusesUnknownFieldsWrongTypesAndBadValues) {
  auto expect_bad = [](Endpoint ep, const std::string& body, const std::string& param) {
    try {
      serve::parse_request(ep, body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const serve::ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, param) << body << ": " << e.what();
    }
  };
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","foo":1})", "foo");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","max_tokens":"3"})", "max_tokens");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","max_tokens":-1})", "max_tokens");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","max_tokens":1e30})", "max_tokens");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","temperature":-0.5})", "temperature");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","top_p":0})", "top_p");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","logprobs":21})", "logprobs");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","n":2})", "n");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":"x","stop":[1]})", "stop");
  expect_bad(Endpoint::Completions, R"({"model":"m","prompt":["a","b"]})", "prompt");
  expect_bad(Endpoint::Completions, R"({"model":"m","messages":[]})", "messages");  // not a completions field
  expect_bad(Endpoint::Completions, R"({"model":"m"})", "prompt");
  expect_bad(Endpoint::Chat, R"({"model":"m","messages":[{"role":"robot","content":"x"}]})", "messages[0].role");
  expect_bad(Endpoint::Chat, R"({"model":"m","messages":[{"role":"user","content":"x","x":1}]})", "messages[0].x");
  expect_bad(Endpoint::Chat, R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
             "top_logprobs");
  expect_bad(Endpoint::Chat, R"({"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}})",
             "stream_options");
  for (const std::string body : {"{", "[1,2]", "{\"prompt\": \"\xff\"}", ""}) {
    try {
      serve::parse_request(Endpoint::Completions, body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const serve::ApiError& e) {
      EXPECT_EQ(e.status, 400);
    }
  }
  const auto r = serve::parse_request(
      Endpoint::Chat, R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                          "logprobs":true,"top_logprobs":3,"stop":"x","seed":-4,"n":1,"presence_penalty":0})");
  EXPECT_EQ(r.messages.at(0).content, "hi");
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(r.seed.has_value());
}

TEST(ServeApi, StopStringsMatchAcrossTokensAndAreNotEmitted) {
  serve::TextStream t({"STOP", "xyz"});
  std::string out;
  for (const std::string piece : {"ab", "cS", "T", "O"}) {
    auto u = t.push(piece);
    EXPECT_FALSE(u.stopped);
    out += u.text;
  }
  EXPECT_EQ(out, "abc");  // "STO" is held back
  auto u = t.push("Pdef");
  EXPECT_TRUE(u.stopped);
  out += u.text;
  EXPECT_EQ(out, "abc");
  EXPECT_EQ(t.push("more").text, "");

  serve::TextStream held({"ab"});
  EXPECT_EQ(held.push("xa").text, "x");
  EXPECT_EQ(held.push("c").text, "ac");  // the held "a" was not a stop after all
  EXPECT_EQ(held.push("a").text, "");
  EXPECT_EQ(held.flush(), "a");           // the end: what was held comes out
}

TEST(ServeApi, SplitCharactersWaitAndInvalidBytesBecomeReplacementCharacters) {
  serve::TextStream t({});
  EXPECT_EQ(t.push("\xE2").text, "");
  EXPECT_EQ(t.push("\x82").text, "");
  EXPECT_EQ(t.push("\xAC!").text, "\xE2\x82\xAC!");  // the euro sign, complete
  EXPECT_EQ(t.push("\xFF").text, "\xEF\xBF\xBD");
  EXPECT_EQ(t.push("\xE2\x82").text, "");
  EXPECT_EQ(t.flush(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // an unfinished character at the end
  EXPECT_TRUE(serve::valid_utf8(t.emitted()));
}

TEST(ServeApi, ChatTemplateIsChatML) {
  const std::vector<ChatMessage> msgs{{"system", "Be terse."}, {"user", "Hi"}};
  EXPECT_EQ(chat_tokenizer().apply_chat_template(msgs, true),
            "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ServePrefixCache, LongestPrefixWinsAndTheLeastRecentlyUsedGoes) {
  auto snap = [](int64_t length) {
    Engine::Snapshot s;
    s.length = length;
    s.tensors.push_back(torch::zeros({256}, torch::kFloat));  // 1 KiB each
    return s;
  };
  serve::PrefixCache cache(3 * 1024 + 64, 0, torch::kCPU);  // three entries (and a few logits)
  const std::vector<int64_t> a{1, 2, 3, 4, 5, 6, 7, 8};
  cache.insert(a, snap(2));
  cache.insert(a, snap(4));
  cache.insert(a, snap(6));
  EXPECT_TRUE(cache.contains(a, 4));
  auto hit = cache.lookup(a, a.size());
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->length, 6);
  EXPECT_EQ(cache.lookup({1, 2, 3, 4, 5, 6}, 6)->length, 4);  // equal length needs the logits
  cache.insert(a, snap(8), torch::zeros({2}));                // over budget: the least recently used (2) goes
  EXPECT_FALSE(cache.contains(a, 2));
  EXPECT_EQ(cache.lookup(a, a.size())->length, 8);            // the whole prompt, with its logits
  EXPECT_EQ(cache.stats().entries, 3);
  EXPECT_GE(cache.stats().evictions, 1);
  EXPECT_FALSE(cache.lookup({9, 9}, 2).has_value());
}

TEST(ServePrefixCache, SharedLengthIsTheLongestCommonPrefixWithAnyEntry) {
  Engine::Snapshot s;
  s.tensors.push_back(torch::zeros({4}));
  serve::PrefixCache cache(1 << 20, 0, torch::kCPU);
  EXPECT_EQ(cache.shared_length({1, 2, 3}), 0);
  s.length = 6;
  cache.insert({1, 2, 3, 4, 5, 6, 7}, s);  // holds tokens 1..6
  s.length = 3;
  cache.insert({1, 2, 9, 9}, s);           // holds 1, 2, 9
  EXPECT_EQ(cache.shared_length({1, 2, 3, 4, 8}), 4);
  EXPECT_EQ(cache.shared_length({1, 2, 9, 1}), 3);
  EXPECT_EQ(cache.shared_length({1, 2, 3, 4, 5, 6, 7, 8}), 6);  // not beyond what an entry holds
  EXPECT_EQ(cache.shared_length({5}), 0);
  EXPECT_EQ(cache.stats().hits + cache.stats().misses, 0);     // a read, not a lookup
}

// ---- the server ----
// Each server gets its own instance of the model (same seed, same weights): the references below
// run the engine on another instance, never concurrently with a server's scheduler thread.

TEST(Serve, GreedyAndSeededCompletionsEqualGenerate) {
  auto m = hybrid_model();
  TestServer ts(hybrid_model(), small_server_options());
  const std::string prompt = "It is a truth universally acknowledged";
  const auto r = post(ts.port, "/v1/completions", completion(prompt, 20));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto j = r.json_body();
  EXPECT_EQ(ids_of(j["choices"][0]), reference(m, encode(prompt), 20));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(j["usage"]["completion_tokens"], 20);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");

  const auto s = post(ts.port, "/v1/completions",
                      completion(prompt, 15, {{"temperature", 0.9}, {"top_k", 40}, {"top_p", 0.95}, {"seed", 7}}));
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_EQ(ids_of(s.json_body()["choices"][0]), reference(m, encode(prompt), 15, 0.9, 7, 40, 0.95));
  // Token ids as the prompt give the same as their text.
  json by_ids = completion("", 20);
  by_ids["prompt"] = encode(prompt);
  const auto r2 = post(ts.port, "/v1/completions", by_ids);
  ASSERT_EQ(r2.status, 200) << r2.body;
  EXPECT_EQ(ids_of(r2.json_body()["choices"][0]), ids_of(j["choices"][0]));
}

TEST(Serve, StreamingEqualsNonStreaming) {
  auto m = hybrid_model();
  TestServer ts(hybrid_model(), small_server_options());
  for (const std::string path : {"/v1/completions", "/v1/chat/completions"}) {
    SCOPED_TRACE(path);
    json body = completion("Once upon a time", 25, {{"logprobs", 2}});
    if (path == "/v1/chat/completions") {
      body.erase("prompt");
      body["messages"] = {{{"role", "user"}, {"content", "Once upon a time"}}};
      body["logprobs"] = true;
      body["top_logprobs"] = 2;
    }
    const auto whole = post(ts.port, path, body);
    ASSERT_EQ(whole.status, 200) << whole.body;
    const auto c = whole.json_body()["choices"][0];
    body["stream_options"] = {{"include_usage", true}};
    const auto s = stream(ts.port, path, body);
    EXPECT_TRUE(s.done);
    EXPECT_EQ(s.ids, ids_of(c));
    EXPECT_EQ(s.text, path == "/v1/completions" ? c["text"] : c["message"]["content"]);
    EXPECT_EQ(s.finish_reason, "length");
    EXPECT_EQ(s.usage["completion_tokens"], 25);
    if (path == "/v1/completions") {
      EXPECT_EQ(c["logprobs"]["token_logprobs"].size(), 25u);
      // A dict keyed by token text: two tokens with one text (both U+FFFD here) share an entry.
      EXPECT_GE(c["logprobs"]["top_logprobs"][0].size(), 1u);
      EXPECT_LE(c["logprobs"]["top_logprobs"][0].size(), 2u);
    } else {
      ASSERT_EQ(c["logprobs"]["content"].size(), 25u);
      EXPECT_EQ(c["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
      // Greedy: the chosen token is the most likely.
      EXPECT_DOUBLE_EQ(c["logprobs"]["content"][0]["logprob"].get<double>(),
                       c["logprobs"]["content"][0]["top_logprobs"][0]["logprob"].get<double>());
    }
  }
}

TEST(Serve, StopStringsAcrossTokenBoundaries) {
  auto m = hybrid_model();
  TestServer ts(hybrid_model(), small_server_options());
  const auto full = post(ts.port, "/v1/completions", completion("The quick brown fox", 40)).json_body();
  const std::string text = full["choices"][0]["text"];
  // A stop string of 2-3 characters from the middle of the text (every byte is a token here).
  size_t begin = text.size() / 3;
  while (begin < text.size() && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) ++begin;
  size_t end = begin, chars = 0;
  while (end < text.size() && chars < 3) {
    ++end;
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    ++chars;
  }
  ASSERT_GE(end - begin, 2u) << "text too short: " << text;
  const std::string stop = text.substr(begin, end - begin);
  const std::string want = text.substr(0, text.find(stop));
  const auto r = post(ts.port, "/v1/completions", completion("The quick brown fox", 40, {{"stop", {"\x01never", stop}}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body()["choices"][0]["text"], want);
  EXPECT_EQ(r.json_body()["choices"][0]["finish_reason"], "stop");
  const auto s = stream(ts.port, "/v1/completions", completion("The quick brown fox", 40, {{"stop", stop}}));
  EXPECT_EQ(s.text, want);
  EXPECT_EQ(s.finish_reason, "stop");
}

TEST(Serve, ChatAppliesTheChatMLTemplate) {
  auto m = hybrid_model();
  TestServer ts(hybrid_model(), small_server_options());
  const std::string golden =
      "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n";
  json chat{{"model", "tiny"}, {"messages", {{{"role", "system"}, {"content", "Be terse."}}, {{"role", "user"}, {"content", "Hello there"}}}},
            {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}, {"return_token_ids", true}};
  const auto c = post(ts.port, "/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.body;
  const auto cj = c.json_body();
  EXPECT_EQ(cj["object"], "chat.completion");
  EXPECT_EQ(cj["choices"][0]["message"]["role"], "assistant");
  const auto want = encode(golden);
  EXPECT_EQ(cj["usage"]["prompt_tokens"], static_cast<int64_t>(want.size()));
  EXPECT_EQ(ids_of(cj["choices"][0]), reference(m, want, 12));
}

TEST(Serve, ConcurrentClientsGetWhatTheyGetAlone) {
  auto m = hybrid_model();
  auto o = small_server_options();
  o.scheduler.max_batch = 4;  // 24 clients: most wait in the queue, prefills interleave with decodes
  TestServer ts(hybrid_model(), o);
  constexpr int kClients = 24;
  struct Case {
    std::string prompt;
    int64_t max_tokens;
    double temperature;
    bool stream;
    std::vector<int64_t> got, want;
    int status = 0;
  };
  std::vector<Case> cases;
  for (int i = 0; i < kClients; ++i) {
    std::string p;
    for (int k = 0; k < 1 + (i * 7) % 45; ++k) p += static_cast<char>('a' + (i * 3 + k * 5) % 26);
    cases.push_back({p, 1 + (i * 5) % 23, i % 3 == 0 ? 0.8 : 0.0, i % 2 == 1, {}, {}});
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      auto& c = cases[i];
      json body = completion(c.prompt, c.max_tokens, {{"temperature", c.temperature}, {"seed", 100 + i}});
      if (c.stream) {
        auto s = stream(ts.port, "/v1/completions", body);
        c.got = s.ids;
        c.status = s.done ? 200 : -1;
      } else {
        auto r = post(ts.port, "/v1/completions", body, 120);
        c.status = r.status;
        if (r.status == 200) c.got = ids_of(r.json_body()["choices"][0]);
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    auto& c = cases[i];
    EXPECT_EQ(c.status, 200) << "client " << i;
    EXPECT_EQ(c.got, reference(m, encode(c.prompt), c.max_tokens, c.temperature, 100 + i)) << "client " << i;
  }
  EXPECT_EQ(metric(ts.port, "lt2_requests_running"), 0);
  EXPECT_EQ(metric(ts.port, "lt2_requests_queued"), 0);
}

TEST(Serve, ADisconnectMidStreamFreesTheSlot) {
  auto m = hybrid_model();
  auto o = small_server_options();
  o.scheduler.max_batch = 1;
  o.scheduler.max_context = 4096;
  TestServer ts(hybrid_model(), o);
  // A long stream, abandoned after its first tokens.
  const int fd = connect_loopback(ts.port);
  ASSERT_GE(fd, 0);
  const std::string body = completion("abc", 4000, {{"stream", true}}).dump();
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                   std::to_string(body.size()) + "\r\n\r\n" + body);
  const std::string first = read_until_closed(fd, 30, nullptr, [](const std::string& s) {
    return s.find("\"text\"") != std::string::npos;
  });
  ASSERT_NE(first.find("data: "), std::string::npos);
  ::close(fd);
  // The one slot is free again well before the 4000 tokens would be done.
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = post(ts.port, "/v1/completions", completion("xyz", 5), 60);
  EXPECT_EQ(r.status, 200) << r.body;
  for (int i = 0; i < 200 && metric(ts.port, "lt2_finished_total{reason=\"cancelled\"}") < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(metric(ts.port, "lt2_finished_total{reason=\"cancelled\"}"), 1);
  EXPECT_LT(metric(ts.port, "lt2_generation_tokens_total"), 1000);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30);
}

TEST(Serve, PrefixCacheResumesExactly) {
  for (const auto& [pattern, form] : std::vector<std::pair<std::string, ModelForm>>{
           {"gdn", ModelForm::LT2}, {"interleaved:1:1:gdn:full", ModelForm::LT2},
           {"interleaved:1:1:gdn:window", ModelForm::LT2}, {"interleaved:1:1:gdn:full", ModelForm::Ouro}}) {
    SCOPED_TRACE(pattern + (form == ModelForm::Ouro ? " (Ouro)" : ""));
    auto m = hybrid_model(pattern, form);
    auto cached_opts = small_server_options();
    cached_opts.scheduler.cache_device_bytes = 64 << 20;
    cached_opts.scheduler.cache_interval = 8;
    TestServer cold(m, small_server_options());
    TestServer warm(hybrid_model(pattern, form), cached_opts);
    const std::string shared = "A long shared system prompt that many requests begin with, then: ";
    for (const std::string tail : {"first question", "second question, longer", "first question"}) {
      const auto body = completion(shared + tail, 10);
      const auto a = post(cold.port, "/v1/completions", body).json_body();
      const auto b = post(warm.port, "/v1/completions", body).json_body();
      EXPECT_EQ(ids_of(b["choices"][0]), ids_of(a["choices"][0])) << tail;
    }
    EXPECT_GE(metric(warm.port, "lt2_prefix_cache_hits_total"), 2);
    EXPECT_GE(metric(warm.port, "lt2_prompt_tokens_cached_total"), 2.0 * 64);
    // A second chat turn resumes from the first turn's state and answers as without the cache.
    json chat{{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "Tell me a story."}}}}, {"max_tokens", 8},
              {"temperature", 0}, {"ignore_eos", true}};
    const auto t1 = post(warm.port, "/v1/chat/completions", chat).json_body();
    chat["messages"].push_back({{"role", "assistant"}, {"content", t1["choices"][0]["message"]["content"]}});
    chat["messages"].push_back({{"role", "user"}, {"content", "And then?"}});
    const auto t2_cold = post(cold.port, "/v1/chat/completions", chat).json_body();
    const auto t2 = post(warm.port, "/v1/chat/completions", chat).json_body();
    EXPECT_EQ(t2["choices"][0]["message"]["content"], t2_cold["choices"][0]["message"]["content"]);
    EXPECT_GE(t2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(),
              t1["usage"]["prompt_tokens"].get<int64_t>() / 8 * 8);
  }
}

// A prompt that parts from a cached one leaves a snapshot where they part, so the next prompt
// sharing that prefix resumes at its last shared token, not at the interval before it.
TEST(Serve, PrefixCacheResumesAtTheBranchPoint) {
  auto cached_opts = small_server_options();
  cached_opts.scheduler.cache_device_bytes = 64 << 20;  // interval: the prefill chunk, 8 tokens
  TestServer cold(hybrid_model(), small_server_options());
  TestServer warm(hybrid_model(), cached_opts);
  const std::string shared = "A shared document of 37 bytes, then: ";
  ASSERT_NE(shared.size() % 8, 0u);
  std::vector<int64_t> cached;
  for (const std::string tail : {"alpha", "beta", "gamma", "delta"}) {
    const auto body = completion(shared + tail, 6);
    const auto a = post(cold.port, "/v1/completions", body).json_body();
    const auto b = post(warm.port, "/v1/completions", body).json_body();
    EXPECT_EQ(ids_of(b["choices"][0]), ids_of(a["choices"][0])) << tail;
    cached.push_back(b["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>());
  }
  // The first is cold; the second resumes at the last interval inside the shared part and leaves a
  // snapshot at its end; the later ones resume there.
  EXPECT_EQ(cached, (std::vector<int64_t>{0, static_cast<int64_t>(shared.size()) / 8 * 8,
                                          static_cast<int64_t>(shared.size()), static_cast<int64_t>(shared.size())}));
}

TEST(Serve, EndpointsModelsHealthMetrics) {
  TestServer ts(hybrid_model(), small_server_options());
  const auto h = http(ts.port, "GET", "/health");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.json_body()["status"], "ok");
  const auto models = http(ts.port, "GET", "/v1/models").json_body();
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  post(ts.port, "/v1/completions", completion("hi", 3));
  const auto metrics = http(ts.port, "GET", "/metrics");
  EXPECT_EQ(metrics.status, 200);
  for (const char* name : {"lt2_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
                           "lt2_time_to_first_token_seconds_count 1", "lt2_inter_token_latency_seconds_count 2",
                           "lt2_generation_tokens_total 3", "lt2_requests_running 0", "lt2_prefix_cache_hits_total"})
    EXPECT_NE(metrics.body.find(name), std::string::npos) << name << " not in\n" << metrics.body;
  expect_error(http(ts.port, "GET", "/nowhere"), 404, "", "unknown route");
}

TEST(Serve, BadInputGetsAJsonErrorAndOthersAreUnaffected) {
  auto m = hybrid_model();
  auto o = small_server_options();
  o.max_body_bytes = 4096;
  TestServer ts(hybrid_model(), o);
  const std::string prompt = "unaffected";
  const auto want = reference(m, encode(prompt), 30);
  // A client that streams throughout the abuse.
  std::vector<int64_t> during;
  std::thread bystander([&] { during = stream(ts.port, "/v1/completions", completion(prompt, 30)).ids; });

  const auto t0 = std::chrono::steady_clock::now();
  auto P = [&](const std::string& body) { return http(ts.port, "POST", "/v1/completions", body, 20); };
  expect_error(P("{\"model\": \"tiny\", \"prompt\": "), 400, "", "malformed JSON");
  expect_error(P("{\"model\": \"tiny\", \"prompt\": \"a\xff\xfe\"}"), 400, "", "invalid UTF-8");
  expect_error(P(R"({"model":"tiny","prompt":5})"), 400, "prompt", "wrong type");
  expect_error(P(R"({"model":"tiny","prompt":"x","bogus":true})"), 400, "bogus", "unknown field");
  expect_error(P(R"({"model":"tiny","prompt":"x","max_tokens":-3})"), 400, "max_tokens", "negative max_tokens");
  expect_error(P(R"({"model":"tiny","prompt":"x","max_tokens":99999999999})"), 400, "max_tokens", "huge max_tokens");
  expect_error(P(R"({"model":"tiny","prompt":"x","max_tokens":0})"), 400, "max_tokens", "zero max_tokens");
  expect_error(P(json{{"model", "tiny"}, {"prompt", std::string(300, 'a')}}.dump()), 400, "prompt", "prompt > context");
  expect_error(P(R"({"model":"tiny","prompt":[1, 2, 9999]})"), 400, "prompt", "token outside the vocabulary");
  expect_error(P(R"({"model":"other","prompt":"x"})"), 404, "model", "unknown model");
  expect_error(P(R"({"prompt":"x"})"), 400, "model", "no model");
  expect_error(P(json{{"model", "tiny"}, {"prompt", std::string(5000, 'a')}}.dump()), 413, "", "oversized body");
  expect_error(http(ts.port, "POST", "/v1/chat/completions", R"({"model":"tiny","messages":[{"role":"user"}],"n":3})"),
               400, "n", "n > 1");
  // A header that never ends, and a body shorter than its Content-Length: closed after the read
  // timeout (2 s here), not held open.
  for (const std::string& partial :
       {std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"),
        std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")}) {
    const auto s0 = std::chrono::steady_clock::now();
    const auto r = http(ts.port, "", "", "", 15, partial);
    EXPECT_FALSE(r.timed_out) << "a partial request was held open";
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count(), 10);
  }
  // Garbage instead of HTTP.
  const auto g = http(ts.port, "", "", "", 15, "\x16\x03\x01 not http at all\r\n\r\n");
  EXPECT_FALSE(g.timed_out);
  EXPECT_TRUE(g.status == -1 || (g.status >= 400 && g.status < 500)) << g.status;
  bystander.join();
  EXPECT_EQ(during, want) << "the streaming client's output changed";
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60);
  // And the server still serves.
  EXPECT_EQ(ids_of(post(ts.port, "/v1/completions", completion(prompt, 30)).json_body()["choices"][0]), want);
}

TEST(Serve, TimeoutsAnswer408) {
  auto o = small_server_options();
  o.scheduler.timeout_s = 0.3;
  o.scheduler.max_context = 100000;
  TestServer ts(hybrid_model("gdn"), o);  // a recurrent state: no KV cache of 100k tokens
  expect_error(post(ts.port, "/v1/completions", completion("abc", 90000)), 408, "", "timed out");
}

TEST(Serve, ShutdownDrainsRunningRequests) {
  auto m = hybrid_model();
  auto ts = std::make_unique<TestServer>(hybrid_model(), small_server_options());
  const int port = ts->port;
  HttpResult running;
  std::thread client([&] { running = post(port, "/v1/completions", completion("drain me", 60)); });
  for (int i = 0; i < 400 && metric(port, "lt2_requests_running") + metric(port, "lt2_requests_prefilling") < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ts->server.shutdown(30);
  client.join();
  ASSERT_EQ(running.status, 200) << running.body;
  EXPECT_EQ(ids_of(running.json_body()["choices"][0]), reference(m, encode("drain me"), 60));
  EXPECT_EQ(connect_loopback(port) < 0 || http(port, "GET", "/health", "", 5).status != 200, true);
}

TEST(Serve, TheQueueServesInArrivalOrder) {
  // One slot: requests arriving one after another while it is busy start (and, with equal
  // lengths, finish) in the order they came. Each client starts once the server has taken the
  // previous request in (running, prefilling, queued or answered), so the arrival order is the
  // launch order however the machine schedules the client threads.
  auto o = small_server_options();
  o.scheduler.max_batch = 1;
  o.scheduler.prefill_rows = 1;
  TestServer ts(hybrid_model(), o);
  constexpr int kClients = 6;
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const auto r = post(ts.port, "/v1/completions", completion("fair " + std::to_string(i), 40));
      EXPECT_EQ(r.status, 200) << r.body;
      std::lock_guard<std::mutex> g(mu);
      order.push_back(i);
    });
    auto taken_in = [&] {
      double n = std::max(metric(ts.port, "lt2_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"), 0.0);
      for (const char* m : {"lt2_requests_running", "lt2_requests_prefilling", "lt2_requests_queued"})
        n += metric(ts.port, m);
      return n;
    };
    for (int k = 0; k < 2000 && taken_in() < i + 1; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& t : threads) t.join();
  std::vector<int> want(kClients);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(order, want);
}
