"""The cascade's ASR stage: each request's audio parts in, their transcripts out.

pocketsphinx decodes on the CPU one utterance at a time (no batching to gain): a step
transcribes the parts of one request, oldest first. Transcripts are kept by the audio's content
(the turns of a conversation are heard once, whatever number of requests carry them).

Streaming recognition: a Realtime turn still being spoken arrives as `partial` jobs (the
server's streamed-input warm-ups, about every second of speech, each holding the turn so far:
a prefix, bit for bit, of the final audio). Its last part is fed to a listener (a decoder of
its own) as it comes, so when the turn is committed only the last second is left to hear
(measured on a 5 s utterance: 0.1 s after the end instead of 0.5 s). A listener is found again
by what it has heard (its samples' digest against the new audio's prefix); up to
`max_listeners` streams are heard at once, the least recently fed gives way to a new one."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict, deque

import numpy as np
import torch

from omnistage.models.cascade.messages import HearJob, Transcripts
from omnistage.models.cascade.speech_tools import Listener, PocketsphinxASR
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage

log = logging.getLogger(__name__)
CACHE_ENTRIES = 64


class ASRStage(Stage):
    def __init__(self, name: str, asr: PocketsphinxASR, max_listeners: int = 4):
        self.name, self.asr, self.max_listeners = name, asr, max_listeners
        self.dead: str | None = None
        self._jobs: deque[HearJob] = deque()
        self._heard: OrderedDict[str, str] = OrderedDict()     # content digest -> transcript
        self._listeners: list[Listener] = []                   # least recently fed first

    def add(self, message: HearJob) -> None:
        self._jobs.append(message)

    def step(self) -> list[StageOutput]:
        if not self._jobs:
            return []
        job = self._jobs.popleft()
        parts = [a.detach().to(torch.float32).contiguous().numpy() for a in job.audio]
        try:
            texts = [self._hear(a, streaming=job.partial and i == len(parts) - 1) for i, a in enumerate(parts)]
        except Exception as e:      # whatever the decoder did: this request only, never the engine
            log.exception("asr: request %s failed", job.request_id)
            return [StageOutput(self.name, job.request_id,
                                StageFailure(job.request_id, f"the ASR failed: {e}"), final=True)]
        return [StageOutput(self.name, job.request_id, Transcripts(job.request_id, texts))]

    def _hear(self, samples: np.ndarray, streaming: bool) -> str:
        key = hashlib.blake2b(samples.tobytes(), digest_size=16).hexdigest()
        if key in self._heard:
            self._heard.move_to_end(key)
            return self._heard[key]
        listener = self._listener_for(samples, create=streaming)
        if listener is not None:
            listener.feed(samples[listener.fed:])
            self._listeners.remove(listener)
            if streaming:                           # keep listening: the turn goes on
                self._listeners.append(listener)
                return ""
            text = listener.finish()
            listener.restart()
            self._listeners.insert(0, listener)     # free: the first to be taken again
        else:
            text = self.asr.recognize(samples)
        self._heard[key] = text
        if len(self._heard) > CACHE_ENTRIES:
            self._heard.popitem(last=False)
        return text

    def _listener_for(self, samples: np.ndarray, create: bool) -> Listener | None:
        """The listener that heard the start of `samples`; for a stream, else a free one (or a
        new one, or the least recently fed)."""
        for listener in reversed(self._listeners):
            if listener.fed and listener.matches(samples):
                return listener
        if not create:
            return None
        free = next((x for x in self._listeners if not x.fed), None)
        if free is not None:
            return free
        if len(self._listeners) < self.max_listeners:
            self._listeners.append(self.asr.listener())
            return self._listeners[-1]
        oldest = self._listeners[0]
        oldest.finish()                             # abandoned: a turn that was never committed
        oldest.restart()
        return oldest

    @property
    def listening(self) -> int:
        """Streams being heard as they arrive (turns not committed yet)."""
        return sum(1 for x in self._listeners if x.fed)

    def abort(self, request_id: str) -> None:
        self._jobs = deque(j for j in self._jobs if j.request_id != request_id)

    def has_work(self) -> bool:
        return bool(self._jobs)

    def num_requests(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Nothing outside this process to release."""
