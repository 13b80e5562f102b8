"""Qwen2.5-Omni prompts: each media placeholder token becomes the run of tokens whose embeddings
the audio and vision towers supply.

Token-level twin of what `transformers.Qwen2_5OmniProcessor` does to the text: the i-th
<|AUDIO|> becomes as many <|AUDIO|> as the i-th clip has audio tokens, the i-th <|IMAGE|> /
<|VIDEO|> as many as its merged patches; a video carrying its own audio track
(use_audio_in_video) becomes <|audio_bos|> + its video and audio tokens interleaved per time
chunk + <|audio_eos|>. Placeholders are special tokens, so expanding ids is the same as
expanding text and tokenizing it. The media descriptors come back in prompt order, ready for
`rope_index.mrope_positions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.audio_features import num_audio_tokens
from omnistage.models.qwen2_5_omni.rope_index import (
    AudioItem,
    ImageItem,
    MediaItem,
    OmniLayout,
    VideoItem,
    chunk_spans,
    merged_grid,
    num_vision_tokens,
)

# Qwen2.5-Omni's talker was trained only under this system prompt: with another one the thinker
# still answers, but the speech the talker makes from its hidden states may come out wrong or
# silent (the model card requires it whenever audio output is wanted). Use it as the system
# message of every request that asks for speech.
DEFAULT_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba "
                         "Group, capable of perceiving auditory and visual inputs, as well as "
                         "generating text and speech.")


def audio_item(feature_frames: int) -> AudioItem:
    """The descriptor of a clip of `feature_frames` mel frames (the feature extractor's
    attention-mask sum); its token count is HF's `_get_feat_extract_output_lengths`."""
    n = num_audio_tokens(feature_frames)
    if n < 1:
        raise InvalidRequestError(f"an audio clip of {feature_frames} feature frames is too short "
                                  "to yield a token; send at least 30 ms of audio", param="audio")
    return AudioItem(n)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class ExpandedPrompt:
    token_ids: list[int]           # the prompt with every placeholder expanded
    media: tuple[MediaItem, ...]   # its audio clips, images and videos in prompt order


def _time_chunk_ids(values: np.ndarray, tokens_per_chunk: int) -> np.ndarray:
    """Largest c with values >= c * tokens_per_chunk. The processor compares the float times
    with these integer thresholds; the correction keeps the answer exact even where the
    rounded quotient would land on a threshold the time is just below."""
    k = np.floor(values / tokens_per_chunk)
    k -= k * tokens_per_chunk > values
    k += (k + 1) * tokens_per_chunk <= values
    return k.astype(np.int64)


def interleaved_video_audio(video: VideoItem, layout: OmniLayout) -> list[int]:
    """What a video with its audio track replaces <|VIDEO|> with: <|audio_bos|>, then per time
    chunk the chunk's video tokens and the chunk's audio tokens, then <|audio_eos|>.

    Chunks follow the processor: a video token's time is t * second_per_grid *
    position_id_per_seconds in float64 (not truncated, unlike the model's positions), an audio
    token's time is its index (25 audio tokens per second).
    """
    assert video.audio is not None
    t, h, w = merged_grid(video.grid_thw, layout)
    frame_times = np.arange(t) * video.second_per_grid * layout.position_id_per_seconds  # (t,)
    tpc = layout.tokens_per_chunk
    v_chunks = np.repeat(_time_chunk_ids(frame_times, tpc), h * w)   # (t*h*w,)
    a_chunks = np.arange(video.audio.num_tokens) // tpc               # (num_audio_tokens,)
    v_spans = chunk_spans(torch.from_numpy(v_chunks))
    a_spans = chunk_spans(torch.from_numpy(a_chunks))
    out = [layout.audio_start_token_id]
    for j in range(max(len(v_spans), len(a_spans))):
        if j < len(v_spans):
            out += [layout.video_token_id] * (v_spans[j][1] - v_spans[j][0])
        if j < len(a_spans):
            out += [layout.audio_token_id] * (a_spans[j][1] - a_spans[j][0])
    out.append(layout.audio_end_token_id)
    return out


def _replacement(item: MediaItem, layout: OmniLayout) -> list[int]:
    if isinstance(item, AudioItem):
        return [layout.audio_token_id] * item.num_tokens
    if isinstance(item, ImageItem):
        return [layout.image_token_id] * num_vision_tokens(item.grid_thw, layout)
    if item.audio is not None:
        return interleaved_video_audio(item, layout)
    return [layout.video_token_id] * num_vision_tokens(item.grid_thw, layout)


def _check_counts(ids: list[int], layout: OmniLayout, given: dict[str, int]) -> None:
    found = {"audio": ids.count(layout.audio_token_id), "image": ids.count(layout.image_token_id),
             "video": ids.count(layout.video_token_id)}
    tag = {"audio": "<|AUDIO|>", "image": "<|IMAGE|>", "video": "<|VIDEO|>"}
    noun = {"audio": "audio clip", "image": "image", "video": "video"}
    for kind, n in found.items():
        if n != given[kind]:
            raise InvalidRequestError(
                f"the prompt has {n} {tag[kind]} placeholder(s) but {given[kind]} "
                f"{noun[kind]}(s) were given; put exactly one {tag[kind]} where each "
                f"{noun[kind]} goes", param=kind)


def expand_prompt(prompt: str | Sequence[int], layout: OmniLayout, *,
                  audios: Sequence[AudioItem] = (), images: Sequence[ImageItem] = (),
                  videos: Sequence[VideoItem] = (),
                  tokenizer: Tokenizer | None = None) -> ExpandedPrompt:
    """Expand the placeholders of one prompt (text, tokenized with `tokenizer`, or token ids).

    The i-th <|AUDIO|> takes audios[i], and likewise for images and videos, as in the HF
    processor. A video whose `audio` is set is expanded interleaved (use_audio_in_video); its
    audio has no <|AUDIO|> placeholder of its own. Raises InvalidRequestError when a modality's
    placeholder count differs from its media count.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids or one",
                                      param="prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    else:
        ids = [int(x) for x in prompt]
    _check_counts(ids, layout, {"audio": len(audios), "image": len(images), "video": len(videos)})
    queues = {layout.audio_token_id: iter(audios), layout.image_token_id: iter(images),
              layout.video_token_id: iter(videos)}
    out: list[int] = []
    media: list[MediaItem] = []
    for tok in ids:
        queue = queues.get(tok)
        if queue is None:
            out.append(tok)
            continue
        item = next(queue)
        media.append(item)
        out += _replacement(item, layout)
    return ExpandedPrompt(out, tuple(media))
