"""Images and video frames -> flattened patches for the Qwen2.5-Omni vision tower.

The maths of transformers' Qwen2-VL processors (which Qwen2.5-Omni uses):
1. smart_resize: both sides a multiple of patch*merge (28), pixel count in
   [min_pixels, max_pixels], aspect ratio kept as closely as rounding allows.
2. bicubic resize; x / 255; (x - mean) / std with OpenAI CLIP's mean and std.
3. patches of (C, temporal_patch_size, patch, patch), ordered so the merge x merge patches that
   the tower's merger fuses into one LLM token are consecutive: rows are
   (t, h_block, w_block, h_in_block, w_in_block). An image is its own frame repeated
   temporal_patch_size times; a video with a frame count that is not a multiple of it repeats
   its last frame.

Images resize with PIL (as `Qwen2VLImageProcessorPil`). Video frames resize with torch's
antialiased uint8 bicubic on the CPU, which is exactly what `Qwen2VLVideoProcessor` runs there
(torchvision's resize of a uint8 tensor on CPU calls that kernel); it is within one grey level
of PIL's. Preprocessing is host work: tensors are made on the CPU, and the encoder moves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from omnistage.errors import InvalidRequestError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Defaults: Qwen2.5-Omni's preprocessor_config.json and its processor's video size."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56                  # images
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28      # per video frame
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, ...] = field(default=OPENAI_CLIP_MEAN)
    image_std: tuple[float, ...] = field(default=OPENAI_CLIP_STD)

    def __post_init__(self):
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError("patch_size, temporal_patch_size and merge_size must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, "
                             f"{self.max_pixels}")
        if not 0 < self.video_min_pixels <= self.video_max_pixels:
            raise ValueError("need 0 < video_min_pixels <= video_max_pixels")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")

    @property
    def factor(self) -> int:
        """Side multiple of resized images: one merge block of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, cfg: dict) -> "VisionPreprocessConfig":
        """From a preprocessor_config.json (min/max_pixels or size.shortest/longest_edge)."""
        size = cfg.get("size") or {}
        kw = {k: cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in cfg}
        kw["min_pixels"] = cfg.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        kw["max_pixels"] = cfg.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        for k in ("image_mean", "image_std"):
            if k in cfg:
                kw[k] = tuple(float(v) for v in cfg[k])
        return cls(**kw)


@dataclass
class VisionPatches:
    """One image or video, ready for the vision tower."""
    pixel_values: torch.Tensor          # (t*h*w, C*temporal_patch_size*patch*patch) float32
    grid_thw: tuple[int, int, int]      # patch grid: frames/temporal_patch_size, rows, columns
    second_per_grid: float | None = None  # video only: seconds of video per temporal patch

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 param: str = "image") -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with a pixel count in range."""
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"{param} has an empty size {width}x{height}", param=param)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(f"{param} is {width}x{height}, an aspect ratio over "
                                  f"{MAX_ASPECT_RATIO}:1; crop or pad it", param=param)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def preprocess_image(image: Image.Image, cfg: VisionPreprocessConfig = VisionPreprocessConfig(),
                     param: str = "image") -> VisionPatches:
    """An RGB PIL image (see omnistage.media.image.decode_image) -> patches, grid (1, h, w)."""
    if image.mode != "RGB":
        raise ValueError(f"preprocess_image needs an RGB image, got mode {image.mode!r}; "
                         "decode it with omnistage.media.image.decode_image")
    h, w = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels,
                        param)
    resized = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.array(resized)).permute(2, 0, 1)[None]   # (1, 3, h, w) uint8
    return _patchify(_normalize(pixels, cfg), cfg)


def preprocess_video(frames: np.ndarray, fps: float,
                     cfg: VisionPreprocessConfig = VisionPreprocessConfig(),
                     param: str = "video") -> VisionPatches:
    """Sampled frames (T, H, W, 3) uint8 -> patches, grid (ceil(T/tps), h, w), seconds/grid.

    `fps` is the rate the frames were sampled at (DecodedVideo.fps): second_per_grid is
    temporal_patch_size / fps. HF's Qwen2.5-Omni processor uses its requested fps (2.0 unless
    passed), which equals DecodedVideo.fps except for short or long videos whose frame count
    was clamped to min/max frames.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames must be (T, H, W, 3) uint8 with T >= 1, got {frames.shape} "
                         f"{frames.dtype}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    h, w = smart_resize(frames.shape[1], frames.shape[2], cfg.factor, cfg.video_min_pixels,
                        cfg.video_max_pixels, param)
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W)
    if video.shape[-2:] != (h, w):
        # The uint8 kernel rounds and saturates as torchvision's CPU resize does.
        video = F.interpolate(video, size=(h, w), mode="bicubic", align_corners=False,
                              antialias=True)
    patches = _patchify(_normalize(video, cfg), cfg)
    patches.second_per_grid = cfg.temporal_patch_size / fps
    return patches


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """LLM placeholder tokens for one image/video: the merger fuses merge x merge patches."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def _normalize(pixels: torch.Tensor, cfg: VisionPreprocessConfig) -> torch.Tensor:
    """(T, 3, H, W) uint8 -> float32 (x / 255 - mean) / std, rounded as HF's numpy path is:
    the rescale in float64, then float32."""
    x = (pixels.to(torch.float64) * (1 / 255)).to(torch.float32)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std


def _patchify(video: torch.Tensor, cfg: VisionPreprocessConfig) -> VisionPatches:
    """(T, C, H, W) float32 -> (grid_t*grid_h*grid_w, C*tps*p*p) rows in merge-block order."""
    tps, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -video.shape[0] % tps:         # an image (T=1) becomes tps copies of itself
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    T, C, H, W = video.shape
    gt, gh, gw = T // tps, H // p, W // p
    x = video.reshape(gt, tps, C, gh // m, m, p, gw // m, m, p)
    # -> (gt, h_block, w_block, h_in, w_in, C, tps, p_row, p_col)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = x.reshape(gt * gh * gw, C * tps * p * p).contiguous()
    return VisionPatches(pixel_values=rows, grid_thw=(gt, gh, gw))
