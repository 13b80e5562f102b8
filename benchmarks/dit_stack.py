"""The token2wav DiT's blocks in one native call per evaluation against one call per kernel,
interleaved.

    python -m benchmarks.dit_stack                       # small Qwen2.5-Omni, int8, 1 and 4 streams
    python -m benchmarks.dit_stack --streams 1,8 --pairs 9 --bf16
    python -m benchmarks.dit_stack --float32 --model DIR

One Token2Wav as the serving recipe builds it with `--token2wav-int8` (and `--bf16`:
`--token2wav-bf16`), or with `--float32` as it builds the default DiT (float32, the native
products); per pair, one ODE solve (10 RK4 steps, guidance) of `--streams` first chunks with
the stack bound (`DiTModel.use_native_stack`), then unbound (`stack = None`: the per-block path
over the same weights and kernels; int8 the same bits, float32 within its rounding, as the
tests check). Every run is printed, then the median of the per-pair ratios. The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dit_attention import load, pair_report, solve_seconds  # noqa: E402
from benchmarks.machine import cpu_description, cpu_line  # noqa: E402


def compare(t2w, speaker, streams: int, pairs: int, log) -> dict:
    stack = t2w.dit.stack

    def timed(bound: bool) -> float:
        t2w.dit.stack = stack if bound else None
        return solve_seconds(t2w, speaker, streams)

    timed(True), timed(False)                                            # warm-up
    runs = []
    for i in range(pairs):
        runs.append((timed(True), timed(False)))
        a, b = runs[-1]
        log(f"streams {streams} pair {i}: stack {a:.4f} s  per-block {b:.4f} s  ({b / a:.2f}x)")
    t2w.dit.stack = stack
    return {"streams": streams, **pair_report(runs, "stack", "per_block")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Qwen2.5-Omni folder (default: the small tiny build)")
    p.add_argument("--streams", default="1,4", help="first chunks solved together (comma list)")
    p.add_argument("--pairs", type=int, default=5, help="A B pairs (stack, per block) per count")
    p.add_argument("--bf16", action="store_true", help="the DiT's other GEMMs in packed bf16 (--token2wav-bf16)")
    p.add_argument("--float32", action="store_true",
                   help="the default float32 DiT (native float32 products) instead of the int8 one")
    args = p.parse_args(argv)
    try:
        streams = [int(s) for s in args.streams.split(",") if s]
    except ValueError:
        p.error(f"--streams takes a comma list of integers, got {args.streams!r}")
    if not streams or min(streams) < 1 or args.pairs < 1:
        p.error("--streams and --pairs must be >= 1")
    if args.float32 and args.bf16:
        p.error("--float32 and --bf16 exclude each other")
    from omnistage.entrypoints.model_source import tiny_checkpoint

    model = args.model or str(tiny_checkpoint("qwen2_5_omni", "small", 0, "float32"))
    log = lambda s: print(s, file=sys.stderr, flush=True)       # noqa: E731
    cpu = cpu_description()
    log(cpu_line(cpu))
    t2w, speaker = load(model, args.bf16, int8=not args.float32)
    report = {"model": model, "products": "float32" if args.float32 else "int8", "bf16": args.bf16, "cpu": cpu,
              "levels": [compare(t2w, speaker, n, args.pairs, log) for n in streams]}
    for r in report["levels"]:
        log(f"median, {r['streams']} streams: stack {r['median_stack_s']} s, per-block "
            f"{r['median_per_block_s']} s, speedup {r['median_speedup']}x")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
