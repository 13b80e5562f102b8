"""Typed messages on Qwen3-Omni's edges.

client -> encoder: EncodeJob (Qwen2.5-Omni's)    encoder -> router: EncodedMedia (+ DeepStack)
router -> thinker: ARRequest (merged prompt, DeepStack rows)
thinker -> talker: TalkerStart, then TalkerText (the reply's embeddings as the thinker makes them)
talker -> code2wav: CodecFrames                  code2wav -> client: AudioChunk (Qwen2.5-Omni's)

The thinker's vectors reach the talker in the thinker's width, as they are: the talker stage
projects them (text_projection / hidden_projection) and adds its codec embeddings itself.
"""

from __future__ import annotations

import msgspec
import torch

from omnistage.sampling_params import SamplingParams

TEXT, HIDDEN = 0, 1     # TalkerStart.kinds: which projection a row takes


class EncodedMedia(msgspec.Struct):
    """Encoder outputs per modality, each list in order of appearance in the prompt; an
    image's or video's DeepStack features (K, rows, hidden) beside its main rows (rows, hidden)."""

    request_id: str
    audio: list[torch.Tensor]
    image: list[torch.Tensor]
    video: list[torch.Tensor]
    image_deepstack: list[torch.Tensor]
    video_deepstack: list[torch.Tensor]


class TalkerStart(msgspec.Struct):
    """A speaking request's talker prompt: P rows in the thinker's width, each projected by
    text_projection (TEXT: a token embedding) or hidden_projection (HIDDEN: the thinker's
    hidden state at a media position), plus the codec embedding of `codec_ids[i]` where it is
    >= 0 (the talker's own tokens: think/speaker/pad/bos)."""

    request_id: str
    rows: torch.Tensor                  # (P, thinker hidden)
    kinds: list[int]                    # (P,) TEXT | HIDDEN
    codec_ids: list[int]                # (P,) a codec id or -1
    params: SamplingParams
    mrope_positions: torch.Tensor | None = None    # (3, P) int64; None: plain positions
    position_delta: int = 0
    background: bool = False            # a warm prefill (ARRequest.background)


class TalkerText(msgspec.Struct):
    """More of the reply for the talker: the thinker's input embeddings of its next tokens
    (n, thinker hidden). `finished`: the thinker is done; after these rows comes the text-end
    row, then the pad row for every later frame."""

    request_id: str
    rows: torch.Tensor | None = None
    finished: bool = False


class CodecFrames(msgspec.Struct):
    """New frames of a request's speech (codebook 0 .. G - 1 each). The router sends one
    without frames when the request starts, which opens its stream in code2wav."""

    request_id: str
    codes: torch.Tensor                 # (G, n) int64; empty: no frames
    finished: bool = False
