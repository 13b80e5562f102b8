"""Image serving throughput: omnistage's diffusion stage vs diffusers, side by side.

Workload: `--requests` concurrent text-to-image requests (different prompts and seeds),
`--size`² pixels, `--steps` steps, on a Qwen-Image-shaped checkpoint (default: the `small`
tiny-builder size: transformer ~77M, VAE ~10M, text encoder ~45M).

- diffusers: QwenImagePipeline.__call__ one request at a time (the peer).
- omnistage, caching off: all requests submitted at once to Omni.generate (denoising steps
  batched across requests); outputs compared with diffusers' (max abs on [0, 1] pixels).
- omnistage, step caches (teacache, fbcache at their default thresholds, or --cache-threshold):
  speedup over omnistage uncached, and PSNR of each cached image against the uncached image of
  the same seed (the worst request is reported).

Prints a table, then one JSON object (last line) with figures and ratios:
throughput_ratio (omnistage uncached images/s / diffusers images/s; target >= 1.3) and
cache_speedup per cache kind (target >= 2 at min PSNR >= 30 dB).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.machine import finish_report, other_load

PROMPTS = [
    "a red fox in fresh snow, golden hour", "a lighthouse on a cliff in a storm",
    "a bowl of ramen, top view", "an old tram on a rainy street at night",
    "a watercolor map of an island", "a robot reading a book in a library",
    "sunflowers in a blue vase", "a mountain lake with a wooden boat",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Qwen-Image folder (default: build --ckpt-size into the cache)")
    p.add_argument("--ckpt-size", default="small", help="tiny-builder size when --model is not given")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--size", type=int, default=256, help="image side in pixels")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--negative-prompt", default=None, help="enables true CFG (doubles the work)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--caches", default="teacache,fbcache", help="comma list; empty: skip")
    p.add_argument("--cache-threshold", type=float, default=None)
    p.add_argument("--max-batch", type=int, default=8, help="omnistage jobs per forward")
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--out-json", help="also write the final JSON object here")
    return p.parse_args(argv)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def run_diffusers(folder: str, args, prompts, seeds, load: dict) -> tuple[float, list[np.ndarray]]:
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=args.size, width=args.size, num_inference_steps=args.steps,
                negative_prompt=args.negative_prompt, output_type="np")
    pipe(prompts[0], generator=torch.Generator("cpu").manual_seed(0), **{**call, "num_inference_steps": 2})
    t0, images = time.perf_counter(), []
    with other_load(load):
        for prompt, seed in zip(prompts, seeds):
            images.append(pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), **call).images[0])
    return time.perf_counter() - t0, images


def run_omnistage(omni, args, prompts, seeds, cache=None, load=None) -> tuple[float, list[np.ndarray], int]:
    load = {} if load is None else load
    from omnistage.diffusion.params import DiffusionParams

    params = [DiffusionParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                              negative_prompt=args.negative_prompt, seed=s, cache=cache,
                              cache_threshold=args.cache_threshold if cache else None) for s in seeds]
    stage = omni.engine.graph.stages["diffusion"]
    hits0 = stage.cache_hits
    t0 = time.perf_counter()
    with other_load(load):
        outs = omni.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, [o.pixels[0] for o in outs], stage.cache_hits - hits0


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from omnistage import Omni
    from omnistage.diffusion.recipe import DiffusionSettings
    from omnistage.diffusion.stage import DiffusionStageSettings
    from omnistage.entrypoints.model_source import tiny_checkpoint

    folder = args.model or str(tiny_checkpoint("qwen_image", args.ckpt_size))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    seeds = list(range(100, 100 + args.requests))
    report: dict = {"model": folder, "requests": args.requests, "size": args.size, "steps": args.steps,
                    "cfg": args.negative_prompt is not None, "threads": torch.get_num_threads()}

    settings = DiffusionSettings(stage=DiffusionStageSettings(max_batch=args.max_batch))
    with Omni(folder, omni_settings=settings) as omni:
        run_omnistage(omni, argparse.Namespace(**{**vars(args), "steps": 2}), prompts[:1], seeds[:1])  # warm-up
        load: dict = {}
        wall, ours, _ = run_omnistage(omni, args, prompts, seeds, load=load)
        report["omnistage_other_cores"] = load.get("other_cores")
        # what the time goes to, per request: the stage's own counters
        stage = omni.engine.graph.stages["diffusion"]
        report["omnistage_stage_s"] = {k: round(v, 3) for k, v in stage.timings.items()}
        report["omnistage_s"] = round(wall, 3)
        report["omnistage_images_per_s"] = round(args.requests / wall, 4)
        caches = {}
        for kind in [c for c in args.caches.split(",") if c]:
            cwall, cimgs, hits = run_omnistage(omni, args, prompts, seeds, cache=kind)
            caches[kind] = {"wall_s": round(cwall, 3), "speedup": round(wall / cwall, 3),
                            "skipped_steps": hits, "steps": args.steps * args.requests,
                            "min_psnr_db": round(min(psnr(a, b) for a, b in zip(cimgs, ours)), 2)}
        report["caches"] = caches
    if not args.skip_diffusers:
        load = {}
        dwall, ref = run_diffusers(folder, args, prompts, seeds, load)
        report["diffusers_other_cores"] = load.get("other_cores")
        report["diffusers_s"] = round(dwall, 3)
        report["diffusers_images_per_s"] = round(args.requests / dwall, 4)
        report["max_abs_vs_diffusers"] = float(max(np.abs(a - b).max() for a, b in zip(ref, ours)))
        report["throughput_ratio"] = round(dwall / wall, 3)

    print(f"{'side':<24}{'wall s':>10}{'images/s':>10}")
    print(f"{'omnistage (no cache)':<24}{report['omnistage_s']:>10.2f}{report['omnistage_images_per_s']:>10.3f}")
    if "diffusers_s" in report:
        print(f"{'diffusers (1 at a time)':<24}{report['diffusers_s']:>10.2f}{report['diffusers_images_per_s']:>10.3f}")
        print(f"throughput ratio {report['throughput_ratio']} (target >= 1.3); "
              f"max abs vs diffusers {report['max_abs_vs_diffusers']:.2e}")
    for kind, c in report["caches"].items():
        print(f"{kind}: {c['wall_s']:.2f} s, speedup {c['speedup']}x (target >= 2), min PSNR {c['min_psnr_db']} dB")
    print("other cores busy meanwhile (0 = a quiet machine):",
          report.get("omnistage_other_cores"), "/", report.get("diffusers_other_cores"))
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
