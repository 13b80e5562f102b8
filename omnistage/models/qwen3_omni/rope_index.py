"""Qwen3-Omni's 3-D positions (transformers' Qwen3OmniMoe get_rope_index), for prompts that
hold an image or a video; prompts of text and audio alone take plain positions, as there.

Walking the prompt: text tokens and each audio clip's <|audio_start|>, audio tokens and
<|audio_end|> take consecutive positions on all three axes. An image or video block is
<|vision_start|> (one position), then its t x h x w merged patches at
    (start + t_i * s * position_id_per_seconds, start + row, start + column)
with s = 1 for an image and the video's seconds per temporal patch, then <|vision_end|> at the
largest position so far + 1; the text after it continues from there.

The reference computes these in float; a video's temporal step s * position_id_per_seconds
that is not a whole number is refused here (our RoPE tables are indexed by integer positions):
with the default 2-frame patches and a video sampled at 2 fps it is 13.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.errors import InvalidRequestError


@dataclass(frozen=True)
class VisionBlock:
    """One image (seconds_per_grid 1) or video in the prompt, in order."""

    grid_thw: tuple[int, int, int]       # patches (t, h, w) before merging
    seconds_per_grid: float = 1.0


@dataclass(frozen=True)
class RopeIds:
    vision_start: int
    image: int
    video: int
    spatial_merge_size: int
    position_id_per_seconds: float


def _temporal_step(block: VisionBlock, ids: RopeIds) -> int:
    step = block.seconds_per_grid * ids.position_id_per_seconds
    if abs(step - round(step)) > 1e-6:
        raise InvalidRequestError(f"a video sampled at {2 / block.seconds_per_grid:g} fps gives temporal "
                                  f"positions {step:g} apart; only whole steps are served", param="video")
    return round(step)


def _vision_positions(block: VisionBlock, ids: RopeIds, start: int) -> torch.Tensor:
    """(3, t*h*w/m²) positions of one block's merged patches, from `start`."""
    t, h, w = block.grid_thw
    m = ids.spatial_merge_size
    gh, gw = h // m, w // m
    tt = (torch.arange(t) * _temporal_step(block, ids)).view(t, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + start


def rope_positions(token_ids: list[int], blocks: list[VisionBlock], ids: RopeIds) -> tuple[torch.Tensor | None, int]:
    """((3, P) int64 positions, delta) for a prompt with vision blocks (in order); (None, 0) for
    one without. Generated position p (>= P) then sits at p + delta on all axes."""
    if not blocks:
        return None, 0
    tokens = torch.tensor(token_ids)
    out = torch.empty(3, len(token_ids), dtype=torch.int64)
    nxt, i, b = 0, 0, 0                      # next position; next token; next block
    while i < len(token_ids):
        if token_ids[i] == ids.vision_start and i + 1 < len(token_ids) and token_ids[i + 1] in (ids.image, ids.video):
            if b >= len(blocks):
                raise InvalidRequestError("the prompt holds more images/videos than were given", param="messages")
            out[:, i] = nxt
            pos = _vision_positions(blocks[b], ids, nxt + 1)
            n = pos.shape[1]
            if not bool((tokens[i + 1:i + 1 + n] == token_ids[i + 1]).all()):
                raise InvalidRequestError("an image/video block's placeholders do not match its size",
                                          param="messages")
            out[:, i + 1:i + 1 + n] = pos
            nxt, i, b = int(pos.max()) + 1, i + 1 + n, b + 1
            continue
        out[:, i] = nxt
        nxt, i = nxt + 1, i + 1
    return out, int(out.max()) + 1 - len(token_ids)
