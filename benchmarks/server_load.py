"""Load on a running `omnistage serve`: C concurrent streaming chat clients for D seconds
(bounded; loopback only). Prints req/s, TTFT p50/p95 (and with --audio, time to first audio
p50/p95 and seconds of speech), errors and incomplete streams; with --memory-every S, the
server's resident memory over the run (from /metrics: start, end, largest, MB/min over the
second half); the last line is one JSON object.

    omnistage serve tiny:qwen2 --port 8011 &
    python -m benchmarks.server_load --base-url http://127.0.0.1:8011/v1 --model tiny:qwen2
    omnistage serve tiny:qwen2_5_omni --port 8012 &
    python -m benchmarks.server_load --base-url http://127.0.0.1:8012/v1 --model tiny:qwen2_5_omni --audio
    omnistage serve tiny:qwen_image:small --port 8013 &
    python -m benchmarks.server_load --base-url http://127.0.0.1:8013/v1 --model tiny:qwen_image:small \
        --images --size 256x256 --steps 20 --concurrency 8 --duration 60
    omnistage serve tiny:qwen3_omni --port 8014 --api-key K &
    python -m benchmarks.server_load --base-url http://127.0.0.1:8014/v1 --api-key K --model tiny:qwen3_omni \
        --audio --concurrency 4 --duration 600 --memory-every 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import openai


async def client_loop(client, model: str, stop_at: float, max_tokens: int, stats: dict,
                      audio: bool = False) -> None:
    i = 0
    speech = {"modalities": ["text", "audio"], "audio": {"format": "pcm16"}} if audio else {}
    while time.monotonic() < stop_at:
        i += 1
        t0 = time.monotonic()
        first = first_audio = None
        tokens = 0
        finish = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=max_tokens, temperature=0.8, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **speech)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.monotonic() - t0
                delta_audio = chunk.choices[0].delta.audio if chunk.choices else None
                if delta_audio and delta_audio.data:
                    if first_audio is None:
                        first_audio = time.monotonic() - t0
                    stats["audio_s"] += len(delta_audio.data) * 3 / 4 / 2 / 24000
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
        if audio:
            if first_audio is None:
                stats["incomplete"] += 1
            else:
                stats["ttfa"].append(first_audio)


async def image_loop(client, model: str, stop_at: float, size: str, steps: int, stats: dict) -> None:
    """Image clients: each generates one PNG after another (b64_json), timing each request."""
    i = 0
    while time.monotonic() < stop_at:
        i += 1
        t0 = time.monotonic()
        try:
            resp = await client.images.generate(model=model, prompt=f"picture {i}", size=size,
                                                extra_body={"num_inference_steps": steps})
        except openai.OpenAIError as e:
            stats["errors"].append(repr(e)[:200])
            continue
        if not resp.data or not resp.data[0].b64_json:
            stats["incomplete"] += 1
        stats["done"] += 1
        stats["latency"].append(time.monotonic() - t0)


async def memory_loop(base_url: str, api_key: str, every_s: float, stop_at: float,
                      samples: list[tuple[float, float]]) -> None:
    """The server's resident memory (process_resident_memory_bytes on /metrics) every
    `every_s` seconds until `stop_at`: (seconds since the start, MB)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    t0 = time.monotonic()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as h:
        while True:
            r = await h.get(url)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code} {r.text[:200]}")
            rss = next((float(line.split()[1]) for line in r.text.splitlines()
                        if line.startswith("process_resident_memory_bytes ")), None)
            if rss is None:
                raise RuntimeError(f"{url} has no process_resident_memory_bytes (not an omnistage server on Linux?)")
            samples.append((round(time.monotonic() - t0, 1), round(rss / 2**20, 1)))
            if time.monotonic() + every_s > stop_at:
                return
            await asyncio.sleep(every_s)


def memory_summary(samples: list[tuple[float, float]]) -> dict:
    """First, last and largest resident MB, and the growth over the second half of the run
    (MB per minute: past the warm-up, where a leak shows as a steady slope)."""
    half = [s for s in samples if s[0] >= samples[-1][0] / 2]
    slope = ((half[-1][1] - half[0][1]) / (half[-1][0] - half[0][0]) * 60
             if len(half) > 1 and half[-1][0] > half[0][0] else None)
    return {"rss_start_mb": samples[0][1], "rss_end_mb": samples[-1][1],
            "rss_max_mb": max(mb for _, mb in samples),
            "rss_mb_per_min_second_half": None if slope is None else round(slope, 2),
            "rss_samples": samples}


async def main(args) -> dict:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                timeout=120)
    stats = {"done": 0, "tokens": 0, "ttft": [], "ttfa": [], "audio_s": 0.0, "errors": [],
             "incomplete": 0, "latency": []}
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    memory: list[tuple[float, float]] = []
    sampler = ([memory_loop(args.base_url, args.api_key, args.memory_every, stop_at, memory)]
               if args.memory_every else [])
    if args.images:
        await asyncio.gather(*(image_loop(client, args.model, stop_at, args.size, args.steps, stats)
                               for _ in range(args.concurrency)), *sampler)
    else:
        await asyncio.gather(*(client_loop(client, args.model, stop_at, args.max_tokens, stats, args.audio)
                               for _ in range(args.concurrency)), *sampler)
    wall = time.monotonic() - t0
    await client.close()

    def pct(values: list[float], q: float):
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None

    ttft = stats["ttft"]
    out = {"concurrency": args.concurrency, "duration_s": round(wall, 1), "requests": stats["done"],
           "req_per_s": round(stats["done"] / wall, 2), "tok_per_s": round(stats["tokens"] / wall, 1),
           "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
           "ttft_mean_s": round(statistics.mean(ttft), 4) if ttft else None,
           "errors": len(stats["errors"]), "error_samples": stats["errors"][:3],
           "incomplete": stats["incomplete"]}
    if args.images:
        out.update(images_per_s=out.pop("req_per_s"), latency_p50_s=pct(stats["latency"], 0.5),
                   latency_p95_s=pct(stats["latency"], 0.95))
        for k in ("tok_per_s", "ttft_p50_s", "ttft_p95_s", "ttft_mean_s"):
            out.pop(k)
    if memory:
        out.update(memory_summary(memory))
    if args.audio:
        out.update(ttfa_p50_s=pct(stats["ttfa"], 0.5), ttfa_p95_s=pct(stats["ttfa"], 0.95),
                   audio_s_per_s=round(stats["audio_s"] / wall, 2))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds to keep starting requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--audio", action="store_true", help="ask for speech too (pcm16 stream); report TTFA")
    p.add_argument("--images", action="store_true",
                   help="image models: clients call /v1/images/generations; report images/s and latency")
    p.add_argument("--size", default="256x256", help="--images: image size (default 256x256)")
    p.add_argument("--steps", type=int, default=20, help="--images: denoising steps (default 20)")
    p.add_argument("--memory-every", type=float, default=0.0, metavar="S",
                   help="also read the server's resident memory from /metrics every S seconds and report "
                        "its start, end, largest and its growth over the run's second half (MB/min)")
    result = asyncio.run(main(p.parse_args()))
    if "images_per_s" in result:
        print(f"{result['requests']} images in {result['duration_s']} s: {result['images_per_s']} images/s, "
              f"latency p50 {result['latency_p50_s']} s p95 {result['latency_p95_s']} s, "
              f"errors {result['errors']}, incomplete {result['incomplete']}")
        print(json.dumps(result))
        raise SystemExit(0)
    print(f"{result['requests']} requests in {result['duration_s']} s: {result['req_per_s']} req/s, "
          f"TTFT p50 {result['ttft_p50_s']} s p95 {result['ttft_p95_s']} s, "
          + (f"TTFA p50 {result['ttfa_p50_s']} s p95 {result['ttfa_p95_s']} s, "
             f"{result['audio_s_per_s']} audio-s/s, " if result.get('ttfa_p50_s') is not None else "")
          + f"errors {result['errors']}, incomplete {result['incomplete']}"
          + (f", resident {result['rss_start_mb']} -> {result['rss_end_mb']} MB (max {result['rss_max_mb']}; "
             f"second half {result['rss_mb_per_min_second_half']} MB/min)" if "rss_end_mb" in result else ""))
    print(json.dumps(result))
