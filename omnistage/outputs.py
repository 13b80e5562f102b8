"""What generation returns: per-step deltas (streaming) and whole outputs (offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """float [0, 1] -> uint8, rounding as diffusers' numpy_to_pil does (x * 255, rounded)."""
    return (pixels * 255).round().astype(np.uint8)


def is_layer_stack(pixels: np.ndarray) -> bool:
    """A layered model's sample: (L, H, W, 4) RGBA layers (a video is (F, H, W, 3))."""
    return pixels.ndim == 4 and pixels.shape[-1] == 4


def pil_images(pixels: list[np.ndarray]) -> list:
    """PIL images of the samples that are pictures: an (H, W, 3) image -> one RGB image; an
    (L, H, W, 4) layer stack -> L RGBA images (flattened: sample 0's layers, then sample 1's);
    videos (F, H, W, 3) -> none (see OmniOutput.videos)."""
    from PIL import Image

    out = []
    for p in pixels:
        if p.ndim == 3:
            out.append(Image.fromarray(to_uint8(p)))
        elif is_layer_stack(p):
            out += [Image.fromarray(to_uint8(layer), "RGBA") for layer in p]
    return out


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # (token id, logprob) alternatives, best first


@dataclass
class Delta:
    """What one engine step added to one sample of one request."""
    request_id: str
    index: int                          # sample index (0..n-1)
    text: str                           # new text (never a broken UTF-8 character)
    token_ids: list[int]                # new token ids
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None    # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    hidden_states: torch.Tensor | None = None  # (new positions, hidden) if requested
    input_embeds: torch.Tensor | None = None   # (new positions, width) with hidden_states
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    audio: np.ndarray | None = None     # new float32 PCM samples (speech-producing models)
    sample_rate: int | None = None
    error: str | None = None            # with finish_reason "error": what failed (see graph.FailureDelta)
    progress: tuple[int, int] | None = None   # diffusion: (steps done, total steps)
    images: list[np.ndarray] | None = None    # diffusion: float32 pixels in [0, 1], one per sample:
                                              # (H, W, 3) images, (F, H, W, 3) videos or
                                              # (L, H, W, 4) RGBA layers (layered models)
    seed: int | None = None             # diffusion: the seed the request ran with
    partial_image: np.ndarray | None = None   # diffusion, partial_images: sample `index`'s preview
    partial_image_index: int | None = None    # that sample's previews counted from 0


@dataclass
class CompletionOutput:
    """One sample's whole output."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hidden_states: torch.Tensor | None = None  # (prompt + output positions, hidden) if asked

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass
class OmniOutput:
    """One prompt's result. `.text`/`.token_ids` are those of the first sample."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    audio: np.ndarray | None = None     # float32 waveform, for speech-producing models
    sample_rate: int | None = None
    images: list = field(default_factory=list)   # image models: PIL images, one per sample
    pixels: list[np.ndarray] | None = None       # image/video models: float32 [0, 1], (H, W, 3)
                                                 # per image, (F, H, W, 3) per video or
                                                 # (L, H, W, 4) RGBA layers per layered sample
    seed: int | None = None                      # image/video models: the seed used
    fps: int | None = None                       # video models: frames per second

    @property
    def videos(self) -> list[np.ndarray]:
        """Video models: uint8 (F, H, W, 3) frames per sample."""
        return [to_uint8(v) for v in self.pixels or [] if v.ndim == 4 and not is_layer_stack(v)]

    @property
    def layers(self) -> list[list]:
        """Layered models (Qwen-Image-Layered): per sample, its L layers as RGBA PIL images."""
        return [pil_images([v]) for v in self.pixels or [] if is_layer_stack(v)]

    def mp4(self, index: int = 0) -> bytes:
        """Video models: sample `index` encoded as an H.264 MP4 at `fps`."""
        from omnistage.media.video_encode import encode_mp4

        return encode_mp4(self.videos[index], self.fps or 16)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
