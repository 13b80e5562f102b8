"""Decode request images (PNG, JPEG, WebP, GIF) to RGB, and parse `data:` URLs.

Safety: PIL opens lazily, so the pixel count is known from the header before any pixel is
decoded; images over `max_pixels` are rejected at that point. Only the four formats' parsers
are tried (`Image.open(formats=...)`), and truncated files are an error, never silently padded.

Transparency is composited onto white, as transformers' `convert_to_rgb` (and so the HF
processors of Qwen2-VL / Qwen2.5-Omni) does: transparent pixels often hold black RGB, which
would otherwise show through.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from PIL import Image, UnidentifiedImageError

from omnistage.errors import InvalidRequestError

# PIL format names; GIF and animated WebP give their first frame.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# 50 MP: a 48 MP phone photo passes; 150 MB of RGB at most per image.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


@dataclass(frozen=True)
class DataURL:
    mime_type: str      # e.g. "image/png"; "text/plain" when the URL names none (RFC 2397)
    data: bytes


def decode_image(data: bytes | bytearray | memoryview, *,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, param: str = "image") -> Image.Image:
    """PNG/JPEG/WebP/GIF bytes -> a loaded PIL image in mode "RGB" (first frame if animated).

    Raises InvalidRequestError(param=param) for empty, corrupt, truncated or unsupported data
    and for images with more than `max_pixels` pixels (checked before decoding pixels).
    """
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    if not data:
        raise InvalidRequestError(f"{param} is empty; send the bytes of a PNG, JPEG, WebP or "
                                  "GIF image", param=param)
    try:
        img = Image.open(io.BytesIO(bytes(data)), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{param} is not a PNG, JPEG, WebP or GIF image; convert it to "
                                  "one of those formats", param=param) from None
    except Image.DecompressionBombError:
        raise _too_large(param, None, max_pixels) from None
    except (OSError, SyntaxError, ValueError) as e:       # PIL's parsers raise all three
        raise _corrupt(param, e) from None
    with img:
        width, height = img.size
        if width <= 0 or height <= 0:
            raise InvalidRequestError(f"{param} has an empty size {width}x{height}; send an "
                                      "image with pixels", param=param)
        if width * height > max_pixels:
            raise _too_large(param, (width, height), max_pixels)
        try:
            img.load()                                    # first frame only
            return _to_rgb(img)
        except Image.DecompressionBombError:
            raise _too_large(param, (width, height), max_pixels) from None
        except (OSError, SyntaxError, ValueError) as e:
            raise _corrupt(param, e) from None


def parse_data_url(url: str, *, param: str, max_bytes: int | None = None) -> DataURL:
    """Split `data:[<mime>][;param=v]*[;base64],<payload>` (RFC 2397) into mime type and bytes.

    `max_bytes` bounds the decoded size and is checked before decoding. Raises
    InvalidRequestError(param=param) for malformed URLs or payloads.
    """
    if not isinstance(url, str) or not url[:5].lower() == "data:":
        raise InvalidRequestError(f"{param} must be a data: URL such as "
                                  "'data:image/png;base64,<base64 bytes>'", param=param)
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidRequestError(f"{param} is a data: URL without a ',' before its payload; use "
                                  "'data:<mime type>;base64,<base64 bytes>'", param=param)
    parts = [p.strip() for p in header.split(";")]
    is_base64 = len(parts) > 1 and parts[-1].lower() == "base64"
    mime = parts[0].lower() or "text/plain"
    if "/" not in mime:
        raise InvalidRequestError(f"{param} has an invalid media type {parts[0]!r}; use e.g. "
                                  "'data:image/png;base64,...'", param=param)
    if is_base64:
        # Line breaks and spaces are common in pasted base64; nothing else is tolerated.
        payload = "".join(payload.split())
        if max_bytes is not None and len(payload) // 4 * 3 > max_bytes + 2:
            raise _payload_too_large(param, max_bytes)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{param} has an invalid base64 payload; encode the bytes "
                                      "with standard base64 (A-Z, a-z, 0-9, +, /, = padding)",
                                      param=param) from None
    else:
        if max_bytes is not None and len(payload) > 3 * max_bytes:
            raise _payload_too_large(param, max_bytes)
        data = unquote_to_bytes(payload)
    if max_bytes is not None and len(data) > max_bytes:
        raise _payload_too_large(param, max_bytes)
    return DataURL(mime_type=mime, data=data)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> "RGB", alpha (or a palette's transparent index) composited on white."""
    if img.mode == "RGB":
        return img.copy()                     # detach from the source file
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _too_large(param: str, size: tuple[int, int] | None, max_pixels: int) -> InvalidRequestError:
    got = f"{size[0]}x{size[1]} = {size[0] * size[1]:,} pixels" if size else "too many pixels"
    return InvalidRequestError(f"{param} has {got}, over the limit of {max_pixels:,}; downscale "
                               "it before sending", param=param)


def _corrupt(param: str, e: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"{param} could not be decoded ({e or type(e).__name__}); send a "
                               "complete, valid PNG, JPEG, WebP or GIF file", param=param)


def _payload_too_large(param: str, max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(f"{param} carries more than {max_bytes:,} bytes; send a smaller "
                               "file", param=param)
