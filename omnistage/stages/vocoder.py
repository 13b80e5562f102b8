"""The vocoder stage: codec tokens in, PCM chunks out, many requests per batched pass.

Each request owns a Token2WavStream (bounded state: the codes and mel its next window needs).
A step decodes one chunk of each of several streams that have enough codes (chunk +
look-ahead, or the tail once the talker finished) in one batched ODE solve, so a request's
first audio comes after its first chunk of codes, not after the whole answer.

A step takes windows up to `frame_budget` mel frames (at least one): streams still waiting for
their first audio first, then the others oldest first. Short steps let the thinker and talker
run in between, and a new request's first chunk never waits behind older requests' later ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from omnistage.models.qwen2_5_omni.messages import AudioChunk, CodecChunk
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.token2wav_stream import (StreamConfig, Token2WavStream,
                                                     step_streams)
from omnistage.stages.base import StageOutput


@dataclass
class VocoderSettings:
    steps: int = 10                      # ODE steps (RK4) per chunk
    guidance_scale: float = 0.5
    stream: StreamConfig | None = None   # None: the DiT's own block reach (StreamConfig.for_dit)
    seed: int = 0                        # unseeded request i draws noise from seed + i
    frame_budget: int = 1536             # mel frames of DiT windows per step (at least one window)
    # Opt-in speed for quality: the DiT's matmuls in bfloat16 (~1.4x on CPUs with bf16 units;
    # mel within ~0.2% RMS of float32). Off: outputs match the reference (float32).
    bf16_dit: bool = False


class VocoderStage:
    def __init__(self, name: str, model: Token2Wav, speakers: dict, settings: VocoderSettings,
                 noise_for: Callable[[str], torch.Tensor | torch.Generator] | None = None):
        """`speakers`: name -> object with .cond (1, E) and .ref_mel (1, R, M). `noise_for`
        (tests) gives a request's ODE start noise; default: a seeded generator per request."""
        self.name, self.model, self.speakers, self.settings = name, model, speakers, settings
        self.dead: str | None = None   # local stages fail with the process
        self.noise_for = noise_for
        self._streams: dict[str, Token2WavStream] = {}
        self._count = 0
        self.sample_rate = 24000

    def _open(self, rid: str, speaker: str, seed: int | None) -> Token2WavStream:
        spk = self.speakers[speaker]
        if self.noise_for is not None:
            noise = self.noise_for(rid)
        else:   # a request's seed makes its audio the same whatever shares the batch
            if seed is None:
                seed = self.settings.seed + self._count
                self._count += 1
            noise = torch.Generator(device=self.model.device).manual_seed(seed)
        return Token2WavStream(self.model, spk.cond, spk.ref_mel, noise, self.settings.stream,
                               steps=self.settings.steps, guidance_scale=self.settings.guidance_scale)

    def add(self, chunk: CodecChunk) -> None:
        s = self._streams.get(chunk.request_id)
        if s is None:
            s = self._streams[chunk.request_id] = self._open(chunk.request_id, chunk.speaker, chunk.seed)
        if chunk.codes:
            s.feed(chunk.codes)
        if chunk.finished:
            s.end()

    def _pick(self) -> list[str]:
        """This step's streams: first-audio-pending before the rest, each group oldest first,
        within the frame budget; streams with only a tail to flush cost nothing."""
        chosen, spent = [], 0
        busy = [r for r, s in self._streams.items() if s.has_work() or s.finishing]
        for rid in sorted(busy, key=lambda r: self._streams[r].num_chunks > 0):   # stable sort
            s = self._streams[rid]
            cost = s.window_frames() if s.ready() else 0
            if cost and chosen and spent + cost > self.settings.frame_budget:
                continue
            chosen.append(rid)
            spent += cost
        return chosen

    def step(self) -> list[StageOutput]:
        rids = self._pick()
        streams = [self._streams[r] for r in rids]
        with torch.inference_mode():
            pcm = step_streams(streams)   # one batched solve; ended streams flush their tail
        out = []
        for rid, s, p in zip(rids, streams, pcm):
            done = s.finishing and not s.has_work()
            if p is None and not done:
                continue
            samples = p.float().cpu() if p is not None else torch.zeros(0)
            out.append(StageOutput(self.name, rid, AudioChunk(rid, samples, self.sample_rate, done),
                                   final=done))
            if done:
                self.abort(rid)
        return out

    def abort(self, request_id: str) -> None:
        s = self._streams.pop(request_id, None)
        if s is not None:
            s.close()

    def has_work(self) -> bool:
        return any(s.has_work() or s.finishing for s in self._streams.values())

    def num_requests(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Nothing outside this process to release."""
