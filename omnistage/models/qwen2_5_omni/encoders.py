"""Qwen2.5-Omni's encoder stage body: one audio-tower call and one vision-tower call per
step, over every media item of every request in the batch."""

from __future__ import annotations

import torch

from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen2_5_omni.messages import EncodedMedia, EncodeJob
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder


class OmniEncoders:
    def __init__(self, audio: AudioEncoder, vision: Qwen2_5OmniVisionEncoder, device: torch.device):
        self.audio, self.vision, self.device = audio, vision, device

    def cost(self, job: EncodeJob) -> int:
        """Audio feature frames + vision patches."""
        n = 0
        for m in job.media:
            n += m.features.shape[-1] if m.kind == "audio" else m.features.shape[0]
            if m.video_audio is not None:
                n += m.video_audio.shape[-1]
        return n

    @torch.inference_mode()
    def encode(self, jobs: list[EncodeJob]) -> list[EncodedMedia]:
        audio_in, vision_in, grids = [], [], []
        for job in jobs:
            for m in job.media:
                if m.kind == "audio":
                    audio_in.append(m.features.to(self.device))
                else:
                    vision_in.append(m.features.to(self.device))
                    grids.append(tuple(m.grid_thw))
                    if m.video_audio is not None:
                        audio_in.append(m.video_audio.to(self.device))
        audio_out = iter(self.audio(audio_in) if audio_in else [])
        vision_out = iter(self.vision(vision_in, grids) if vision_in else [])
        outs = []
        for job in jobs:
            enc = EncodedMedia(job.request_id, [], [], [])
            for m in job.media:        # same walk as above: outputs come back in this order
                if m.kind == "audio":
                    enc.audio.append(next(audio_out))
                else:
                    (enc.image if m.kind == "image" else enc.video).append(next(vision_out))
                    if m.video_audio is not None:
                        enc.audio.append(next(audio_out))
            outs.append(enc)
        return outs
