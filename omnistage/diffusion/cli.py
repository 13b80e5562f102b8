"""`omnistage generate` for image and video models: flags and the run (progress bar, files)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("image and video models (generate)")
    g.add_argument("--out", default=None, metavar="PATH",
                   help="image/video models: file to write: .png/.jpg/.webp for images (n > 1 adds "
                        "-1, -2, ... before the suffix), .mp4 for videos (default: out.png / out.mp4)")
    g.add_argument("--size", default=None, metavar="WxH", help="output size (default: the model's)")
    g.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    g.add_argument("--negative-prompt", default=None, help="what to steer away from (enables CFG "
                   "for Qwen-Image; default: none)")
    g.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (Z-Image, Wan)")
    g.add_argument("--true-cfg-scale", type=float, default=None, help="Qwen-Image's CFG scale")
    g.add_argument("--n", type=int, default=1, help="images per prompt (default: 1)")
    g.add_argument("--num-frames", type=int, default=None, help="video models: frames (default: the model's)")
    g.add_argument("--fps", type=int, default=16, help="video models: MP4 frame rate (default: 16)")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="input image (edit models, image-to-video); repeat for several")
    g.add_argument("--mask", default=None, metavar="FILE", help="inpainting mask (white = repaint)")
    g.add_argument("--cache", default=None, choices=["none", "teacache", "fbcache"],
                   help="step cache (default: none)")


def run_generate(args: argparse.Namespace, omni) -> int:
    """Generate with `omni` (a diffusion model) and write the file(s); returns the exit code."""
    import numpy as np

    from omnistage.diffusion.params import DiffusionParams
    from omnistage.errors import InvalidRequestError

    width = height = None
    if args.size:
        try:
            width, height = (int(v) for v in args.size.lower().split("x"))
        except ValueError:
            raise InvalidRequestError(f"--size must be WxH, e.g. 512x512, got {args.size!r}",
                                      param="size") from None
    params = DiffusionParams(negative_prompt=args.negative_prompt, height=height, width=width,
                             num_frames=args.num_frames, num_inference_steps=args.steps,
                             guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale,
                             seed=args.sampling_seed, n=args.n, cache=args.cache, fps=args.fps)
    prompt: object = args.prompt
    if args.image or args.mask:
        prompt = {"prompt": args.prompt, "image": [Path(f).read_bytes() for f in args.image]}
        if args.mask:
            from PIL import Image

            with Image.open(args.mask) as m:
                prompt["mask"] = np.asarray(m.convert("RGB"))
    out = omni.generate(prompt, params, use_tqdm=True)[0]
    video = omni.engine.abilities.generates == "video"
    target = Path(args.out or ("out.mp4" if video else "out.png"))
    count = len(out.pixels) if video else len(out.images)   # layered models: every layer
    paths = [target] if count == 1 else [
        target.with_name(f"{target.stem}-{i + 1}{target.suffix}") for i in range(count)]
    for i, path in enumerate(paths):
        if video:
            path.write_bytes(out.mp4(i))
        else:
            out.images[i].save(path)
        print(f"wrote {path}", file=sys.stderr)
    print(f"seed {out.seed}", file=sys.stderr)
    return 0
