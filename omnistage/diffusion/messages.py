"""What crosses the diffusion stage's edges (msgspec Structs: they travel to stage processes;
every payload names its request)."""

from __future__ import annotations

import msgspec
import numpy as np

from omnistage.diffusion.params import DiffusionParams


class DiffusionRequest(msgspec.Struct):
    """A whole image/video request, as the stage receives it."""

    request_id: str
    prompt: str
    params: DiffusionParams            # resolved: every default filled in, seed chosen
    images: list[np.ndarray] = []      # input images, uint8 (H, W, 3) RGB (edit / image-to-video)
    mask: np.ndarray | None = None     # uint8 (H, W): where an edit may change the image


class DiffusionProgress(msgspec.Struct):
    """Denoising progress of a request (steps of its slowest sample)."""

    request_id: str
    step: int
    total: int


class DiffusionPreview(msgspec.Struct):
    """A partial image: sample `index`'s prediction of its final pixels after `step` steps,
    float32 (H, W, 3) or (L, H, W, 4) in [0, 1]; `order` counts the sample's previews from 0."""

    request_id: str
    index: int
    order: int
    step: int
    pixels: np.ndarray


class DiffusionResult(msgspec.Struct):
    """The finished outputs, one per sample: float32 pixels in [0, 1]; (H, W, 3) images,
    (F, H, W, 3) videos or (L, H, W, 4) RGBA layer stacks (layered models)."""

    request_id: str
    outputs: list[np.ndarray]
    seed: int
