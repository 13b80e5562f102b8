"""Qwen3-Omni's encoder stage body: per request in the step's batch, its audio clips through the
AuT tower (one computation per clip) and its images/videos through the vision tower (one per
item), so a request's embeddings are the same bits alone or in any batch."""

from __future__ import annotations

import torch

from omnistage.models.qwen2_5_omni.messages import EncodeJob
from omnistage.models.qwen3_omni.messages import EncodedMedia
from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder


class Qwen3OmniEncoders:
    def __init__(self, audio: Qwen3OmniAudioEncoder, vision: Qwen3OmniVisionEncoder, device: torch.device):
        self.audio, self.vision, self.device = audio, vision, device

    def cost(self, job: EncodeJob) -> int:
        """Audio feature frames + vision patches."""
        return sum(m.features.shape[-1] if m.kind == "audio" else m.features.shape[0] for m in job.media)

    @torch.inference_mode()
    def encode(self, jobs: list[EncodeJob]) -> list[EncodedMedia]:
        return [self._encode_one(job) for job in jobs]

    def _encode_one(self, job: EncodeJob) -> EncodedMedia:
        audio = [m.features.to(self.device) for m in job.media if m.kind == "audio"]
        enc = EncodedMedia(job.request_id, self.audio(audio) if audio else [], [], [], [], [])
        for m in job.media:
            if m.kind != "audio":
                embeds, deepstack = self.vision.encode_item(m.features.to(self.device), tuple(m.grid_thw))
                (enc.image if m.kind == "image" else enc.video).append(embeds)
                (enc.image_deepstack if m.kind == "image" else enc.video_deepstack).append(torch.stack(deepstack))
        return enc
