"""Load on a running `omnistage serve`: C concurrent streaming chat clients for D seconds
(bounded; loopback only). Prints req/s, TTFT p50/p95, errors and incomplete streams; the last
line is one JSON object.

    omnistage serve tiny:qwen2 --port 8011 &
    python -m benchmarks.server_load --base-url http://127.0.0.1:8011/v1 --model tiny:qwen2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai


async def client_loop(client, model: str, stop_at: float, max_tokens: int, stats: dict) -> None:
    i = 0
    while time.monotonic() < stop_at:
        i += 1
        t0 = time.monotonic()
        first = None
        tokens = 0
        finish = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=max_tokens, temperature=0.8, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.monotonic() - t0
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        except openai.OpenAIError as e:
            stats["errors"].append(repr(e)[:200])
            continue
        if finish != "length" or tokens != max_tokens:
            stats["incomplete"] += 1
        stats["done"] += 1
        stats["tokens"] += tokens
        if first is not None:
            stats["ttft"].append(first)


async def main(args) -> dict:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                timeout=120)
    stats = {"done": 0, "tokens": 0, "ttft": [], "errors": [], "incomplete": 0}
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    await asyncio.gather(*(client_loop(client, args.model, stop_at, args.max_tokens, stats)
                           for _ in range(args.concurrency)))
    wall = time.monotonic() - t0
    await client.close()
    ttft = sorted(stats["ttft"])
    pct = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 4)) if ttft else (lambda q: None)
    return {"concurrency": args.concurrency, "duration_s": round(wall, 1), "requests": stats["done"],
            "req_per_s": round(stats["done"] / wall, 2), "tok_per_s": round(stats["tokens"] / wall, 1),
            "ttft_p50_s": pct(0.5), "ttft_p95_s": pct(0.95),
            "ttft_mean_s": round(statistics.mean(ttft), 4) if ttft else None,
            "errors": len(stats["errors"]), "error_samples": stats["errors"][:3],
            "incomplete": stats["incomplete"]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds to keep starting requests")
    p.add_argument("--max-tokens", type=int, default=32)
    result = asyncio.run(main(p.parse_args()))
    print(f"{result['requests']} requests in {result['duration_s']} s: {result['req_per_s']} req/s, "
          f"TTFT p50 {result['ttft_p50_s']} s p95 {result['ttft_p95_s']} s, "
          f"errors {result['errors']}, incomplete {result['incomplete']}")
    print(json.dumps(result))
