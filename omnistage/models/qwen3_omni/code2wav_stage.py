"""The code2wav stage: codec frames in, PCM chunks out, many requests per batched pass.

Each request's frames are decoded chunk by chunk as they arrive, as transformers'
`chunked_decode` decodes a chunk: the window of the chunk's frames plus up to `left_context`
frames before it, the context's samples dropped (Code2Wav.decode_windows); `seamless` (the
default) emits each later chunk from trimmed_samples earlier, so the chunks join into the
whole-utterance waveform instead of leaving chunked_decode's 23 ms gap at each boundary. The chunk sizes
grow: `first_chunk` frames, then `growth` times larger up to `max_chunk`, so a request's first audio needs
only its first few frames while later chunks pay the left context's recomputation over more
output. When the talker has finished, the frames left over go out as one last chunk.

A step decodes the next chunk of the requests that have enough frames for it, requests
waiting for their first audio first, then the oldest, within `frame_budget` window frames
(windows of equal length share a forward): under load a step stays short, so the thinker and
the talker keep their pace and a newcomer's first chunk never waits behind long windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.models.qwen2_5_omni.messages import AudioChunk
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavWindow
from omnistage.models.qwen3_omni.messages import CodecFrames
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage


@dataclass(frozen=True)
class Code2WavSettings:
    first_chunk: int = 2         # frames of a request's first chunk (0.16 s of speech at 12.5 Hz)
    growth: int = 3              # each chunk this many times the one before (2, 6, 18, 54, ...)
    max_chunk: int = 64          # ... up to this; every chunk recomputes its context: fewer,
                                 # larger later chunks cost less (6 s of speech: 110 frames
                                 # decoded for 75 at growth 3, 147 at growth 2)
    left_context: int = 25       # frames of context before each chunk (transformers' default)
    # Window frames (context included) decoded per step, first chunks first (at least one
    # chunk): a step stays short, so the thinker and talker keep their pace under load.
    frame_budget: int = 192
    # True: the chunks join without gaps into the whole decode's waveform (what transformers'
    # generate returns for answers up to its 300-frame chunk); False: each chunk as
    # transformers' chunked_decode emits it (23 ms of the timeline dropped at every boundary).
    seamless: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.first_chunk <= self.max_chunk or self.left_context < 0 or self.growth < 1:
            raise ValueError(f"code2wav chunking needs 1 <= first_chunk <= max_chunk, growth >= 1 "
                             f"and left_context >= 0; got {self}")

    def chunk(self, index: int) -> int:
        """Frames of a request's chunk number `index` (0-based)."""
        return min(self.max_chunk, self.first_chunk * self.growth ** min(index, 30))


@dataclass
class _Stream:
    frames: list[torch.Tensor] = field(default_factory=list)   # (G, n) pieces as they came
    total: int = 0                       # frames received
    done: int = 0                        # frames decoded
    chunks: int = 0                      # chunks decoded
    finished: bool = False               # the talker sent its last frames

    def codes(self) -> torch.Tensor:
        if len(self.frames) > 1:
            self.frames = [torch.cat(self.frames, dim=1)]
        return self.frames[0]


class Code2WavStage(Stage):
    def __init__(self, name: str, model: Code2Wav, settings: Code2WavSettings = Code2WavSettings(),
                 sample_rate: int = 24000):
        self.name, self.model, self.settings, self.sample_rate = name, model, settings, sample_rate
        self.dead: str | None = None
        self._streams: dict[str, _Stream] = {}

    def add(self, message: CodecFrames) -> None:
        s = self._streams.setdefault(message.request_id, _Stream())
        if message.codes.numel():
            s.frames.append(message.codes)
            s.total += message.codes.shape[1]
        s.finished = s.finished or message.finished

    def _next_end(self, s: _Stream) -> int | None:
        """Where the stream's next chunk ends, or None if it is not ready yet."""
        want = s.done + self.settings.chunk(s.chunks)
        if s.total >= want:
            return want
        if s.finished and s.total > s.done:
            return s.total
        return None

    def _ready(self) -> list[tuple[str, int | None]]:
        """(request, chunk end, or None: only its end to report) for every stream with work,
        first chunks first, then oldest stream first."""
        out = []
        for rid, s in self._streams.items():
            end = self._next_end(s)
            if end is not None or (s.finished and s.done == s.total):
                out.append((rid, end))
        return sorted(out, key=lambda r: self._streams[r[0]].chunks > 0)

    def _pick(self) -> list[tuple[str, int | None]]:
        """This step's share of the ready work: within `frame_budget` window frames."""
        picked, spent = [], 0
        for rid, end in self._ready():
            if end is not None:
                s = self._streams[rid]
                cost = end - s.done + min(self.settings.left_context, s.done)
                if picked and spent + cost > self.settings.frame_budget:
                    continue
                spent += cost
            picked.append((rid, end))
        return picked

    def step(self) -> list[StageOutput]:
        ready = self._pick()
        chunks = [(rid, end) for rid, end in ready if end is not None]
        windows = [Code2WavWindow(self._streams[rid].codes(), self._streams[rid].done, end,
                                  self.settings.left_context, self.settings.seamless) for rid, end in chunks]
        pcm = dict(zip((rid for rid, _ in chunks), self.model.decode_windows(windows) if windows else []))
        out = []
        for rid, end in ready:
            s = self._streams[rid]
            if end is not None:
                s.done, s.chunks = end, s.chunks + 1
            last = s.finished and s.done == s.total
            samples = pcm[rid].float().cpu() if rid in pcm else torch.zeros(0)
            out.append(StageOutput(self.name, rid, AudioChunk(rid, samples, self.sample_rate, last), final=last))
            if last:
                del self._streams[rid]
        return out

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._ready())

    def num_requests(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Nothing outside this process to release."""
