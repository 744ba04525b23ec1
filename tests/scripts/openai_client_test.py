#!/usr/bin/env python3
"""`lt2 serve` driven by the official `openai` Python client (PyPI): models, completions, chat,
streaming equal to non-streaming, and an error raised as the client's BadRequestError.

Usage: openai_client_test.py LT2_BINARY
Exits 77 (CTest: skipped) with a message when the `openai` package is not installed. Every wait is
bounded; the server runs on a loopback port the OS picks and is stopped with SIGTERM at the end.
"""
import re
import signal
import subprocess
import sys
import tempfile
import time

try:
    import openai
except ImportError:
    print("SKIP: the `openai` package is not installed (pip install openai; scripts/setup.sh does)")
    sys.exit(77)


def start_server(lt2):
    log = tempfile.NamedTemporaryFile("w+", prefix="lt2-serve-openai-", suffix=".log", delete=False)
    proc = subprocess.Popen([lt2, "serve", "tiny-full-gdn", "--tokenizer", "bytes", "--port", "0", "--device", "cpu",
                             "--max-context", "256", "--max-batch", "4", "--model-name", "tiny"],
                            stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    deadline = time.time() + 120
    while time.time() < deadline:
        text = open(log.name).read()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        if m:
            return proc, int(m.group(1)), log.name
        if proc.poll() is not None:
            raise SystemExit(f"lt2 serve exited early:\n{text}")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("lt2 serve did not start within 120 s")


def main():
    proc, port, log = start_server(sys.argv[1])
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what)

    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        check([m.id for m in client.models.list().data] == ["tiny"], "models.list")
        extra = {"ignore_eos": True, "return_token_ids": True}

        c = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=12, temperature=0,
                                      extra_body=extra)
        check(c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length", f"completion: {c}")
        chunks = list(client.completions.create(model="tiny", prompt="It is a truth", max_tokens=12, temperature=0,
                                                stream=True, extra_body=extra))
        check("".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text,
              "streamed completion text == non-streamed")

        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=3,
                                           logprobs=True, top_logprobs=2, extra_body=extra)
        check(r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 10, f"chat: {r}")
        check(len(r.choices[0].logprobs.content) == 10 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2,
              "chat logprobs")
        text = ""
        usage = None
        for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=3,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra):
            if ch.usage:
                usage = ch.usage
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
        check(text == r.choices[0].message.content, "streamed chat == non-streamed")
        check(usage is not None and usage.completion_tokens == 10, f"stream usage: {usage}")

        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"bogus_field": 1})
            check(False, "an unknown field was accepted")
        except openai.BadRequestError as e:
            check("bogus_field" in str(e), f"error names the field: {e}")
        try:
            client.completions.create(model="tiny", prompt="x" * 300, max_tokens=3)
            check(False, "a prompt longer than the context was accepted")
        except openai.BadRequestError as e:
            check(e.code == "context_length_exceeded", f"context_length_exceeded: {e}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed after 60 s"
        check(rc == 0, f"lt2 serve exit status after SIGTERM: {rc}")
    if failures:
        print(open(log).read()[-4000:])
        sys.exit(1)
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
