"""Qwen3-Omni's encoder stage body: per request in the step's batch, its audio clips through the
AuT tower (attention window by window, remembered in an EncoderCache) and its images/videos
through the vision tower (one per item), so a request's embeddings are the same bits alone or
in any batch."""

from __future__ import annotations

from functools import partial

import torch

from omnistage.models.qwen2_5_omni.messages import EncodeJob
from omnistage.models.qwen3_omni.messages import EncodedMedia
from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder
from omnistage.stages.encoder_cache import EncoderCache


class Qwen3OmniEncoders:
    def __init__(self, audio: Qwen3OmniAudioEncoder, vision: Qwen3OmniVisionEncoder,
                 device: torch.device, cache_windows: int = 64):
        self.audio, self.vision, self.device = audio, vision, device
        self.cache = EncoderCache(cache_windows)

    def cost(self, job: EncodeJob) -> int:
        """Audio feature frames + vision patches."""
        return sum(m.features.shape[-1] if m.kind == "audio" else m.features.shape[0] for m in job.media)

    @torch.inference_mode()
    def encode(self, jobs: list[EncodeJob]) -> list[EncodedMedia]:
        return [self._encode_one(job) for job in jobs]

    def _encode_one(self, job: EncodeJob) -> EncodedMedia:
        audio = [self.encode_audio(m.features.to(self.device)) for m in job.media if m.kind == "audio"]
        enc = EncodedMedia(job.request_id, audio, [], [], [], [])
        for m in job.media:
            if m.kind != "audio":
                embeds, deepstack = self.vision.encode_item(m.features.to(self.device), tuple(m.grid_thw))
                (enc.image if m.kind == "image" else enc.video).append(embeds)
                (enc.image_deepstack if m.kind == "image" else enc.video_deepstack).append(torch.stack(deepstack))
        return enc

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """(mel, T) -> (num_audio_tokens(T), out): one attention window (n_window_infer frames
        of whole chunks) at a time, through the cache. Convolutions stay inside a chunk and
        attention inside a window, so the audio's rows are its windows' rows joined (a window
        is computed alone either way: its bits do not depend on a hit)."""
        longer = features.shape[1] > self.audio.chunk_frames
        encode = partial(self.audio.encode_window, in_longer_audio=longer)
        return self.cache.pieces(features, self.audio.window_frames, encode, tag=f"in_longer={longer}")
