"""Qwen3-Omni requests in: a prompt (text, chat with audio/image/video parts, or token ids)
becomes expanded token ids, positions and preprocessed media.

The media decoding, limits and content parts are Qwen2.5-Omni's (OmniProcessor); what differs:
- no default system turn (Qwen3-Omni's template has none, and its talker reads user turns only);
- audio features as Qwen3OmniMoeProcessor makes them for one clip (padding=True, no cap:
  floor(L / 160) frames of the clip as it is), and `num_audio_tokens(frames, n_window)`
  placeholders (<|audio_pad|>) per clip;
- images and videos: 16-pixel patches (the folder's preprocessor_config), <|image_pad|> /
  <|video_pad|> per merged patch;
- positions: plain (None) unless the prompt holds an image or a video, as the reference's
  get_rope_index (audio alone takes the plain path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.chat_messages import check_messages
from omnistage.chat_tools import template_messages, tools_for_template
from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.audio_features import LogMelConfig, LogMelExtractor
from omnistage.models.qwen2_5_omni.messages import MediaInput
from omnistage.models.qwen2_5_omni.processor import MEDIA_TYPES, MediaLimits, OmniProcessor
from omnistage.models.qwen2_5_omni.prompt import expand_prompt
from omnistage.models.qwen2_5_omni.rope_index import AudioItem, ImageItem, OmniLayout, VideoItem
from omnistage.models.qwen2_5_omni.vision_preprocess import VisionPreprocessConfig
from omnistage.models.qwen3_omni.audio_encoder import num_audio_tokens
from omnistage.models.qwen3_omni.rope_index import RopeIds, VisionBlock, rope_positions
from omnistage.models.qwen3_omni.router import user_positions


@dataclass
class Qwen3Prompt:
    text: str | None
    token_ids: list[int]
    media: list[MediaInput]
    positions: torch.Tensor | None      # (3, P) int64; None: plain positions
    position_delta: int = 0
    items: tuple = ()                   # the media descriptors, in prompt order


@dataclass(frozen=True)
class TalkerLayout:
    """Ids the talker's prompt positions are computed from (see talker_positions)."""

    im_start: int
    user: int
    tts_pad: int


class Qwen3OmniProcessor(OmniProcessor):
    def __init__(self, tokenizer, layout: OmniLayout, vision: VisionPreprocessConfig,
                 limits: MediaLimits, n_window: int, rope: RopeIds):
        super().__init__(tokenizer, layout, vision, limits)
        self.log_mel = LogMelExtractor(LogMelConfig(max_samples=None, padding="longest"))
        self.n_window = n_window
        self.rope = rope

    def __call__(self, prompt, want_audio: bool, use_audio_in_video: bool = False) -> Qwen3Prompt:
        if use_audio_in_video:
            raise InvalidRequestError("use_audio_in_video is not offered for Qwen3-Omni yet; send the "
                                      "video's sound as an audio part", param="use_audio_in_video")
        text, ids, audios, images, videos = None, None, [], [], []
        tools = None
        if isinstance(prompt, dict) and "messages" in prompt:
            prompt, tools = prompt["messages"], prompt.get("tools")
        if isinstance(prompt, list):
            check_messages(prompt, MEDIA_TYPES)
            audios, images, videos = self._media(prompt, False)
            text = self.tokenizer.apply_chat_template(
                [self._template_view(m) for m in template_messages(prompt)], tokenize=False,
                add_generation_prompt=True, **tools_for_template(self.tokenizer, tools))
        else:
            text, ids = self._plain(prompt)
        expanded = expand_prompt(text if ids is None else list(ids), self.layout,
                                 audios=[a[1] for a in audios], images=[i[1] for i in images],
                                 videos=[v[1] for v in videos], tokenizer=self.tokenizer)
        positions, delta = rope_positions(expanded.token_ids, vision_blocks(expanded.media), self.rope)
        by_item = {id(item): inp for inp, item in audios + images + videos}
        media = [by_item[id(item)] for item in expanded.media]     # prompt order
        return Qwen3Prompt(text, expanded.token_ids, media, positions, delta, expanded.media)

    @staticmethod
    def _plain(prompt) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
                raise InvalidRequestError("prompt_token_ids must be a non-empty list of integers",
                                          param="prompt_token_ids")
            return None, list(ids)
        raise InvalidRequestError("a prompt must be a string, a list of chat messages or a dict "
                                  "with prompt_token_ids / messages", param="prompt")

    def _audio(self, part: dict, where: str):
        media, _ = super()._audio(part, where)
        n = num_audio_tokens(media.features.shape[-1], self.n_window)
        if n < 1:
            raise InvalidRequestError(f"{where}: the audio is too short to yield a token; send at "
                                      "least 30 ms of audio", param=where)
        return media, AudioItem(n)


def vision_blocks(items) -> list[VisionBlock]:
    """The images and videos among a prompt's media descriptors, in order."""
    return [VisionBlock(tuple(m.grid_thw), 1.0 if isinstance(m, ImageItem) else m.second_per_grid)
            for m in items if isinstance(m, (ImageItem, VideoItem))]


def talker_positions(pp: Qwen3Prompt, layout: TalkerLayout, rope: RopeIds) -> tuple[torch.Tensor | None, int]:
    """The talker prompt's positions: transformers computes them from the user turns' token
    ids followed by the assistant part's 9 (tts_pad) ids, with the prompt's images and videos
    (here: those inside user turns; the reference pairs them by order with all of the
    prompt's, which differs only when one sits outside a user turn)."""
    tokens = torch.tensor(pp.token_ids)
    user = user_positions(tokens, layout.im_start, layout.user)
    ids = tokens[user].tolist() + [layout.tts_pad] * 9
    blocks, seen, where = [], 0, user.tolist()
    for item in pp.items:
        if isinstance(item, (ImageItem, VideoItem)):
            seen_at = _block_start(pp.token_ids, rope, seen)
            if where[seen_at]:
                blocks.append(vision_blocks([item])[0])
            seen += 1
    return rope_positions(ids, blocks, rope)


def _block_start(ids: list[int], rope: RopeIds, index: int) -> int:
    """Prompt index of the `index`-th image/video block's <|vision_start|>."""
    starts = [i for i in range(len(ids) - 1) if ids[i] == rope.vision_start and ids[i + 1] in (rope.image, rope.video)]
    return starts[index]
