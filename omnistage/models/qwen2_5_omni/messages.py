"""Typed messages on Qwen2.5-Omni's edges (and the preprocessed request that enters them).

client -> encoder: EncodeJob            encoder -> thinker: ARRequest (merged prompt)
thinker -> talker: ARRequest, then ARFeed (reply vectors as the thinker computes them)
talker -> token2wav: CodecChunk         token2wav -> client: AudioChunk (as Delta)
"""

from __future__ import annotations

import msgspec
import torch

from omnistage.sampling_params import SamplingParams


class MediaInput(msgspec.Struct):
    """One preprocessed media item, in order of appearance in the prompt."""

    kind: str                                   # "audio" | "image" | "video"
    features: torch.Tensor                      # audio: (128, frames); image/video: (patches, C·t·p·p)
    grid_thw: tuple[int, int, int] | None = None   # image/video patch grid
    # A video's own audio track (use_audio_in_video): (128, frames) features.
    video_audio: torch.Tensor | None = None


class OmniRequest(msgspec.Struct):
    """A request after preprocessing: expanded prompt ids, positions, media, parameters."""

    request_id: str
    prompt_token_ids: list[int]
    mrope_positions: torch.Tensor                 # (3, P) int64
    position_delta: int
    talker_mrope_positions: torch.Tensor | None   # (3, P + 2) for the talker's prompt
    talker_position_delta: int
    media: list[MediaInput]
    thinker_params: SamplingParams
    talker_params: SamplingParams | None          # None: text only
    speaker: str = ""
    keep_hidden: bool = False    # the thinker keeps its prompt's hidden rows (a speaking prompt)
    # OutputOptions.prefill_only (a Realtime turn still spoken): background work for the AR
    # stages (ARRequest.background), which no one waits for yet
    prefill_only: bool = False

    @property
    def warm_talker(self) -> bool:
        """A speaking session's turn prefilled while still spoken: the talker prefills its rows
        too, so that at commit its prefix cache holds them."""
        return self.keep_hidden and self.prefill_only


class EncodeJob(msgspec.Struct):
    request_id: str
    media: list[MediaInput]


class EncodedMedia(msgspec.Struct):
    """Encoder outputs per modality, each list in order of appearance in the prompt."""

    request_id: str
    audio: list[torch.Tensor]                   # (tokens_i, hidden) each
    image: list[torch.Tensor]
    video: list[torch.Tensor]


class CodecChunk(msgspec.Struct):
    request_id: str
    codes: list[int]                            # new codec tokens (stop token excluded)
    finished: bool = False
    speaker: str = ""                           # set on a request's first chunk
    seed: int | None = None                     # noise seed (the talker params' seed), first chunk


class AudioChunk(msgspec.Struct):
    request_id: str
    samples: torch.Tensor                       # (n,) float32 PCM
    sample_rate: int
    finished: bool = False
