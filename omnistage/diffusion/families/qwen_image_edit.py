"""Qwen-Image-Edit (one input image, diffusers' QwenImageEditPipeline) and Qwen-Image-Edit-2509
"Plus" (one or more input images, QwenImageEditPlusPipeline) on the diffusion stage.

Both reuse QwenImageFamily's denoising (prepare / predict / decode): the input images' packed
VAE latents ride in `QwenCond.image_latents`, appended after the output tokens of every
forward, `img_shapes` lists the output then each input image, and the prediction is cut back
to the output tokens. What differs from text-to-image is the conditioning, reproduced from the
pipelines' __call__:
  - the prompt goes through the Qwen2.5-VL processor WITH the image(s) (vision tokens inside
    the template), and the first 64 template tokens are dropped;
  - each image is resized to ~1024x1024 pixels at its aspect ratio (`calculate_dimensions`),
    VAE-encoded (distribution mode), normalised by the VAE's latents mean/std and packed;
  - the output size defaults to that ~1024x1024 size of the (edit: first, plus: last) image.
Plus differs from Edit in the template ("Picture i: <vision tokens>" per image, before the
prompt) and in showing the text encoder each image resized to ~384x384 instead of the VAE size.

Inpainting masks are not supported: these two pipelines take no mask (diffusers has a separate
QwenImageEditInpaintPipeline, which blends latents after every scheduler step).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import torch
from PIL import Image

from omnistage.diffusion.families.qwen_image import QwenImageFamily
from omnistage.diffusion.families.qwen_image_common import QwenCond, pack
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InvalidRequestError, ModelLoadError

_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
           "objects, background), then explain how the user's text instruction should alter or modify the "
           "image. Generate a new image that meets the user's requirements while maintaining consistency "
           "with the original input where appropriate.<|im_end|>\n")
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
EDIT_TEMPLATE = _SYSTEM + "<|im_start|>user\n" + VISION + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = _SYSTEM + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_PICTURE = "Picture {}: " + VISION           # one per input image, before the prompt
EDIT_TEMPLATE_DROP = 64      # template tokens dropped from the embeddings (pipeline constant)
VAE_AREA = 1024 * 1024       # pixels of each VAE-encoded input image (and the default output)
CONDITION_AREA = 384 * 384   # Plus: pixels of each image the text encoder sees


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height), multiples of 32, of about `target_area` pixels at width/height `ratio`
    (the pipelines' rounding: height from the unrounded width)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass
class EditInputs:
    """A request's input images, prepared as the pipeline prepares them."""

    prompt_images: list[Image.Image]     # what the VL text encoder sees (PIL, resized)
    vae_sources: list[Image.Image]       # what VaeImageProcessor.preprocess gets, per image
    vae_sizes: list[tuple[int, int]]     # (height, width) pixels each is VAE-encoded at
    size: tuple[int, int]                # (height, width) pixels: the default output size


@dataclass
class LatentCache:
    """Packed VAE latents of the last `capacity` input images, keyed by the image's content
    and its VAE size. The VAE encode of a ~1024x1024 image is the costliest part of admitting
    an edit request; clients often send one image with several prompts, or retry."""

    capacity: int = 8
    _items: OrderedDict = field(default_factory=OrderedDict)

    @staticmethod
    def key(image: np.ndarray, size: tuple[int, int]) -> tuple:
        digest = hashlib.blake2b(np.ascontiguousarray(image).data, digest_size=16).digest()
        return digest, image.shape, size

    def get(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = compute()
        if self.capacity > 0:
            self._items[key] = value
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value


class QwenImageEditFamily(QwenImageFamily):
    """QwenImageEditPipeline: exactly one input image."""

    name = "qwen_image_edit"
    max_images = 1
    size_source = 0        # the input image whose aspect ratio sets the default output size
    takes_strength = False  # the edit pipelines have no strength

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        super().__init__(folder, device, dtype)
        if self.processor is None:
            raise ModelLoadError(f"{folder}: an edit pipeline needs a 'processor' component (the "
                                 "Qwen2.5-VL processor that reads the input image)")
        from diffusers.image_processor import VaeImageProcessor

        # the pipeline's own resize/normalise (PIL lanczos, [-1, 1]), for bit-equal VAE inputs
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.multiple)
        self.latent_cache = LatentCache()

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        num_images = len(prompt.images)
        if num_images == 0:
            raise InvalidRequestError("this edit model needs an input image: pass the image to edit as "
                                      "the prompt's 'image'", param="image")
        if num_images > self.max_images:
            more = ("; use a Qwen-Image-Edit-2509 (Edit Plus) model for several images"
                    if self.max_images == 1 else "")
            raise InvalidRequestError(f"this edit model takes at most {self.max_images} input image(s), "
                                      f"got {num_images}{more}", param="image")
        if prompt.mask is not None:
            raise InvalidRequestError(f"{self.name} models take no mask (inpainting is not supported); "
                                      "leave 'mask' out: the instruction edits the whole image", param="mask")
        for name in ("height", "width"):
            v = getattr(params, name)
            if v is not None and v % self.multiple:
                raise InvalidRequestError(f"{name} {v} must be a multiple of {self.multiple} for this "
                                          "model (or leave it out to follow the input image)", param="size")
        # height/width left out follow the input image, as in the pipelines (so limits apply)
        source = prompt.images[self.size_source]
        width, height = calculate_dimensions(VAE_AREA, source.shape[1] / source.shape[0])
        return msgspec.structs.replace(
            params, height=params.height or height, width=params.width or width,
            num_inference_steps=params.num_inference_steps or self.default_steps,
            true_cfg_scale=self.default_true_cfg if params.true_cfg_scale is None else params.true_cfg_scale)

    # ---- 1. encode prompt and images --------------------------------------------------------
    def encode(self, request: DiffusionRequest) -> QwenCond:
        p = request.params
        # uint8 (H, W, 3) arrays -> RGB PIL images, what a diffusers user passes
        inputs = self.prepare_images([Image.fromarray(a) for a in request.images])
        h = (p.height or inputs.size[0]) // self.multiple
        w = (p.width or inputs.size[1]) // self.multiple
        cfg = p.true_cfg_scale > 1 and p.negative_prompt is not None
        embeds = self._embed_with_images(request.prompt, inputs.prompt_images)
        neg = self._embed_with_images(p.negative_prompt, inputs.prompt_images) if cfg else None
        latents = [self.latent_cache.get(LatentCache.key(array, size),
                                         lambda src=src, size=size: self._encode_image(src, size))
                   for array, src, size in zip(request.images, inputs.vae_sources, inputs.vae_sizes)]
        shapes = [(1, vh // self.multiple, vw // self.multiple) for vh, vw in inputs.vae_sizes]
        return QwenCond(embeds, neg, p.true_cfg_scale, ((1, h, w), *shapes),
                        image_latents=torch.cat(latents, dim=1))             # (1, sum L_i, 4C)

    def prepare_images(self, images: list[Image.Image]) -> EditInputs:
        """Edit: the image at ~1024x1024 is both the VL processor's and the VAE's input."""
        image = images[0]
        width, height = calculate_dimensions(VAE_AREA, image.size[0] / image.size[1])
        self._check_size(height, width)
        resized = self.image_processor.resize(image, height, width)
        return EditInputs([resized], [resized], [(height, width)], (height, width))

    def _check_size(self, height: int, width: int) -> None:
        if height < 32 or width < 32:
            raise InvalidRequestError("an input image's aspect ratio is too extreme for this model "
                                      "(its shorter side would scale below 32 pixels); crop it",
                                      param="image")

    def prompt_text(self, prompt: str, num_images: int) -> str:
        return EDIT_TEMPLATE.format(prompt)

    def _embed_with_images(self, prompt: str, images: list[Image.Image]) -> torch.Tensor:
        """(T, D): the VL text encoder's last hidden states over template + vision tokens +
        prompt, the first 64 template tokens dropped (no truncation, as the pipelines)."""
        inputs = self.processor(text=[self.prompt_text(prompt, len(images))], images=images, padding=True,
                                return_tensors="pt").to(self.device)
        out = self.text_encoder.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                      pixel_values=inputs.get("pixel_values"),
                                      image_grid_thw=inputs.get("image_grid_thw"), output_hidden_states=True)
        return out.hidden_states[-1][0, EDIT_TEMPLATE_DROP:].to(self.dtype)

    def _encode_image(self, image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
        """-> (1, H/16 * W/16, 4C): the image resized to size = (H, W), VAE-encoded (mode),
        normalised and packed."""
        x = self.image_processor.preprocess(image, *size).unsqueeze(2)              # (1, 3, 1, H, W) in [-1, 1]
        lat = self.vae.encode(x.to(self.device, self.dtype)).latent_dist.mode()     # (1, C, 1, H/8, W/8)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        return pack(((lat - mean) / std)[:, :, 0])


class QwenImageEditPlusFamily(QwenImageEditFamily):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509): one or more input images, each
    VAE-encoded at ~1024x1024 and shown to the text encoder at ~384x384."""

    name = "qwen_image_edit_plus"
    max_images = 16   # (the pipeline has no limit; the server's max_input_images applies first)
    size_source = -1  # the last image sets the default output size

    def prepare_images(self, images: list[Image.Image]) -> EditInputs:
        prompt_images, vae_sizes = [], []
        for image in images:
            ratio = image.size[0] / image.size[1]
            cw, ch = calculate_dimensions(CONDITION_AREA, ratio)
            vw, vh = calculate_dimensions(VAE_AREA, ratio)
            self._check_size(ch, cw)
            prompt_images.append(self.image_processor.resize(image, ch, cw))
            vae_sizes.append((vh, vw))
        # the VAE reads the original images; the last one sets the default output size
        return EditInputs(prompt_images, list(images), vae_sizes, vae_sizes[-1])

    def prompt_text(self, prompt: str, num_images: int) -> str:
        pictures = "".join(PLUS_PICTURE.format(i + 1) for i in range(num_images))
        return PLUS_TEMPLATE.format(pictures + prompt)
