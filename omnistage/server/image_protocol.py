"""Request bodies of the image and video endpoints (OpenAI's field names, plus extensions named
as DiffusionParams' fields), their mapping to DiffusionParams, and the encoding of results.

Multipart forms arrive as strings; the same pydantic models validate them (lax mode turns "4"
into 4), through `validated`, which reports a bad field as InvalidRequestError(param=field).
"""

from __future__ import annotations

import base64
import io
import re
from typing import Annotated, Literal

import numpy as np
from PIL import Image
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator,
                      ValidationError)

from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InvalidRequestError
from omnistage.outputs import to_uint8

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")
MASK_FORMATS = ("PNG", "WEBP")      # formats that carry the alpha channel OpenAI's masks use


def _not_bool(value):
    """JSON true/false are not numbers: pydantic's lax mode (needed for multipart's strings)
    would read them as 1 / 0, so that `"n": true` asked for one image."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


def _bool(value) -> bool:
    """A JSON boolean, or multipart's 'true' / 'false'; not 1, 'yes' or 'on' (lax mode's)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError("must be true or false")


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = Annotated[bool, PlainValidator(_bool)]


class DiffusionFields(BaseModel):
    """Extensions shared by every endpoint (OpenAI SDK: extra_body={...})."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None                      # None: the served model
    prompt: str = Field(max_length=32000)         # blank: the engine decides (some models caption)
    negative_prompt: str | None = Field(None, max_length=32000)
    num_inference_steps: Int | None = None
    guidance_scale: Float | None = Field(None, allow_inf_nan=False)
    true_cfg_scale: Float | None = Field(None, allow_inf_nan=False)
    guidance_scale_2: Float | None = Field(None, allow_inf_nan=False)   # Wan2.2's low-noise expert
    strength: Float | None = Field(None, allow_inf_nan=False)  # image-to-image / inpainting
    seed: Int | None = None
    cache: Literal["none", "teacache", "fbcache"] | None = None
    cache_threshold: Float | None = Field(None, allow_inf_nan=False)


class ImageRequest(DiffusionFields):
    """/v1/images/generations (JSON) and /v1/images/edits (multipart form fields)."""
    n: Int = 1
    size: str | None = "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: Int | None = Field(None, ge=0, le=100)
    # A hint OpenAI's models follow; ours give what the model makes (RGB: opaque, layered
    # models: RGBA), and the response's `background` says which.
    background: Literal["transparent", "opaque", "auto"] | None = None
    stream: Bool = False                          # multipart sends 'true' / 'false'
    partial_images: Int | None = Field(None, ge=0, le=3)

    def check_output(self) -> None:
        if self.response_format == "url":
            raise InvalidRequestError("response_format 'url' is not offered: this server keeps no "
                                      "files; use 'b64_json' (the default)", param="response_format")
        if self.output_compression is not None and self.output_format == "png":
            raise InvalidRequestError("output_compression applies to jpeg and webp only; drop it "
                                      "or set output_format", param="output_compression")

    def params(self) -> DiffusionParams:
        width, height = parse_size(self.size)
        return DiffusionParams(
            negative_prompt=self.negative_prompt, height=height, width=width,
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            true_cfg_scale=self.true_cfg_scale, seed=self.seed, n=self.n, cache=self.cache,
            cache_threshold=self.cache_threshold, strength=self.strength,
            # previews are events of a stream: a whole response has nowhere to put them
            partial_images=(self.partial_images or 0) if self.stream else 0)


class VideoRequest(DiffusionFields):
    """/v1/videos (JSON or multipart). `seconds` with `fps` sets the frame count: seconds * fps
    + 1 frames (the first frame is time 0, as Wan's 81 frames are 5 s at 16 fps); or
    `num_frames` does. Both given must agree (a 400 naming num_frames otherwise)."""
    size: str | None = None
    seconds: Annotated[str | float | None, BeforeValidator(_not_bool)] = None
    num_frames: Int | None = None
    fps: Int = Field(16, ge=1, le=120)

    def params(self, max_frames: int) -> DiffusionParams:
        width, height = parse_size(self.size)
        return DiffusionParams(
            negative_prompt=self.negative_prompt, height=height, width=width,
            num_frames=self.frames(max_frames),
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            true_cfg_scale=self.true_cfg_scale, guidance_scale_2=self.guidance_scale_2, seed=self.seed,
            cache=self.cache, cache_threshold=self.cache_threshold, fps=self.fps, strength=self.strength)

    def frames(self, max_frames: int) -> int | None:
        """The frame count asked for (None: the model's default)."""
        if self.seconds is None:
            return self.num_frames
        frames = round(self.duration() * self.fps) + 1
        if self.num_frames is not None and self.num_frames != frames:
            raise InvalidRequestError(
                f"num_frames={self.num_frames} contradicts seconds={self.seconds} at {self.fps} "
                f"fps ({frames} frames: seconds * fps + 1); send one of them, or values that "
                "agree", param="num_frames")
        if frames > max_frames:
            raise InvalidRequestError(
                f"seconds={self.seconds} at {self.fps} fps is {frames} frames, over the "
                f"server's limit of {max_frames}; ask for at most "
                f"{(max_frames - 1) / self.fps:g} seconds or a lower fps", param="seconds")
        return frames

    def duration(self) -> float:
        try:
            seconds = float(self.seconds)
        except (TypeError, ValueError):
            seconds = float("nan")
        if not 0 < seconds <= 3600:
            raise InvalidRequestError(f"seconds must be a positive number of seconds, got "
                                      f"{self.seconds!r}", param="seconds")
        return seconds


def validated(cls: type[BaseModel], data: dict) -> BaseModel:
    """cls(**data), a validation error raised as InvalidRequestError naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # The fields are flat: the first part names the field; more parts name a member of a
        # union ('seconds.str'), which is no field of the API.
        loc = str(err["loc"][0]) if err.get("loc") else None
        raise InvalidRequestError(f"{loc or 'body'}: {err.get('msg', 'invalid value')}",
                                  param=loc) from None


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """'WxH' -> (W, H); 'auto' or None -> (None, None): the model's default size."""
    if size is None or size.strip().lower() == "auto":
        return None, None
    m = _SIZE.match(size)
    if m is None:
        raise InvalidRequestError(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', "
                                  f"got {size!r}", param="size")
    return int(m.group(1)), int(m.group(2))


def size_of(pixels: np.ndarray) -> str:
    """'WxH' of (H, W, 3) or (F, H, W, 3) pixels."""
    return f"{pixels.shape[-2]}x{pixels.shape[-3]}"


def pictures(outputs: list[np.ndarray]) -> list[np.ndarray]:
    """A request's samples as the pictures the API returns: an (H, W, 3) image as is, an
    (L, H, W, 4) layer stack (layered models) as its L RGBA layers, in order."""
    out = []
    for p in outputs:
        if p.ndim == 3:
            out.append(p)
        elif p.ndim == 4 and p.shape[-1] == 4:
            out += list(p)
        else:
            raise ValueError(f"not an image or a layer stack: pixels of shape {p.shape}")
    return out


def encode_image(pixels: np.ndarray, fmt: str, quality: int | None = None) -> bytes:
    """float32 (H, W, 3) RGB or (H, W, 4) RGBA pixels in [0, 1] -> PNG / JPEG / WebP bytes
    (deterministic: the same pixels give the same bytes). `quality` (jpeg/webp, 0-100)
    defaults to 100, as OpenAI's output_compression. JPEG has no alpha: RGBA is composited
    onto white for it."""
    image = Image.fromarray(to_uint8(pixels), "RGBA" if pixels.shape[-1] == 4 else "RGB")
    if fmt == "jpeg" and image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image).convert("RGB")
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=100 if quality is None else quality)
    elif fmt == "webp":
        image.save(buf, format="WEBP", quality=100 if quality is None else quality)
    else:
        raise InvalidRequestError(f"output_format must be png, jpeg or webp, got {fmt!r}",
                                  param="output_format")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode_mask(data: bytes, max_pixels: int) -> np.ndarray:
    """An OpenAI edit mask (PNG/WebP; fully transparent pixels mark where to edit) -> uint8
    (H, W, 3), 255 where the image may change, 0 elsewhere. A mask without alpha is read as
    grey levels (white = edit)."""
    if not data:
        raise InvalidRequestError("mask is empty; send a PNG with an alpha channel", param="mask")
    try:
        img = Image.open(io.BytesIO(data), formats=MASK_FORMATS)
        if img.width * img.height > max_pixels:
            raise InvalidRequestError(f"mask has {img.width}x{img.height} pixels, over the limit "
                                      f"of {max_pixels:,}", param="mask")
        img.load()
    except InvalidRequestError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:   # PIL's errors
        raise InvalidRequestError(f"mask could not be decoded ({e}); send a PNG whose "
                                  "transparent pixels mark the area to edit", param="mask") from None
    if "A" in img.getbands() or "transparency" in img.info:
        edit = np.asarray(img.convert("RGBA"))[..., 3] < 128
    else:
        edit = np.asarray(img.convert("L")) >= 128
    return np.repeat((edit.astype(np.uint8) * 255)[..., None], 3, axis=2)
