"""The token2wav DiT's attention as one native call per layer against the SDPA path, interleaved.

    python -m benchmarks.dit_attention                       # small Qwen2.5-Omni, 8 streams, fp32
    python -m benchmarks.dit_attention --streams 1 --pairs 9 --bf16
    python -m benchmarks.dit_attention --model DIR

One Token2Wav as the serving recipe builds it (linears packed for oneDNN, float32 or --bf16);
per pair, one ODE solve (10 RK4 steps, guidance) of `--streams` first chunks with the kernel
attached to every layer (`DiTModel.use_native_attention`), then detached (SDPA over key
windows, the path it replaces). Every run is printed, then the median of the per-pair ratios.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_description, cpu_line  # noqa: E402


def load(model_dir: str, bf16: bool, int8: bool = False, stack: bool = True):
    """The folder's Token2Wav as the recipe packs it (bf16 / int8: --token2wav-bf16 / -int8;
    neither: float32 with the native products), with its blocks in one native call unless
    `stack` is False (DiTModel.use_native_stack), and its first speaker."""
    from omnistage.kernels.linear import NativeLinearKernel
    from omnistage.kernels.linear_w8a8 import W8A8Kernel
    from omnistage.layers.checkpoint import iter_weights, safetensors_files
    from omnistage.models.qwen2_5_omni.loader import load_speakers
    from omnistage.models.qwen2_5_omni.recipe import token2wav_config
    from omnistage.models.qwen2_5_omni.token2wav import Token2Wav

    model_dir = Path(model_dir)
    t2w = Token2Wav(token2wav_config(model_dir), torch.float32, "cpu")
    t2w.load_weights(iter_weights(safetensors_files(model_dir)))
    native = NativeLinearKernel() if not (bf16 or int8) and t2w.dit.stack_fits() else None
    if not t2w.dit.pack_for_onednn(torch.bfloat16 if bf16 else torch.float32, W8A8Kernel() if int8 else None,
                                   native):
        raise SystemExit("oneDNN's packed GEMMs are not available here (bf16: no bf16 dot products)")
    if not t2w.dit.use_native_attention():
        raise SystemExit("the window attention kernel does not build or fit here")
    if stack and (int8 or native) and not t2w.dit.use_native_stack():
        raise SystemExit("the DiT's native block stack does not build here")
    return t2w.eval(), next(iter(load_speakers(model_dir).values()))


def solve_seconds(t2w, speaker, streams: int) -> float:
    """One ODE solve of `streams` first chunks (each its own noise), timed."""
    from omnistage.models.qwen2_5_omni.token2wav import OdeSolve
    from omnistage.models.qwen2_5_omni.token2wav_stream import StreamConfig, Token2WavStream

    cfg = StreamConfig.for_dit(t2w.config.dit_config, t2w.vocoder.receptive_field())
    jobs = []
    for i in range(streams):
        s = Token2WavStream(t2w, speaker.cond, speaker.ref_mel, torch.Generator().manual_seed(i), cfg)
        s.feed([1 + i] * (cfg.chunk(0) + cfg.look_ahead))
        jobs.append(s.plan().job)
    with torch.inference_mode():
        solve = OdeSolve(t2w.dit, jobs, 10, -1.0)
        t0 = time.perf_counter()
        solve.advance()
        return time.perf_counter() - t0


def compare(t2w, speaker, streams: int, pairs: int) -> dict:
    from omnistage.models.qwen2_5_omni.token2wav_dit import Attention

    attns = [m for m in t2w.dit.modules() if isinstance(m, Attention)]
    kernel = attns[0].kernel

    def timed(native: bool) -> float:
        for a in attns:
            a.kernel = kernel if native else None
        return solve_seconds(t2w, speaker, streams)

    timed(True), timed(False)                                            # warm-up
    runs = [(timed(True), timed(False)) for _ in range(pairs)]
    for a in attns:
        a.kernel = kernel
    return pair_report(runs, "native", "sdpa")


def pair_report(runs: list[tuple[float, float]], a: str, b: str) -> dict:
    """Seconds of A B pairs: every pair, each side's median and the median of the per-pair
    speedups b / a."""
    return {"runs_s": [[round(x, 4), round(y, 4)] for x, y in runs],
            f"median_{a}_s": round(statistics.median(x for x, _ in runs), 4),
            f"median_{b}_s": round(statistics.median(y for _, y in runs), 4),
            "median_speedup": round(statistics.median(y / x for x, y in runs), 3)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Qwen2.5-Omni folder (default: the small tiny build)")
    p.add_argument("--streams", type=int, default=8, help="first chunks solved together")
    p.add_argument("--pairs", type=int, default=5, help="A B pairs (native, SDPA)")
    p.add_argument("--bf16", action="store_true", help="the DiT's GEMMs in packed bf16 (--token2wav-bf16)")
    args = p.parse_args(argv)
    if args.streams < 1 or args.pairs < 1:
        p.error("--streams and --pairs must be >= 1")
    from omnistage.entrypoints.model_source import tiny_checkpoint

    model = args.model or str(tiny_checkpoint("qwen2_5_omni", "small", 0, "float32"))
    cpu = cpu_description()
    print(cpu_line(cpu), file=sys.stderr)
    t2w, speaker = load(model, args.bf16, stack=False)      # the attention one call per layer
    report = {"model": model, "streams": args.streams, "bf16": args.bf16, "cpu": cpu,
              **compare(t2w, speaker, args.streams, args.pairs)}
    for i, (a, b) in enumerate(report["runs_s"]):
        print(f"pair {i}: native {a:.4f} s  sdpa {b:.4f} s  ({b / a:.2f}x)", file=sys.stderr)
    print(f"median: native {report['median_native_s']} s, sdpa {report['median_sdpa_s']} s, "
          f"speedup {report['median_speedup']}x", file=sys.stderr)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
