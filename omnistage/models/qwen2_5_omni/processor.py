"""Qwen2.5-Omni requests in: a prompt (text, chat with audio/image/video parts, or token ids)
becomes expanded token ids, TMRoPE positions and preprocessed media (an OmniRequest's body).

Chat content parts (OpenAI names first):
  {"type": "text", "text": str}
  {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"|"mp3"|...}}
  {"type": "audio", "audio": float32 numpy array at 16 kHz | encoded bytes}
  {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}
  {"type": "image", "image": PIL.Image | encoded bytes}
  {"type": "video_url", "video_url": {"url": "data:video/...;base64,..."}}
  {"type": "video", "video": encoded bytes}
Remote URLs are refused: media arrive inline. Every decoder enforces `MediaLimits` while it
decodes, so an oversized input is rejected early, never decoded whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnistage.chat_messages import check_messages
from omnistage.chat_tools import tools_for_template
from omnistage.errors import InvalidRequestError
from omnistage.media.audio import decode_audio, decode_base64, decode_pcm16
from omnistage.media.image import decode_image, parse_data_url
from omnistage.media.video import VideoLimits, decode_video
from omnistage.models.qwen2_5_omni.audio_features import LogMelExtractor
from omnistage.models.qwen2_5_omni.messages import MediaInput
from omnistage.models.qwen2_5_omni.prompt import DEFAULT_SYSTEM_PROMPT, audio_item, expand_prompt
from omnistage.models.qwen2_5_omni.rope_index import (ImageItem, MRopePositions, OmniLayout,
                                                      VideoItem, mrope_positions,
                                                      talker_prompt_positions)
from omnistage.models.qwen2_5_omni.vision_preprocess import (VisionPreprocessConfig,
                                                             preprocess_image, preprocess_video)

# What input_audio.format may name (OpenAI: wav, mp3). Files are recognised from their bytes;
# pcm16 is headerless 16-bit mono at 24 kHz.
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm", "pcm16")
MEDIA_TYPES = ("input_audio", "audio", "audio_url", "image_url", "image", "video_url", "video")


@dataclass(frozen=True)
class MediaLimits:
    max_audio_seconds: float = 300.0       # per clip (the feature extractor's own cap)
    max_image_pixels: int = 4096 * 4096    # per image, checked from the header
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000         # source frames decoded
    max_media_bytes: int = 64 << 20        # one inline item, after base64 decoding


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    media: list[MediaInput]
    positions: MRopePositions
    talker_positions: MRopePositions
    items: tuple = ()              # the rope-index media descriptors, in prompt order


class OmniProcessor:
    def __init__(self, tokenizer, layout: OmniLayout, vision: VisionPreprocessConfig,
                 limits: MediaLimits = MediaLimits()):
        self.tokenizer = tokenizer
        self.layout = layout
        self.vision = vision
        self.limits = limits
        self.log_mel = LogMelExtractor()

    def __call__(self, prompt, want_audio: bool, use_audio_in_video: bool = False) -> ProcessedPrompt:
        text, ids, audios, images, videos = None, None, [], [], []
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
                raise InvalidRequestError("prompt_token_ids must be a non-empty list of integers",
                                          param="prompt_token_ids")
        elif isinstance(prompt, dict) and "messages" in prompt:
            tools_for_template(self.tokenizer, prompt.get("tools"))   # refuses tools it cannot render
            return self(prompt["messages"], want_audio, use_audio_in_video)
        elif isinstance(prompt, list):
            check_messages(prompt, MEDIA_TYPES)
            messages = self._with_system_prompt(prompt, want_audio)
            audios, images, videos = self._media(messages, use_audio_in_video)
            text = self.tokenizer.apply_chat_template(
                [self._template_view(m) for m in messages], tokenize=False, add_generation_prompt=True)
        else:
            raise InvalidRequestError("a prompt must be a string, a list of chat messages or a dict "
                                      "with prompt_token_ids / messages", param="prompt")
        expanded = expand_prompt(text if ids is None else list(ids), self.layout,
                                 audios=[a[1] for a in audios], images=[i[1] for i in images],
                                 videos=[v[1] for v in videos], tokenizer=self.tokenizer)
        pos = mrope_positions(expanded.token_ids, expanded.media, self.layout)
        # Media in prompt order, so each modality's encoder rows line up with its placeholders
        # (a video's own audio sits where the video is).
        by_item = {id(item): inp for inp, item in audios + images + videos}
        media = [by_item[id(item)] for item in expanded.media]
        return ProcessedPrompt(text, expanded.token_ids, media, pos, talker_prompt_positions(pos),
                               expanded.media)

    # ---- chat -----------------------------------------------------------------------------
    @staticmethod
    def _with_system_prompt(messages: list, want_audio: bool) -> list:
        """Speech output needs the model's own system prompt (see prompt.DEFAULT_SYSTEM_PROMPT)."""
        if want_audio and messages[0].get("role") != "system":
            return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *messages]
        return messages

    @staticmethod
    def _template_view(m: dict) -> dict:
        """The message as the chat template reads it: media parts reduced to their type."""
        content = m.get("content")
        if not isinstance(content, list):
            return m
        kinds = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}
        parts = [p if p.get("type") == "text" else {"type": kinds.get(p["type"], p["type"])}
                 for p in content]
        return {**m, "content": parts}

    def _media(self, messages: list, use_audio_in_video: bool):
        audios, images, videos = [], [], []
        for i, m in enumerate(messages):
            for part in m.get("content") if isinstance(m.get("content"), list) else []:
                kind, where = part.get("type"), f"messages[{i}].content"
                if kind in ("input_audio", "audio", "audio_url"):
                    audios.append(self._audio(part, where))
                elif kind in ("image_url", "image"):
                    images.append(self._image(part, where))
                elif kind in ("video_url", "video"):
                    videos.append(self._video(part, where, use_audio_in_video))
        return audios, images, videos

    def _bytes_of(self, part: dict, key: str, where: str) -> bytes:
        return part_bytes(part, key, where, self.limits)

    def _audio(self, part: dict, where: str):
        samples = audio_part_samples(part, where, self.limits)
        feats = self.log_mel([samples], param=where)
        return (MediaInput("audio", feats.features[0]), audio_item(feats.num_frames[0]))

    def _image(self, part: dict, where: str):
        value = part.get("image")
        if value is not None and hasattr(value, "convert"):     # a PIL image
            image = value.convert("RGB")
            if image.width * image.height > self.limits.max_image_pixels:
                raise InvalidRequestError(f"{where}: the image has more than "
                                          f"{self.limits.max_image_pixels} pixels", param=where)
        else:
            key = "image_url" if part["type"] == "image_url" else "image"
            image = decode_image(self._bytes_of(part, key, where),
                                 max_pixels=self.limits.max_image_pixels, param=where)
        patches = preprocess_image(image, self.vision, param=where)
        return (MediaInput("image", patches.pixel_values, patches.grid_thw), ImageItem(patches.grid_thw))

    def _video(self, part: dict, where: str, with_audio: bool):
        key = "video_url" if part["type"] == "video_url" else "video"
        limits = VideoLimits(max_frames=self.limits.max_video_frames,
                             max_seconds=self.limits.max_video_seconds)
        video = decode_video(self._bytes_of(part, key, where), limits=limits,
                             with_audio=with_audio, param=where)
        patches = preprocess_video(video.frames, video.fps, self.vision, param=where)
        audio_feats, audio = None, None
        if with_audio and video.audio is not None and video.audio.size:
            feats = self.log_mel([video.audio], param=where)
            audio_feats, audio = feats.features[0], audio_item(feats.num_frames[0])
        item = VideoItem(patches.grid_thw, patches.second_per_grid, audio=audio)
        return (MediaInput("video", patches.pixel_values, patches.grid_thw, video_audio=audio_feats), item)


def part_bytes(part: dict, key: str, where: str, limits: MediaLimits) -> bytes:
    """A media part's encoded bytes: inline bytes or a data: URL (URLs are resolved, if the
    server allows them, before the engine sees the messages)."""
    value = part.get(key)
    if isinstance(value, dict) and key.endswith("_url"):
        value = value.get("url")
    if isinstance(value, str):
        if not value.startswith("data:"):
            raise InvalidRequestError(f"{where}: media URLs are not fetched; send the media "
                                      f"inline as a data: URL (base64)", param=where)
        value = parse_data_url(value, param=where, max_bytes=limits.max_media_bytes).data
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(f"{where}: {key} must be bytes or a data: URL", param=where)
    if len(value) > limits.max_media_bytes:
        raise InvalidRequestError(f"{where}: media of {len(value)} bytes is over the "
                                  f"{limits.max_media_bytes}-byte limit", param=where)
    return bytes(value)


def audio_part_samples(part: dict, where: str, limits: MediaLimits) -> np.ndarray:
    """An audio content part (input_audio, audio bytes / array / data URL, audio_url) as float32
    mono samples at 16 kHz, within the limits."""
    if part["type"] == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, dict) or not isinstance(body.get("data"), str):
            raise InvalidRequestError(f"{where}: input_audio needs {{'data': base64, 'format': ...}}",
                                      param=where)
        fmt = body.get("format", "wav")
        if fmt not in INPUT_AUDIO_FORMATS:
            raise InvalidRequestError(f"{where}: input_audio.format must be one of "
                                      f"{', '.join(INPUT_AUDIO_FORMATS)}; got {fmt!r}", param=where)
        raw = decode_base64(body["data"], param=where)
        if fmt == "pcm16":   # headerless 16-bit mono at 24 kHz (the Realtime API's convention)
            samples = decode_pcm16(raw, input_rate=24000, max_seconds=limits.max_audio_seconds,
                                   param=where).samples
        else:
            samples = decode_audio(raw, max_seconds=limits.max_audio_seconds, param=where).samples
    elif isinstance(part.get("audio"), np.ndarray):
        samples = np.asarray(part["audio"], dtype=np.float32)
        if samples.ndim != 1 or samples.size / 16000 > limits.max_audio_seconds:
            raise InvalidRequestError(f"{where}: audio arrays must be 1-D float32 at 16 kHz, at most "
                                      f"{limits.max_audio_seconds:g} s", param=where)
    else:
        key = "audio_url" if part["type"] == "audio_url" else "audio"
        samples = decode_audio(part_bytes(part, key, where, limits),
                               max_seconds=limits.max_audio_seconds, param=where).samples
    return samples
