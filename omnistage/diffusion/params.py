"""What one image/video request asks for, and the limits a server puts on it.

`DiffusionParams` plays the role SamplingParams plays for text: `Omni.generate(prompt,
DiffusionParams(...))`. Fields left None take the model's defaults (the family fills them in
`resolve`); `check` turns every client mistake into an InvalidRequestError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omnistage.errors import InvalidRequestError

CACHE_KINDS = ("none", "teacache", "fbcache")


class DiffusionParams(msgspec.Struct, kw_only=True):
    negative_prompt: str | None = None
    height: int | None = None             # pixels; None: the model's default size
    width: int | None = None
    num_frames: int | None = None         # video models only
    num_inference_steps: int | None = None
    guidance_scale: float | None = None   # CFG (Z-Image, Wan) or distilled guidance input
    true_cfg_scale: float | None = None   # Qwen-Image's true CFG (with a negative prompt)
    guidance_scale_2: float | None = None  # Wan2.2: CFG of the low-noise expert; None: the model's
    seed: int | None = None               # None: a random seed, reported back
    n: int = 1                            # images per prompt (share the prompt, not the noise)
    cache: str | None = None              # step cache: "none" | "teacache" | "fbcache"; None: server default
    cache_threshold: float | None = None  # the cache's threshold; None: its default
    fps: int = 16                         # video output frame rate (MP4 container)
    layers: int | None = None             # layered models: RGBA layers to split the image into
    resolution: int | None = None         # layered models: size bucket (the output is ~resolution^2 pixels)
    strength: float | None = None         # image-to-image / inpainting: how much of the input to redo
                                          # (1: from pure noise); None: the model's default
    partial_images: int = 0               # image models, streamed: previews decoded while denoising (0-3)

    def check(self, limits: "DiffusionLimits") -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param=param)

        if not 1 <= self.n <= limits.max_n:
            bad(f"n must be between 1 and {limits.max_n}, got {self.n}", "n")
        steps = self.num_inference_steps
        if steps is not None and not 1 <= steps <= limits.max_steps:
            bad(f"num_inference_steps must be between 1 and {limits.max_steps}, got {steps}",
                "num_inference_steps")
        for name in ("height", "width"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                bad(f"{name} must be a positive number of pixels, got {v}", "size")
        if self.height and self.width and self.height * self.width > limits.max_pixels:
            bad(f"{self.width}x{self.height} is more than the server's limit of "
                f"{limits.max_pixels} pixels per image; ask for a smaller size", "size")
        if self.num_frames is not None and not 1 <= self.num_frames <= limits.max_frames:
            bad(f"num_frames must be between 1 and {limits.max_frames}, got {self.num_frames}",
                "num_frames")
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 100:
                bad(f"{name} must be between 0 and 100, got {v}", name)
        if self.cache is not None and self.cache not in CACHE_KINDS:
            bad(f"cache must be one of {list(CACHE_KINDS)}, got {self.cache!r}", "cache")
        if self.cache_threshold is not None and not 0 <= self.cache_threshold <= 10:
            bad(f"cache_threshold must be between 0 and 10, got {self.cache_threshold}",
                "cache_threshold")
        if not 0 <= self.partial_images <= 3:
            bad(f"partial_images must be between 0 and 3, got {self.partial_images}", "partial_images")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad(f"seed must be between 0 and 2**63-1, got {self.seed}", "seed")
        if not 1 <= self.fps <= 120:
            bad(f"fps must be between 1 and 120, got {self.fps}", "fps")
        if self.layers is not None and not 1 <= self.layers <= limits.max_layers:
            bad(f"layers must be between 1 and {limits.max_layers}, got {self.layers}", "layers")
        if self.strength is not None and not 0 < self.strength <= 1:
            bad(f"strength must be more than 0 and at most 1, got {self.strength}", "strength")
        # (which resolutions a model takes is the family's rule: Qwen-Image-Layered 640 or 1024)
        if self.resolution is not None and not 1 <= self.resolution <= 4096:
            bad(f"resolution must be a positive number of pixels up to 4096, got {self.resolution}",
                "resolution")


@dataclass(frozen=True)
class DiffusionLimits:
    """Per-request bounds (server flags); requests above them get a 400."""

    # height * width of one output image / frame: covers Qwen-Image's native sizes (1328x1328,
    # 1664x928) and edits of ~1024x1024 at any aspect ratio
    max_pixels: int = 2048 * 1024
    max_n: int = 4                     # images per request
    max_steps: int = 100               # denoising steps
    max_frames: int = 81               # video frames
    max_input_images: int = 4          # edit inputs
    max_input_pixels: int = 4096 * 4096  # each uploaded image, checked while decoding
    max_layers: int = 10               # layered models: output layers per sample (each costs a frame)

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_n", "max_steps", "max_frames", "max_input_images",
                     "max_input_pixels", "max_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"DiffusionLimits.{name} must be >= 1")


def preview_steps(num_steps: int, partial_images: int) -> tuple[int, ...]:
    """After which denoising steps a job's previews are decoded: round(k * N / (P + 1)) for
    k = 1..P, those strictly inside (0, N), each once (few steps give fewer previews: OpenAI's
    contract lets the final image come before all partial images)."""
    steps = {round(k * num_steps / (partial_images + 1)) for k in range(1, partial_images + 1)}
    return tuple(sorted(s for s in steps if 0 < s < num_steps))
