"""The linear layers' kernels side by side: omnistage's native kernel (omnistage/kernels/
linear.c) against oneDNN's packed GEMM and torch's default `x @ W_t`, on the benchmark model's
shapes, in one run.

    python -m benchmarks.linear_kernel                      # small Qwen2 shapes, rows 1..2048
    python -m benchmarks.linear_kernel --rows 1,64 --shapes 768x512,32000x512

Per (shape, rows): the best of `--repeats` timings of each kernel, its GFLOP/s and weight GB/s,
and native / oneDNN. For one row the weights are rotated over copies larger than the last-level
cache, as a decode step reads them (each matrix once per token, from memory); with more rows
each kernel reads one copy. Plus the whole decode step's 49 products (12 layers + lm_head) in
sequence, each kernel against the machine's read bandwidth (`torch.sum`, measured in between).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bandwidth import seconds  # noqa: E402
from omnistage.kernels.linear import NativeLinearKernel  # noqa: E402
from omnistage.layers.onednn import onednn_linear_available, pack_weight, packed_linear

# (out, in) of the small benchmark Qwen2: q|k|v, o, gate|up, down, lm_head.
SMALL_SHAPES = [(768, 512), (512, 512), (3584, 512), (512, 1792), (32000, 512)]
LAYERS = 12
COLD_BYTES = 256e6        # rotate one-row weights over at least this much (L3 is 32 MB here)


def _best(fn, repeats: int) -> float:
    return seconds(fn, repeats)[0]


def _kernels(native: NativeLinearKernel, have_onednn: bool):
    """name -> (pack(w (out, in)) -> weight object, run(x, weight, out_features))."""
    ks = {"native": (lambda w: native.pack(w.t().contiguous()), lambda x, p, n: native(x, p, None)),
          "matmul": (lambda w: w.t().contiguous(), lambda x, p, n: x @ p)}
    if have_onednn:
        ks["onednn"] = (pack_weight, lambda x, p, n: packed_linear(x, p, None))
    return ks


def bench_shapes(shapes, rows_list, repeats: int, kernels) -> list[dict]:
    results = []
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        copies = max(1, min(256, int(COLD_BYTES // (n * k * 4))))
        ws = [torch.randn(n, k, generator=g) for _ in range(copies)]
        packed = {name: [pack(w) for w in ws] for name, (pack, _) in kernels.items()}
        for m in rows_list:
            x = torch.randn(m, k, generator=g)
            row, seconds = {"out": n, "in": k, "rows": m}, {}
            for name, (_, run) in kernels.items():
                ps = packed[name] if m == 1 else packed[name][:1]
                state = [0]

                def call(ps=ps, run=run, state=state):
                    state[0] = (state[0] + 1) % len(ps)
                    run(x, ps[state[0]], n)
                t = seconds[name] = _best(call, repeats)
                row[name] = {"us": round(t * 1e6, 1), "gflops": round(2 * m * n * k / t / 1e9, 1),
                             "weight_GBps": round(n * k * 4 / t / 1e9, 1)}
            # From the unrounded times, to 3 significant digits: on a busy machine a stalled
            # OpenMP team can make a tiny product 1000x slower, a ratio that 3 decimals show as 0.
            if "onednn" in row:
                row["native_vs_onednn"] = float(f"{seconds['onednn'] / seconds['native']:.3g}")
            row["native_vs_matmul"] = float(f"{seconds['matmul'] / seconds['native']:.3g}")
            results.append(row)
            print(f"{n:6d}x{k:<5d} rows {m:5d}  " + "  ".join(
                f"{name} {row[name]['us']:9.1f} us {row[name]['gflops']:6.1f} GF/s"
                for name in kernels) + f"  native/onednn {row.get('native_vs_onednn', '-')}", flush=True)
    return results


def bench_decode_step(shapes, repeats: int, kernels, bandwidth_gib: float) -> dict:
    """All of one decode step's products in sequence (one row), against torch.sum's read rate."""
    plan = [s for s in shapes[:-1] for _ in range(LAYERS)] + shapes[-1:]
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g) for n, k in plan]
    total = sum(w.numel() * 4 for w in ws)
    xs = {k: torch.randn(1, k, generator=g) for _, k in plan}
    packed = {name: [pack(w) for w in ws] for name, (pack, _) in kernels.items()}
    y = torch.ones(int(bandwidth_gib * (1 << 28)))
    out = {"weight_bytes": total, "rounds": []}
    for _ in range(3):     # interleaved: this machine's bandwidth drifts within minutes
        rnd = {"sum_GBps": round(y.numel() * 4 / _best(y.sum, 3) / 1e9, 1)}
        for name, (_, run) in kernels.items():
            def step(name=name, run=run):
                for (n, k), p in zip(plan, packed[name]):
                    run(xs[k], p, n)
            rnd[name + "_GBps"] = round(total / _best(step, repeats) / 1e9, 1)
        out["rounds"].append(rnd)
        print("decode step: " + "  ".join(f"{k} {v}" for k, v in rnd.items()), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SMALL_SHAPES),
                    help="comma list of OUTxIN (the last one is the lm_head in the decode step)")
    ap.add_argument("--rows", default="1,4,16,64,256,2048", help="comma list of row counts")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0,
                    help="size of the tensor torch.sum reads for the bandwidth figure")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    kernels = _kernels(NativeLinearKernel(), onednn_linear_available(torch.device("cpu"), torch.float32))
    with torch.inference_mode():
        report = {"threads": torch.get_num_threads(), "kernels": list(kernels),
                  "shapes": bench_shapes(shapes, rows, args.repeats, kernels),
                  "decode_step": bench_decode_step(shapes, max(3, args.repeats // 4), kernels,
                                                 args.bandwidth_gib)}
    line = json.dumps(report)
    if args.out_json:
        Path(args.out_json).write_text(line + "\n")
    print(line)
    return report


if __name__ == "__main__":
    main()
