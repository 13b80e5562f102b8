"""The decoder stack in one native call per step against the per-op forward, interleaved.

    python -m benchmarks.decoder_stack                       # small Qwen2, none,int8,int4, 5 pairs
    python -m benchmarks.decoder_stack --formats int4 --pairs 9 --model DIR

One engine per weight format; per pair, a single-stream decode (128 streamed tokens after a
32-token prompt, first to last token) with the model's `native_stack` bound, then with it
unbound (`native_stack = None`: the per-op forward over the same packed weights and caches).
Every run is printed, then the median of the per-pair ratios. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_description, cpu_line  # noqa: E402


def _decode_rate(llm, gen: torch.Generator, vocab: int) -> float:
    from omnistage import SamplingParams

    prompt = torch.randint(100, vocab - 100, (32,), generator=gen).tolist()
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    stamps = [(time.perf_counter(), len(d.token_ids))
              for d in llm.stream({"prompt_token_ids": prompt}, params) if d.token_ids]
    return sum(k for _, k in stamps[1:]) / (stamps[-1][0] - stamps[0][0])


def compare(model_dir: str, quantization: str, pairs: int) -> dict:
    from omnistage import Omni

    llm = Omni(model_dir, quantization=quantization, enable_prefix_caching=False)
    model = llm.engine.llm.model
    stack, gen = model.native_stack, torch.Generator().manual_seed(0)
    if stack is None:
        raise SystemExit(f"{model_dir}: the decoder stack does not serve this model here")
    vocab = model.config.vocab_size
    try:
        _decode_rate(llm, gen, vocab)                                  # warm-up
        runs = []
        for _ in range(pairs):
            model.native_stack = stack
            a = _decode_rate(llm, gen, vocab)
            model.native_stack = None
            runs.append((a, _decode_rate(llm, gen, vocab)))
    finally:
        model.native_stack = stack
        llm.close()
    return {"runs_tok_s": [[round(a, 1), round(b, 1)] for a, b in runs],
            "median_ratio": round(statistics.median(a / b for a, b in runs), 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen2 folder (default: tiny:qwen2 size small, built here)")
    ap.add_argument("--formats", default="none,int8,int4", help="quantization values")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    print(f"{cpu_line(cpu)}; {args.threads} threads", flush=True)
    report = {"cpu": cpu, "threads": args.threads, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from omnistage.tiny import build_tiny

            model_dir = str(build_tiny("qwen2", Path(tmp) / "small", size="small"))
        for q in args.formats.split(","):
            r = report["results"][q] = compare(model_dir, q, args.pairs)
            print(f"[{q}] stack vs per-op tok/s: "
                  + ", ".join(f"{a:.0f} vs {b:.0f}" for a, b in r["runs_tok_s"])
                  + f"; median ratio {r['median_ratio']:.2f}", flush=True)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
