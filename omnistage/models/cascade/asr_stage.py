"""The cascade's ASR stage: each request's audio parts in, their transcripts out.

pocketsphinx decodes on the CPU one utterance at a time (no batching to gain): a step
transcribes the parts of one request, oldest first, so a long recording never holds up the
other stages for more than one request's audio. Transcripts are kept by the audio's content
(a Realtime turn's streamed-input warm-up and its answer hear the same samples once)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch

from omnistage.models.cascade.messages import HearJob, Transcripts
from omnistage.models.cascade.speech_tools import PocketsphinxASR
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage

CACHE_ENTRIES = 64


class ASRStage(Stage):
    def __init__(self, name: str, asr: PocketsphinxASR):
        self.name, self.asr = name, asr
        self.dead: str | None = None
        self._jobs: deque[HearJob] = deque()
        self._heard: OrderedDict[str, str] = OrderedDict()     # content digest -> transcript

    def add(self, message: HearJob) -> None:
        self._jobs.append(message)

    def step(self) -> list[StageOutput]:
        if not self._jobs:
            return []
        job = self._jobs.popleft()
        texts = [self._hear(a) for a in job.audio]
        return [StageOutput(self.name, job.request_id, Transcripts(job.request_id, texts))]

    def _hear(self, audio: torch.Tensor) -> str:
        samples = audio.detach().to(torch.float32).contiguous().numpy()
        key = hashlib.blake2b(samples.tobytes(), digest_size=16).hexdigest()
        if key not in self._heard:
            self._heard[key] = self.asr.recognize(samples)
            if len(self._heard) > CACHE_ENTRIES:
                self._heard.popitem(last=False)
        self._heard.move_to_end(key)
        return self._heard[key]

    def abort(self, request_id: str) -> None:
        self._jobs = deque(j for j in self._jobs if j.request_id != request_id)

    def has_work(self) -> bool:
        return bool(self._jobs)

    def num_requests(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Nothing outside this process to release."""
