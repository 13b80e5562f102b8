"""TMRoPE: the thinker's 3-D (time, height, width) rotary positions for one request's prompt.

Text and audio tokens advance all three axes together, one step per token. An image or video
occupies a block whose positions start at the block's first position `s`: token (t, h, w) of
the merged grid sits at `s + (time(t), h, w)`, where time(t) counts `position_id_per_seconds`
ids per second of media. A video with its own audio track (use_audio_in_video) interleaves
video and audio tokens chunk by chunk (`seconds_per_chunk` of media per chunk); both start at
the same `s`, so tokens of the same moment share temporal ids. After a block the next token
sits at (max of the last piece laid out) + 1, which is HF's rule (see `_lay_interleaved`).

Same maths as transformers' `Qwen2_5OmniPreTrainedModelForConditionalGeneration.
get_rope_index`, which is the test oracle. Positions are built on the host: they come from
token ids the scheduler holds there, and the model runner moves them with the batch.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.errors import InvalidRequestError


@dataclass(frozen=True)
class OmniLayout:
    """Special token ids and TMRoPE settings of a Qwen2.5-Omni prompt (thinker config)."""
    audio_token_id: int          # <|AUDIO|>: one per audio token
    image_token_id: int          # <|IMAGE|>: one per merged image patch
    video_token_id: int          # <|VIDEO|>: one per merged video patch
    audio_start_token_id: int    # <|audio_bos|>
    audio_end_token_id: int      # <|audio_eos|>
    spatial_merge_size: int = 2  # the vision tower merges m x m patches into one token
    position_id_per_seconds: float = 25  # temporal ids per second of media
    seconds_per_chunk: float = 2         # media time per audio/video interleave chunk

    def __post_init__(self):
        if self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size must be >= 1, got {self.spatial_merge_size}")
        if self.tokens_per_chunk < 1:
            raise ValueError("position_id_per_seconds * seconds_per_chunk must be >= 1, got "
                             f"{self.position_id_per_seconds} * {self.seconds_per_chunk}")

    @property
    def tokens_per_chunk(self) -> int:
        """Temporal ids per interleave chunk (HF truncates the product to int)."""
        return int(self.position_id_per_seconds * self.seconds_per_chunk)

    @classmethod
    def from_thinker_config(cls, config) -> OmniLayout:
        """From a `transformers.Qwen2_5OmniThinkerConfig`."""
        return cls(audio_token_id=config.audio_token_index,
                   image_token_id=config.image_token_index,
                   video_token_id=config.video_token_index,
                   audio_start_token_id=config.audio_start_token_id,
                   audio_end_token_id=config.audio_end_token_id,
                   spatial_merge_size=config.vision_config.spatial_merge_size,
                   position_id_per_seconds=config.position_id_per_seconds,
                   seconds_per_chunk=config.seconds_per_chunk)


@dataclass(frozen=True)
class AudioItem:
    """One audio clip: `num_tokens` <|AUDIO|> tokens (the audio tower's output length)."""
    num_tokens: int

    def __post_init__(self):
        if self.num_tokens < 1:
            raise InvalidRequestError(f"an audio clip yields {self.num_tokens} audio tokens; send "
                                      "at least 30 ms of audio", param="audio")


@dataclass(frozen=True)
class ImageItem:
    """One image: its patch grid (t, h, w) before the spatial merge, as the processor gives."""
    grid_thw: tuple[int, int, int]

    def __post_init__(self):
        _check_grid(self.grid_thw, "image")


@dataclass(frozen=True)
class VideoItem:
    """One video: patch grid (t, h, w) before the merge, seconds of video per temporal grid
    step (temporal_patch_size / fps), and, with use_audio_in_video, its own audio track
    whose tokens are interleaved with the video's."""
    grid_thw: tuple[int, int, int]
    second_per_grid: float
    audio: AudioItem | None = None

    def __post_init__(self):
        _check_grid(self.grid_thw, "video")
        if not self.second_per_grid > 0:
            raise InvalidRequestError(f"second_per_grid must be > 0, got {self.second_per_grid}",
                                      param="video")


MediaItem = AudioItem | ImageItem | VideoItem


def _check_grid(grid: tuple[int, int, int], kind: str) -> None:
    if len(grid) != 3 or any(int(g) < 1 for g in grid):
        raise InvalidRequestError(f"{kind} grid_thw must be three positive ints, got {grid}",
                                  param=kind)


def merged_grid(grid_thw: tuple[int, int, int], layout: OmniLayout) -> tuple[int, int, int]:
    """(t, h, w) in LLM tokens: h and w divided by the merge size."""
    t, h, w = (int(g) for g in grid_thw)
    m = layout.spatial_merge_size
    if h % m or w % m:
        raise InvalidRequestError(f"a vision grid of {h}x{w} patches is not a multiple of the "
                                  f"merge size {m}; resize the image or video so that it is",
                                  param="grid_thw")
    return t, h // m, w // m


def num_vision_tokens(grid_thw: tuple[int, int, int], layout: OmniLayout) -> int:
    """<|IMAGE|>/<|VIDEO|> tokens of one image or video: t * h * w / merge^2."""
    t, h, w = merged_grid(grid_thw, layout)
    return t * h * w


def chunk_spans(chunk_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Split a token run into interleave chunks, given each token's chunk id (non-decreasing).

    Same result as HF's `get_chunked_index` scan, including its quirk: the scan closes at most
    one chunk per token, so a jump over several chunks yields one-token chunks. With B_i the
    chunks closed after token i, B_i = min(k_i, B_{i-1} + 1), B_{-1} = 0, which unrolls to
    B_i = i + min(1, min_{j<=i}(k_j - j)); a chunk starts wherever B steps up.
    """
    n = chunk_ids.numel()
    if n == 0:
        return [(0, 0)]
    idx = torch.arange(n)
    closed = idx + torch.cummin(chunk_ids.long() - idx, dim=0).values.clamp(max=1)  # (n,)
    steps = torch.diff(closed, prepend=closed.new_zeros(1))
    starts = torch.nonzero(steps > 0).squeeze(1).tolist()
    bounds = [0] + starts + [n]
    return list(itertools.pairwise(bounds))


def vision_block(grid_thw: tuple[int, int, int], seconds_per_t: float,
                 layout: OmniLayout) -> torch.Tensor:
    """(3, t*h*w) positions of a merged vision grid, relative to its first position.

    The temporal id of grid step t is trunc(t * seconds_per_t * position_id_per_seconds),
    computed in float32 as HF does, so the truncation lands on the same integers.
    """
    t, h, w = merged_grid(grid_thw, layout)
    scale = torch.tensor(seconds_per_t, dtype=torch.float32)
    t_ids = (torch.arange(t) * scale * layout.position_id_per_seconds).long()  # (t,)
    return torch.stack([t_ids.view(t, 1, 1).expand(t, h, w).reshape(-1),
                        torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1),
                        torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)])


def _line(start: int, n: int) -> torch.Tensor:
    """(3, n) positions start, start+1, ... on every axis (text and audio tokens)."""
    return (torch.arange(n) + start).view(1, n).expand(3, n)


@dataclass(frozen=True)
class MRopePositions:
    """TMRoPE positions of one prompt."""
    positions: torch.Tensor  # (3, T) int64 on the host: time, height, width ids per token
    delta: int               # generated token k (0-based) sits at T + k + delta on every axis
    next_position: int       # where a text token appended to the prompt would sit

    def decode_position(self, k: int) -> int:
        """Position (same on all three axes) of the k-th generated token."""
        return self.positions.shape[1] + k + self.delta

    def extend_text(self, n: int) -> MRopePositions:
        """Positions of this prompt followed by `n` more text tokens: what get_rope_index gives
        for the longer id list (the extra tokens continue from the prompt's last piece)."""
        added = _line(self.next_position, n)
        positions = torch.cat([self.positions, added], dim=1)
        top = max(self.positions.shape[1] + self.delta - 1, self.next_position + n - 1)
        return MRopePositions(positions, top + 1 - positions.shape[1], self.next_position + n)


def talker_prompt_positions(thinker: MRopePositions) -> MRopePositions:
    """Positions of the talker's prompt. The talker's text ids are the thinker's prompt plus two
    tokens (the speaker's text bos and the thinker's first reply token), and HF computes the
    talker's positions and delta with get_rope_index on those ids (its codec tokens follow)."""
    return thinker.extend_text(2)


class _Walk:
    """Lays out the prompt left to right: `pieces` of positions, `cursor` the next token index
    not laid out, `next_pos` the position the next text token takes."""

    def __init__(self, ids: torch.Tensor, layout: OmniLayout):
        self.layout = layout
        self.tokens: list[int] = ids.tolist()
        kinds = torch.tensor([layout.audio_token_id, layout.image_token_id, layout.video_token_id])
        self.placeholders: list[int] = torch.nonzero(torch.isin(ids, kinds)).squeeze(1).tolist()
        self.pieces: list[torch.Tensor] = []
        self.cursor = 0
        self.next_pos = 0
        self.top = -1  # max position laid out so far

    def add(self, piece: torch.Tensor) -> None:
        self.pieces.append(piece)
        if piece.numel():
            self.top = max(self.top, int(piece.max()))

    def text_until(self, end: int) -> None:
        """Text tokens [cursor, end), one position each."""
        n = end - self.cursor
        if n > 0:
            self.add(_line(self.next_pos, n))
            self.next_pos += n
        self.cursor = max(self.cursor, end)

    def next_placeholder(self, token: int, what: str) -> int:
        """Index of the next placeholder token; it must be `token` (media come in order)."""
        i = bisect_left(self.placeholders, self.cursor)
        if i == len(self.placeholders):
            raise InvalidRequestError(f"the prompt has no placeholder left for {what}; put one "
                                      "<|AUDIO|>/<|IMAGE|>/<|VIDEO|> per media item",
                                      param="prompt")
        start = self.placeholders[i]
        if self.tokens[start] != token:
            raise InvalidRequestError(f"the next placeholder in the prompt (at token {start}) is "
                                      f"not for {what}; list the media in the order the "
                                      "prompt shows them", param="prompt")
        return start

    def expect_run(self, start: int, token: int, n: int, what: str) -> None:
        """tokens[start:start+n] are `token` and the run does not go on past them."""
        end = start + n
        run_ok = end <= len(self.tokens) and all(x == token for x in self.tokens[start:end])
        if not run_ok or (end < len(self.tokens) and self.tokens[end] == token):
            raise InvalidRequestError(f"{what} needs exactly {n} consecutive placeholder tokens "
                                      "in the prompt; expand the prompt with the same media "
                                      "sizes", param="prompt")

    def lay(self, item: MediaItem) -> None:
        if isinstance(item, AudioItem):
            start = self.next_placeholder(self.layout.audio_token_id, "an audio clip")
            self.expect_run(start, self.layout.audio_token_id, item.num_tokens, "an audio clip")
            # bos, audio tokens and eos all take one position each, like text
            self.text_until(start + item.num_tokens)
        elif isinstance(item, VideoItem) and item.audio is not None:
            self._lay_interleaved(item)
        else:
            is_image = isinstance(item, ImageItem)
            what = "an image" if is_image else "a video"
            token = self.layout.image_token_id if is_image else self.layout.video_token_id
            start = self.next_placeholder(token, what)
            n = num_vision_tokens(item.grid_thw, self.layout)
            self.expect_run(start, token, n, what)
            self.text_until(start)  # text and the vision bos token
            rel = vision_block(item.grid_thw, 1.0 if is_image else item.second_per_grid,
                               self.layout)
            block = rel + self.next_pos
            self.add(block)
            self.cursor = start + n
            self.next_pos = int(block.max()) + 1  # the eos and what follows continue from here

    def _lay_interleaved(self, video: VideoItem) -> None:
        """<vision_bos><audio_bos> [video chunk, audio chunk]... <audio_eos><vision_eos>.

        Both bos tokens share one position, so do both eos tokens. Video and audio start at the
        same position; their tokens alternate chunk by chunk. The eos position is the max of
        the *last chunk laid out* plus one, not the block's max (HF's rule; they differ only
        when a video chunk's h/w ids outrun the final audio chunk).
        """
        lo = self.layout
        start = self.next_placeholder(lo.video_token_id, "a video with audio")
        nv, na = num_vision_tokens(video.grid_thw, lo), video.audio.num_tokens
        end = start + nv + na
        body = self.tokens[start:end]
        if (start - self.cursor < 2 or self.tokens[start - 1] != lo.audio_start_token_id
                or end + 2 > len(self.tokens)
                or body.count(lo.video_token_id) != nv or body.count(lo.audio_token_id) != na
                or self.tokens[end] != lo.audio_end_token_id):
            raise InvalidRequestError(
                f"a video with audio needs <|vision_bos|><|audio_bos|>, {nv} video and {na} "
                "audio tokens interleaved, then <|audio_eos|><|vision_eos|>; expand the prompt "
                "with use_audio_in_video and the same media sizes", param="prompt")
        self.text_until(start - 2)
        self.add(torch.full((3, 2), self.next_pos, dtype=torch.long))  # the two bos tokens
        first = self.next_pos + 1
        vid = vision_block(video.grid_thw, video.second_per_grid, lo) + first  # (3, nv)
        aud = _line(first, na)                                                 # (3, na)
        tpc = lo.tokens_per_chunk
        v_spans = chunk_spans((vid[0] - first) // tpc)
        a_spans = chunk_spans((aud[0] - first) // tpc)
        last = None
        for j in range(max(len(v_spans), len(a_spans))):
            for block, spans in ((vid, v_spans), (aud, a_spans)):
                if j < len(spans):
                    last = block[:, spans[j][0]:spans[j][1]]
                    self.add(last)
        eos = int(last.max()) + 1
        self.add(torch.full((3, 2), eos, dtype=torch.long))  # the two eos tokens
        self.cursor = end + 2
        self.next_pos = eos + 1


def mrope_positions(token_ids: Sequence[int] | torch.Tensor, media: Sequence[MediaItem],
                    layout: OmniLayout) -> MRopePositions:
    """TMRoPE positions (3, T) and decode delta of one prompt (1-D ids, no padding).

    `media` lists the prompt's audio clips, images and videos in order of appearance (what
    `prompt.expand_prompt` returns). A video with `audio` set is laid out interleaved
    (use_audio_in_video); HF applies that flag to every video of a request, we per video.
    Raises InvalidRequestError when the placeholders do not match the media.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device="cpu")  # host-side ids
    if ids.dim() != 1 or ids.numel() == 0:
        raise InvalidRequestError("the prompt must be a non-empty 1-D list of token ids",
                                  param="prompt")
    walk = _Walk(ids, layout)
    for item in media:
        walk.lay(item)
    if bisect_left(walk.placeholders, walk.cursor) != len(walk.placeholders):
        raise InvalidRequestError(f"the prompt has more media placeholders than the {len(media)} "
                                  "media items given; remove the extra placeholders or add the "
                                  "media", param="prompt")
    walk.text_until(len(walk.tokens))
    positions = torch.cat(walk.pieces, dim=1)  # (3, T)
    return MRopePositions(positions, walk.top + 1 - ids.numel(), walk.next_pos)
