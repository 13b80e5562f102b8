"""The token2wav DiT's products in int8 (the native W8A8 kernel, `--token2wav-int8`) against
oneDNN's packed bf16 and float32 GEMMs, interleaved, and what it makes of a streaming solve.

    python -m benchmarks.dit_gemm                       # small Qwen2.5-Omni, 1536 and 2400 rows
    python -m benchmarks.dit_gemm --rows 400 --streams 8 --pairs 7

1. Each frame-row product of the DiT (q|k|v, output, feed-forward up with GELU, down) at
   `--rows` rows: per pair one call of each kernel (W8A8, bf16, fp32), best of 5 each; every
   pair printed, then the median of the per-pair ratios int8 / bf16 in operations per second.
2. One ODE solve (10 RK4 steps, guidance) of `--streams` streams' first chunks, the DiT packed
   as `--token2wav-bf16` against `--token2wav-bf16 --token2wav-int8`, A B per pair.
3. Accuracy: four whole utterances' mel with each option against float32 (relative RMS).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bandwidth import seconds  # noqa: E402
from benchmarks.dit_attention import load, solve_seconds  # noqa: E402
from benchmarks.machine import cpu_description, cpu_line  # noqa: E402


def frame_products(dit_config) -> list[tuple[str, int, int, str]]:
    """(name, out, in, activation) of the products over every frame row of a DiT layer."""
    h, inner, ff = dit_config.hidden_size, dit_config.num_attention_heads * dit_config.head_dim, \
        dit_config.hidden_size * dit_config.ff_mult
    return [("qkv", 3 * inner, h, "none"), ("out", h, inner, "none"), ("ff_up", ff, h, "gelu_tanh"),
            ("ff_down", h, ff, "none")]


def gemm_pairs(shapes, rows_list, pairs: int, log) -> list[dict]:
    from omnistage.kernels.linear_w8a8 import W8A8Kernel, pack_w8a8
    from omnistage.layers.onednn import onednn_bf16_available, pack_weight, packed_linear

    kernel, bf16 = W8A8Kernel(), onednn_bf16_available()
    out = []
    for rows in rows_list:
        for name, n, k, act in shapes:
            g = torch.Generator().manual_seed(n + k)
            x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
            q, p32 = pack_w8a8(w), pack_weight(w)
            post = ("gelu", "tanh") if act != "none" else ("none", "")
            runs = {"int8": lambda: kernel(x, q, b, act), "fp32": lambda: packed_linear(x, p32, b, *post)}
            if bf16:
                p16, b16 = pack_weight(w.bfloat16()), b.bfloat16()
                runs["bf16"] = lambda: packed_linear(x.bfloat16(), p16, b16, *post).float()
            ops = 2 * rows * n * k
            per = [{key: ops / seconds(fn, 5)[0] / 1e9 for key, fn in runs.items()} for _ in range(pairs)]
            for i, r in enumerate(per):
                log(f"{name} {rows}x{k}->{n} pair {i}: " + "  ".join(f"{key} {v:.0f}" for key, v in r.items())
                    + " GOP/s")
            ref = "bf16" if bf16 else "fp32"
            ratio = statistics.median(r["int8"] / r[ref] for r in per)
            log(f"{name} {rows} rows: int8 / {ref} median {ratio:.2f}x")
            out.append({"product": name, "rows": rows, "out": n, "in": k, "vs": ref,
                        "median_ratio": round(ratio, 3), "gop_s": [{k2: round(v, 1) for k2, v in r.items()} for r in per]})
    return out


def solve_pairs(model: str, streams: int, pairs: int, log) -> dict:
    (base, speaker), (int8, _) = load(model, True), load(model, True, int8=True)
    solve_seconds(base, speaker, streams), solve_seconds(int8, speaker, streams)       # warm-up
    runs = [(solve_seconds(base, speaker, streams), solve_seconds(int8, speaker, streams)) for _ in range(pairs)]
    for i, (a, b) in enumerate(runs):
        log(f"solve of {streams} first chunks, pair {i}: bf16 {a:.4f} s  int8+bf16 {b:.4f} s ({a / b:.2f}x)")
    speedup = statistics.median(a / b for a, b in runs)
    log(f"solve median speedup {speedup:.2f}x")
    return {"streams": streams, "runs_s": [[round(a, 4), round(b, 4)] for a, b in runs],
            "median_speedup": round(speedup, 3)}


def accuracy(model: str, log) -> dict:
    """Four whole utterances (150 codes each, fixed noise) per option, mel against float32."""
    from omnistage.models.qwen2_5_omni.token2wav import Token2WavRequest

    mels = {}
    for name, bf16, int8 in [("fp32", False, False), ("bf16", True, False), ("int8", False, True),
                             ("int8+bf16", True, True)]:
        t2w, speaker = load(model, bf16, int8)
        g = torch.Generator().manual_seed(0)
        reqs = [Token2WavRequest(torch.randint(0, 100, (150,), generator=g), speaker.cond, speaker.ref_mel,
                                 torch.randn(1, 2 * 150, t2w.dit.mel_dim, generator=g)) for _ in range(4)]
        with torch.inference_mode():
            mels[name] = t2w.mel_batch(reqs)
    out = {}
    for name, got in mels.items():
        out[name] = round(max(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
                              for a, b in zip(got, mels["fp32"])), 6)
        log(f"mel relative RMS against float32, {name}: {100 * out[name]:.3f}%")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Qwen2.5-Omni folder (default: the small tiny build)")
    p.add_argument("--rows", default="1536,2400", help="frame rows of the products (comma list)")
    p.add_argument("--streams", type=int, default=4, help="first chunks solved together")
    p.add_argument("--pairs", type=int, default=5, help="A B pairs per measurement")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        p.error(f"--rows takes a comma list of integers, got {args.rows!r}")
    if args.streams < 1 or args.pairs < 1 or not rows or min(rows) < 1:
        p.error("--rows, --streams and --pairs must be >= 1")
    from omnistage.entrypoints.model_source import tiny_checkpoint
    from omnistage.models.qwen2_5_omni.recipe import token2wav_config

    model = args.model or str(tiny_checkpoint("qwen2_5_omni", "small", 0, "float32"))
    log = lambda s: print(s, file=sys.stderr, flush=True)       # noqa: E731
    cpu = cpu_description()
    log(cpu_line(cpu))
    report = {"model": model, "cpu": cpu,
              "products": gemm_pairs(frame_products(token2wav_config(model).dit_config), rows, args.pairs, log),
              "solve": solve_pairs(model, args.streams, args.pairs, log), "mel_rel_rms": accuracy(model, log)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
