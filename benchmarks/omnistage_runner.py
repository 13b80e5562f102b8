"""Our engine on the benchmark workload, through the public offline API only.

    Omni(model=DIR, **options).generate([{"prompt_token_ids": ids}, ...], [SamplingParams, ...])
    AsyncOmni(model=DIR).generate(prompt, params, request_id=...)  # async iterator of chunks
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.workload import Measurement, Workload

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _params(n: int):
    from omnistage import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _shutdown(engine) -> None:
    close = getattr(engine, "shutdown", None) or getattr(engine, "close", None)
    if close is not None:
        close()
    gc.collect()


def start_engine(model_dir, **options):
    """(Omni instance, engine start seconds = construction time)."""
    from omnistage import Omni

    t0 = time.perf_counter()
    llm = Omni(model=str(model_dir), **options)
    return llm, time.perf_counter() - t0


def generate(llm, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        [_params(n) for n in output_lens])
    return [list(o.token_ids) for o in outs]


def throughput(model_dir, workload: Workload, **options) -> Measurement:
    """Engine start, a two-request warm-up, then the whole workload as one generate call.
    torch's thread count is restored afterwards (a `num_threads` option sets it process-wide),
    so it never carries over into the peers measured after in this process."""
    import torch

    from benchmarks.bandwidth import torch_threads

    with torch_threads(torch.get_num_threads()):
        return _throughput(model_dir, workload, **options)


def _throughput(model_dir, workload: Workload, **options) -> Measurement:
    llm, start_s = start_engine(model_dir, **options)
    try:
        generate(llm, [p[:16] for p in workload.prompts[:2]], [4, 4])  # warm-up
        t0 = time.perf_counter()
        outs = generate(llm, workload.prompts, workload.output_lens)
        wall = time.perf_counter() - t0
    finally:
        _shutdown(llm)
    lens_ok = [len(o) for o in outs] == workload.output_lens
    notes = {"options": options, "lengths_ok": lens_ok}
    return Measurement("omnistage", sum(len(o) for o in outs), wall, start_s, notes, outs[:2])


async def _stream_times(model_dir, prompt: list[int], n: int) -> list[tuple[float, int]]:
    """(arrival time, tokens in chunk) for each streamed chunk of one request."""
    from omnistage import AsyncOmni

    engine = AsyncOmni(model=str(model_dir))
    try:
        stamps = []
        for rid in ("warm-up", "timed"):
            stamps = []
            params = _params(8 if rid == "warm-up" else n)
            async for chunk in engine.generate({"prompt_token_ids": prompt}, params,
                                               request_id=f"bench-{rid}"):
                if chunk.token_ids:
                    stamps.append((time.perf_counter(), len(chunk.token_ids)))
        return stamps
    finally:
        _shutdown(engine)


def _decode_by_difference(model_dir, prompt: list[int], n: int) -> dict:
    """Fallback without streaming: (n - m) / (t(n) - t(m)) with m = n // 8, best of 2 each."""
    llm, _ = start_engine(model_dir)
    try:
        m = max(2, n // 8)
        generate(llm, [prompt], [8])  # warm-up
        best = {}
        for k in (n, m, n, m):
            t0 = time.perf_counter()
            generate(llm, [prompt], [k])
            best[k] = min(best.get(k, float("inf")), time.perf_counter() - t0)
    finally:
        _shutdown(llm)
    return {"decode_tok_s": round((n - m) / (best[n] - best[m]), 2), "tokens": n,
            "prompt_len": len(prompt), "method": f"difference of {n}- and {m}-token runs"}


def _sync_stream_times(model_dir, prompt: list[int], n: int) -> list[tuple[float, int]]:
    """Like _stream_times, through the blocking Omni.stream (the engine steps in this thread)."""
    llm, _ = start_engine(model_dir)
    try:
        stamps = []
        for k in (8, n):   # warm-up, then timed
            stamps = [(time.perf_counter(), len(d.token_ids))
                      for d in llm.stream({"prompt_token_ids": prompt}, _params(k)) if d.token_ids]
        return stamps
    finally:
        _shutdown(llm)


def _async_stream_times(model_dir: str, prompt: list[int], n: int) -> list[tuple[float, int]]:
    return asyncio.run(_stream_times(model_dir, prompt, n))


def _rate(stamps: list[tuple[float, int]]) -> float:
    after_first = sum(k for _, k in stamps[1:])
    return round(after_first / (stamps[-1][0] - stamps[0][0]), 2)


def single_stream_decode(model_dir, prompt: list[int], n: int) -> dict:
    """Decode tok/s of one request, prefill excluded (first to last streamed token).

    Two figures: the engine stepping in the caller's thread (Omni.stream, the headline), and
    AsyncOmni, whose engine steps in a background thread (run in a fresh process).
    """
    try:
        from omnistage import AsyncOmni  # noqa: F401
    except ImportError:
        return _decode_by_difference(model_dir, prompt, n)
    sync = _sync_stream_times(model_dir, prompt, n)
    # A fresh process: OpenMP teams left by earlier runs on this thread would slow the
    # engine thread (see AsyncOmni.__init__), which a real server does not have. Arguments
    # and results travel as JSON (no pickle between processes).
    code = ("import json, sys; from benchmarks.omnistage_runner import _async_stream_times as f; "
            "a = json.loads(sys.argv[1]); print(json.dumps(f(*a)))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([str(model_dir), prompt, n])],
                          capture_output=True, text=True, check=True, cwd=_REPO_ROOT)
    stamps = json.loads(done.stdout.strip().splitlines()[-1])
    return {"decode_tok_s": _rate(sync), "tokens": sum(k for _, k in sync), "chunks": len(sync),
            "prompt_len": len(prompt), "method": "Omni.stream",
            "async_decode_tok_s": _rate(stamps), "async_method": "AsyncOmni stream"}
