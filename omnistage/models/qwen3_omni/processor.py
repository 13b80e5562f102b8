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
from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.audio_features import LogMelConfig, LogMelExtractor
from omnistage.models.qwen2_5_omni.messages import MediaInput
from omnistage.models.qwen2_5_omni.processor import MEDIA_TYPES, MediaLimits, OmniProcessor
from omnistage.models.qwen2_5_omni.prompt import expand_prompt
from omnistage.models.qwen2_5_omni.rope_index import AudioItem, OmniLayout
from omnistage.models.qwen2_5_omni.vision_preprocess import VisionPreprocessConfig
from omnistage.models.qwen3_omni.audio_encoder import num_audio_tokens


@dataclass
class Qwen3Prompt:
    text: str | None
    token_ids: list[int]
    media: list[MediaInput]
    positions: torch.Tensor | None      # (3, P) int64; None: plain positions
    position_delta: int = 0
    items: tuple = ()                   # the media descriptors, in prompt order


class Qwen3OmniProcessor(OmniProcessor):
    def __init__(self, tokenizer, layout: OmniLayout, vision: VisionPreprocessConfig,
                 limits: MediaLimits, n_window: int):
        super().__init__(tokenizer, layout, vision, limits)
        self.log_mel = LogMelExtractor(LogMelConfig(max_samples=None, padding="longest"))
        self.n_window = n_window

    def __call__(self, prompt, want_audio: bool, use_audio_in_video: bool = False) -> Qwen3Prompt:
        if use_audio_in_video:
            raise InvalidRequestError("use_audio_in_video is not offered for Qwen3-Omni yet; send the "
                                      "video's sound as an audio part", param="use_audio_in_video")
        text, ids, audios, images, videos = None, None, [], [], []
        if isinstance(prompt, dict) and "messages" in prompt:
            prompt = prompt["messages"]
        if isinstance(prompt, list):
            check_messages(prompt, MEDIA_TYPES)
            audios, images, videos = self._media(prompt, False)
            text = self.tokenizer.apply_chat_template(
                [self._template_view(m) for m in prompt], tokenize=False, add_generation_prompt=True)
        else:
            text, ids = self._plain(prompt)
        if images or videos:
            raise InvalidRequestError("images and videos are not served by this Qwen3-Omni build yet; "
                                      "send text and audio", param="messages")
        expanded = expand_prompt(text if ids is None else list(ids), self.layout,
                                 audios=[a[1] for a in audios], tokenizer=self.tokenizer)
        return Qwen3Prompt(text, expanded.token_ids, [a[0] for a in audios], None, 0, expanded.media)

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
