#!/usr/bin/env python3
"""Load generator for `lt2 serve` (or any OpenAI-compatible server): asynchronous streaming clients,
Poisson arrivals, fixed seeds, fixed output lengths.

Each request is a streaming /v1/completions call whose prompt is a list of token ids (so its length
is exact whatever the tokenizer) and which generates exactly --output-len tokens (`ignore_eos`, an
lt2/vLLM extension). Prints, and writes as JSON with --out-json: requests, output tokens/s over the
run, time to first token (TTFT) and inter-token latency (ITL) p50/p99.

  --concurrency N      at most N requests in flight (the closed-loop limit)
  --rate R             Poisson arrivals at R requests/s (default: inf, all at once up to --concurrency)
  --shared-prefix F    the first F of every prompt is the same (0.9: 90% shared), the rest random

Standard library only (asyncio + raw HTTP/1.1), so it runs wherever Python 3.8+ does.
  bench/serve_load.py --port 8000 --model lt2-gdn-1.3b --requests 128 --concurrency 64 \\
      --prompt-len 8192 --output-len 256 --shared-prefix 0.9 --out-json serve.json
"""
import argparse
import asyncio
import json
import random
import sys
import time


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(args, prompt, result):
    """One streaming completion; fills result with its timings (seconds) and token count."""
    body = json.dumps({"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
                       "temperature": args.temperature, "seed": args.seed, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(args.host, args.port), args.timeout)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (args.host.encode(), len(body)) + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), args.timeout)
        status = int(status_line.split()[1]) if status_line else -1
        token_times = []
        buf = b""
        deadline = t0 + args.timeout
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(deadline - time.perf_counter(), 0.001))
            if not chunk:
                break
            now = time.perf_counter()
            buf += chunk
            # Count the SSE events that carry text; the HTTP chunk framing does not matter here.
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                i = event.find(b"data: ")
                if i < 0:
                    continue
                data = event[i + 6:]
                if data.startswith(b"[DONE]"):
                    continue
                try:
                    j = json.loads(data.split(b"\r\n")[0])
                except ValueError:
                    continue
                if "error" in j:
                    result["error"] = j["error"].get("message")
                elif j.get("choices"):
                    # lt2 sends every token's id (return_token_ids), so a token without text of its own (a
                    # partial UTF-8 character) still counts; other servers: one token per text event.
                    c = j["choices"][0]
                    n = len(c["token_ids"]) if "token_ids" in c else int(bool(c.get("text")))
                    token_times.extend([now] * n)
        result.update(status=status, start=t0, end=time.perf_counter(), token_times=token_times)
    except (asyncio.TimeoutError, OSError) as e:
        result.update(status=-1, error=repr(e), start=t0, end=time.perf_counter(), token_times=[])
    finally:
        writer.close()


def make_prompts(args):
    rng = random.Random(args.seed)
    vocab = args.vocab
    shared_len = int(args.prompt_len * args.shared_prefix)
    shared = [rng.randrange(1, vocab) for _ in range(shared_len)]
    return [shared + [rng.randrange(1, vocab) for _ in range(args.prompt_len - shared_len)]
            for _ in range(args.requests)]


async def run(args):
    prompts = make_prompts(args)
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.concurrency)
    results = [dict() for _ in prompts]

    async def guarded(i):
        async with sem:
            await one_request(args, prompts[i], results[i])

    if args.warmup:
        await one_request(args, prompts[0][: max(1, args.prompt_len // 8)], {})
    t0 = time.perf_counter()
    tasks = []
    for i in range(len(prompts)):
        tasks.append(asyncio.create_task(guarded(i)))
        if args.rate > 0 and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0

    ok = [r for r in results if r.get("status") == 200 and not r.get("error") and r["token_times"]]
    ttft = [r["token_times"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    out_tokens = sum(len(r["token_times"]) for r in ok)
    # The steady window: every request has its first token and none has its last, so all of them
    # decode together (the decode capacity, without the prefill phase at the start and the drain at
    # the end; none when the early requests finish before the last one starts).
    steady = float("nan")
    if ok:
        t_a = max(r["token_times"][0] for r in ok)
        t_b = min(r["token_times"][-1] for r in ok)
        if t_b - t_a > 0.5:
            n = sum(1 for r in ok for t in r["token_times"] if t_a < t <= t_b)
            steady = n / (t_b - t_a)
    summary = {
        "model": args.model, "requests": len(results), "ok": len(ok), "concurrency": args.concurrency,
        "rate": args.rate, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "shared_prefix": args.shared_prefix, "seed": args.seed, "wall_s": wall,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall > 0 else 0,
        "steady_output_tokens_per_s": steady,
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
        "errors": sorted({str(r.get("error") or r.get("status")) for r in results if r not in ok})[:5],
    }
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="the model id the server serves (/v1/models)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0, help="Poisson arrivals per second (0: no spacing)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of every prompt that is shared")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [1, vocab)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--warmup", action="store_true", help="one short request before the timed run")
    p.add_argument("--out-json", help="write the summary here")
    args = p.parse_args()
    if not 0 <= args.shared_prefix < 1:
        p.error("--shared-prefix must be in [0, 1)")
    summary = asyncio.run(run(args))
    line = ("{ok}/{requests} ok, concurrency {concurrency}, prompt {prompt_len} (shared {shared_prefix:.0%}), "
            "output {output_len}: {output_tokens_per_s:.1f} output tok/s ({steady_output_tokens_per_s:.1f} with all "
            "decoding); TTFT p50 {ttft_p50_ms:.1f} ms "
            "p99 {ttft_p99_ms:.1f} ms; ITL p50 {itl_p50_ms:.2f} ms p99 {itl_p99_ms:.2f} ms").format(**summary)
    print(line)
    if summary["errors"]:
        print("errors:", summary["errors"], file=sys.stderr)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(0 if summary["ok"] == summary["requests"] else 1)


if __name__ == "__main__":
    main()
