"""DiffusionPipeline: the engine (omnistage.engine_api) behind Omni / AsyncOmni / the server for
diffusers-format folders. It checks and resolves a request (defaults, size multiples, seed),
then runs it on a one-stage StageGraph (`recipe.py`), which a deploy config may place in
another process."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from omnistage.config import EngineConfig
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.recipe import RECIPE, DiffusionSettings, build_family, pipeline_class
from omnistage.engine_api import EngineAbilities, OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.graph_pipeline import GraphPipeline

log = logging.getLogger(__name__)


@dataclass
class DiffusionPrompt:
    """A checked prompt: text plus decoded input images: uint8 (H, W, 3) RGB, or (H, W, 4) RGBA
    for families with `input_channels = 4` (Qwen-Image-Layered)."""

    text: str
    images: list[np.ndarray] = field(default_factory=list)
    mask: np.ndarray | None = None
    token_ids: list[int] = field(default_factory=list)   # (the text APIs' field; empty here)


class DiffusionPipeline(GraphPipeline):
    recipe = RECIPE
    tokenizer = None

    def __init__(self, config: EngineConfig, settings: DiffusionSettings | None = None, placement=None):
        self.pipeline_class = pipeline_class(config.model)
        super().__init__(config, settings, placement)
        self.family = _local_family(self.graph.stages.values()) or _light_family(config)
        lim = self.settings.limits
        self.abilities = EngineAbilities(generates="video" if self.family.is_video else "image",
                                         max_input_pixels=lim.max_input_pixels, max_frames=lim.max_frames)
        log.info("%s ready (%s)", self.pipeline_class, Path(config.model).name)

    # ---- requests -------------------------------------------------------------------------
    def prepare(self, prompt: Any, opts: OutputOptions | None = None) -> DiffusionPrompt:
        """A string, or {"prompt": str, "image": one or a list of PIL images / uint8 arrays /
        encoded bytes, "mask": the same}.

        Family attributes read here: `input_channels` (default 3; 4 keeps an alpha channel:
        RGB inputs get an opaque one, as PIL's convert("RGBA")) and `captions_blank_prompt`
        (default False; True lets a blank prompt through: the family captions the image)."""
        channels = self.family.input_channels
        if isinstance(prompt, str):
            text, images, mask = prompt, [], None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "image", "images", "mask"}
            if unknown:
                raise InvalidRequestError(f"unknown prompt keys {sorted(unknown)}; use prompt, image, mask",
                                          param="prompt")
            text = prompt.get("prompt")
            raw = prompt.get("image", prompt.get("images"))
            raw = [] if raw is None else raw if isinstance(raw, (list, tuple)) else [raw]
            images = [self._image(x, "image", channels) for x in raw]
            mask = self._mask(prompt["mask"]) if prompt.get("mask") is not None else None
        else:
            raise InvalidRequestError(f"an image prompt is a string or a dict, got {type(prompt).__name__}",
                                      param="prompt")
        blank_ok = self.family.captions_blank_prompt
        if not isinstance(text, str) or not (text.strip() or blank_ok):
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        lim = self.settings.limits
        if len(images) > lim.max_input_images:
            raise InvalidRequestError(f"at most {lim.max_input_images} input images per request, "
                                      f"got {len(images)}", param="image")
        if mask is not None and (not images or mask.shape != images[0].shape[:2]):
            raise InvalidRequestError("mask must have the size of the (first) input image", param="mask")
        return DiffusionPrompt(text, images, mask)

    def _mask(self, x) -> np.ndarray:
        """-> uint8 (H, W), 255 = may change: a uint8 (H, W) array, or any image form (its
        first channel)."""
        if isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype == np.uint8:
            return np.ascontiguousarray(x)
        return self._image(x, "mask")[..., 0]

    def _image(self, x, param: str, channels: int = 3) -> np.ndarray:
        """-> uint8 (H, W, channels): 3 = RGB, 4 = RGBA."""
        from omnistage.media.image import decode_image

        if isinstance(x, (bytes, bytearray, memoryview)):
            rgb = decode_image(x, max_pixels=self.settings.limits.max_input_pixels, param=param)
            # decode_image checked the bytes (format, size, integrity) but composites alpha
            # onto white; an RGBA family needs the alpha itself, so read the checked bytes again
            x = rgb if channels == 3 else _decode_rgba(x)
        if isinstance(x, Image.Image):
            x = np.asarray(x.convert("RGB" if channels == 3 else "RGBA"))
        shapes = "(H, W, 3)" if channels == 3 else "(H, W, 3) or (H, W, 4)"
        if not (isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 3
                and x.shape[2] in ((3,) if channels == 3 else (3, 4))):
            raise InvalidRequestError(f"{param} must be a PIL image, encoded image bytes or a uint8 "
                                      f"{shapes} array", param=param)
        if x.shape[2] < channels:
            x = np.concatenate([x, np.full((*x.shape[:2], 1), 255, np.uint8)], axis=2)   # opaque
        if x.shape[0] * x.shape[1] > self.settings.limits.max_input_pixels:
            raise InvalidRequestError(f"{param} has more than {self.settings.limits.max_input_pixels} pixels",
                                      param=param)
        return np.ascontiguousarray(x)

    def resolve(self, prompt: DiffusionPrompt, params: DiffusionParams | None) -> DiffusionParams:
        """Defaults filled, limits checked, seed chosen: what the request will run with."""
        params = params or DiffusionParams()
        if not isinstance(params, DiffusionParams):
            raise InvalidRequestError("image and video models take DiffusionParams, not "
                                      f"{type(params).__name__}", param="sampling_params")
        params.check(self.settings.limits)
        if params.strength is not None and not (prompt.images and self.family.takes_strength):
            # strength says how much of an input image to redo: only image-to-image / inpainting
            # families read it; anywhere else it would be ignored silently
            raise InvalidRequestError("strength applies to image-to-image and inpainting (an input "
                                      "image to a Qwen-Image model): leave strength out", param="strength")
        if params.cache not in (None, "none") and not self.family.supports_cache:
            # (the server default cache, applied below, is skipped quietly for such models)
            raise InvalidRequestError("this model has no step cache; leave cache out or use 'none'",
                                      param="cache")
        if params.partial_images and self.family.is_video:
            raise InvalidRequestError("partial_images applies to image models only",
                                      param="partial_images")
        if params.num_frames is not None and not self.family.is_video:
            raise InvalidRequestError("num_frames applies to video models only", param="num_frames")
        if (params.layers is not None or params.resolution is not None) and not self.family.takes_layers:
            raise InvalidRequestError("layers and resolution apply to layered (Qwen-Image-Layered) "
                                      "models only", param="layers" if params.layers is not None else "resolution")
        params = self.family.resolve(params, prompt)
        params.check(self.settings.limits)          # again, with the model's defaults
        updates = {}
        if params.seed is None:
            updates["seed"] = secrets.randbelow(2**63)
        if params.cache is None:
            updates["cache"] = (self.settings.default_cache if self.family.supports_cache
                                else "none")
        return msgspec.structs.replace(params, **updates) if updates else params

    def default_params(self) -> DiffusionParams:
        return DiffusionParams()

    def add_request(self, request_id: str, prompt: DiffusionPrompt, params: DiffusionParams | None,
                    opts: OutputOptions | None = None, return_hidden_states: bool = False) -> None:
        resolved = self.resolve(prompt, params)       # (no hidden states: not a text model)
        self.graph.add_request(request_id, DiffusionRequest(request_id, prompt.text, resolved,
                                                            prompt.images, prompt.mask))

    def num_waiting_requests(self) -> int:
        return max(0, len(self.graph.requests) - self.settings.stage.max_batch)


def _decode_rgba(data) -> Image.Image:
    """Bytes that decode_image already accepted -> an RGBA PIL image (alpha kept)."""
    import io

    from omnistage.media.image import IMAGE_FORMATS

    with Image.open(io.BytesIO(bytes(data)), formats=IMAGE_FORMATS) as img:
        img.load()
        return img.convert("RGBA")


def _local_family(stages):
    from omnistage.diffusion.stage import DiffusionStage

    for s in stages:
        if isinstance(s, DiffusionStage):
            return s.family
    return None


def _light_family(config: EngineConfig):
    """The stage runs elsewhere: this process still resolves requests (sizes, defaults), which
    needs the components' configs but not their weights: build them on the meta device."""
    return build_family(config, torch.device("meta"))
