"""The code2wav stage: codec frames in, PCM chunks out, many requests per batched pass.

Each request's frames are decoded chunk by chunk as they arrive, as transformers'
`chunked_decode` decodes a chunk: the window of the chunk's frames plus up to `left_context`
frames before it, the context's samples dropped (Code2Wav.decode_windows); `seamless` (the
default) emits each later chunk from trimmed_samples earlier, so the chunks join into the
whole-utterance waveform instead of leaving chunked_decode's 23 ms gap at each boundary. The chunk sizes
grow: `first_chunk` frames, then `growth` times larger up to `max_chunk`, so a request's first audio needs
only its first few frames while later chunks pay the left context's recomputation over more
output. When the talker has finished, the frames left over go out as one last chunk.

Growing chunks alone let the listener run dry: with first chunks of 2 frames, after 2 + 6 + 18
frames (2.1 s of speech) the next chunk of 54 frames (4.3 s) took longer to produce than 2.1 s
of playing (measured at concurrency 1: a 0.9 s silence); and a 2-frame first chunk (0.14 s)
ran out before the next 6 frames came (hence 4). So a stream also has a playback deadline: from its first
chunk on, the stage keeps count of the speech it sent against the time since; when the client
has less than `playback_margin_s` left to play (or already ran dry), the frames the stream has
go out at once, and such streams are decoded before the others, the closest to running dry
first. Two limits keep deadlines from costing throughput (each chunk recomputes `left_context`
frames; measured with 2-frame deadline chunks at 4 requests at once: 1.97 audio-s per wall-s
against 3.64 without deadlines):
- a deadline chunk has at least `deadline_chunk` frames and as many as the stream's previous
  chunk, so chunks never shrink and the context's share keeps falling;
- only a stream whose frames come at least as fast as they play has deadlines: when the
  machine serves more requests than it can in real time, small chunks cannot close the gap,
  and the growing chunks' throughput serves every stream best.

The last chunks of finished answers also wait while a newcomer gathers its first chunk's
frames (the router opens a request's stream when the request starts, so the stage knows it is
coming): when a wave of answers ends, their last chunks (65-90 ms steps at 8 requests) no
longer sit between the next requests' thinker and talker steps. A hold lasts at most
`max_hold_s`, and ends while a held listener has less than `hold_margin_s` left to play.
omni_e2e, 32 requests at concurrency 16, six A B pairs: first audio p95 0.32-0.39 -> 0.23-0.30
s, p50 3-7% lower, the same throughput, every listener still ahead of real time. Holding
answers still being spoken as well (all later chunks, as the Qwen2.5-Omni vocoder stage does)
was measured twice and not kept: listeners at 16 ran dry by up to 0.05 s (margins 0.6 and
1.0 s). Nor was a `frame_budget` of 96 (shorter steps): lower throughput, worse gaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from omnistage.models.qwen2_5_omni.messages import AudioChunk
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavWindow
from omnistage.models.qwen3_omni.messages import CodecFrames
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage
from omnistage.stages.hold import Hold
from omnistage.stages.playback import PlaybackClock


@dataclass(frozen=True)
class Code2WavSettings:
    first_chunk: int = 4         # frames of a request's first chunk (0.32 s of speech at 12.5 Hz)
    growth: int = 3              # each chunk this many times the one before (4, 12, 24, 24, ...)
    max_chunk: int = 24          # ... up to this (1.9 s of speech): a chunk's decoder recomputes
                                 # only its reach (~5 frames), so smaller chunks cost little more,
                                 # and a listener never waits for a long chunk's decode
    left_context: int = 25       # frames of context before each chunk (transformers' default)
    # Window frames (context included) decoded per step, first chunks first (at least one
    # chunk): a step stays short, so the thinker and talker keep their pace under load. 288
    # (eight answers' last chunks in one step, so the next requests of a closed loop of 8
    # start together) against 192: 32 requests at concurrency 16 (six A B pairs) 5% more
    # audio per second, first audio p95 lower, every listener still ahead of real time.
    frame_budget: int = 288
    # True: the chunks join without gaps into the whole decode's waveform (what transformers'
    # generate returns for answers up to its 300-frame chunk); False: each chunk as
    # transformers' chunked_decode emits it (23 ms of the timeline dropped at every boundary).
    seamless: bool = True
    # Seconds of sent speech the client must still have to play before the stage sends what a
    # stream has instead of waiting for the chunk size (see the module docstring); None: the
    # chunk sizes alone decide (the chunking is then a function of the frames only).
    playback_margin_s: float | None = 0.6
    # The fewest frames a deadline sends (0.32 s of speech at 12.5 Hz). 4, not 6, since the
    # time-major convolutions: a burst of 8 streams' second chunks then came before their first
    # ran out (worst gap at C=8 -0.07 / -0.07 / -0.04 / +0.01 s against +0.14 / +0.16 / +0.24 /
    # +0.08 s with 6, the same throughput); with the slower convolutions before, 4 lost.
    deadline_chunk: int = 4
    # Finished answers' last chunks wait while a stream gathers its first chunk (module
    # docstring), for at most max_hold_s, and not while a held listener has less than
    # hold_margin_s left to play. None: no hold.
    hold_margin_s: float | None = 0.6
    max_hold_s: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.first_chunk <= self.max_chunk or self.left_context < 0 or self.growth < 1:
            raise ValueError(f"code2wav chunking needs 1 <= first_chunk <= max_chunk, growth >= 1 "
                             f"and left_context >= 0; got {self}")
        if self.playback_margin_s is not None and not self.playback_margin_s >= 0:
            raise ValueError(f"code2wav playback_margin_s must be >= 0 or None; got {self.playback_margin_s}")
        if self.hold_margin_s is not None and (self.hold_margin_s < 0 or self.max_hold_s < 0):
            raise ValueError(f"code2wav hold_margin_s and max_hold_s must be >= 0; got "
                             f"{self.hold_margin_s} and {self.max_hold_s}")
        if self.deadline_chunk < 1:
            raise ValueError(f"code2wav deadline_chunk must be >= 1; got {self.deadline_chunk}")

    def chunk(self, index: int) -> int:
        """Frames of a request's chunk number `index` (0-based)."""
        return min(self.max_chunk, self.first_chunk * self.growth ** min(index, 30))


@dataclass
class _Stream:
    frames: list[torch.Tensor] = field(default_factory=list)   # (G, n) pieces as they came
    total: int = 0                       # frames received
    done: int = 0                        # frames decoded
    chunks: int = 0                      # chunks decoded
    last_chunk: int = 0                  # frames of the latest chunk
    finished: bool = False               # the talker sent its last frames
    first_frame: float | None = None     # clock time the first frames came
    playback: PlaybackClock = field(default_factory=PlaybackClock)

    def codes(self) -> torch.Tensor:
        if len(self.frames) > 1:
            self.frames = [torch.cat(self.frames, dim=1)]
        return self.frames[0]


class Code2WavStage(Stage):
    def __init__(self, name: str, model: Code2Wav, settings: Code2WavSettings = Code2WavSettings(),
                 sample_rate: int = 24000, clock: Callable[[], float] = time.monotonic):
        """`clock`: seconds, for the playback deadlines."""
        self.name, self.model, self.settings, self.sample_rate = name, model, settings, sample_rate
        self.clock = clock
        self.dead: str | None = None
        self._streams: dict[str, _Stream] = {}
        # finished answers' last chunks (see _held); margin None: never wanted
        self._hold = Hold(settings.max_hold_s, settings.hold_margin_s or 0.0)

    def warm_up(self) -> None:
        """Decode a full step's worth of windows once before serving, so the first requests
        do not pay for the heap pages a full step touches (a step's windows are bounded by
        frame_budget; host_memory=retain keeps those pages for every later step). Nothing
        else is built per shape: the convolutions are native or matrix products, never oneDNN
        (whose primitive per input shape once made a burst's first and second chunks 2-8x
        slower than the next burst's; a fresh stage's first burst of 8 now decodes as fast as
        its third, 63-67 ms a step on the small checkpoint, Zen 3)."""
        s, q = self.settings, self.model.config.num_quantizers
        full = torch.zeros(q, s.max_chunk, dtype=torch.long)
        window = Code2WavWindow(full, 0, s.max_chunk, s.left_context, s.seamless)
        self.model.decode_windows([window] * max(1, s.frame_budget // s.max_chunk))

    def add(self, message: CodecFrames) -> None:
        s = self._streams.setdefault(message.request_id, _Stream())
        if message.codes.numel():
            s.first_frame = self.clock() if s.first_frame is None else s.first_frame
            s.frames.append(message.codes)
            s.total += message.codes.shape[1]
        s.finished = s.finished or message.finished

    def _next_end(self, s: _Stream, now: float) -> int | None:
        """Where the stream's next chunk ends, or None if it is not ready yet."""
        want = s.done + self.settings.chunk(s.chunks)
        if s.total >= want:
            return want
        if s.finished and s.total > s.done:
            return s.total
        if self._due(s, now):
            return s.total                   # the deadline: what it has, now
        return None

    def _due(self, s: _Stream, now: float) -> bool:
        """Whether the stream's playback deadline sends what it has now (module docstring)."""
        margin = self.settings.playback_margin_s
        if margin is None or s.playback.left_to_play(now) >= margin:
            return False
        if s.total - s.done < max(s.last_chunk, self.settings.deadline_chunk):
            return False
        frame_s = self.model.config.samples_per_frame / self.sample_rate
        return s.total * frame_s >= now - s.first_frame       # its frames come as fast as they play

    def _ready(self, now: float) -> list[tuple[str, int | None]]:
        """(request, chunk end, or None: only its end to report) for every stream with work:
        first chunks first, then the streams closest to running dry."""
        out = []
        for rid, s in self._streams.items():
            end = self._next_end(s, now)
            if end is not None or (s.finished and s.done == s.total):
                out.append((rid, end))
        def order(r: tuple[str, int | None]) -> tuple[bool, float]:
            s = self._streams[r[0]]
            return s.chunks > 0, s.playback.left_to_play(now)
        return sorted(out, key=order)

    def _pick(self, stepping: bool = False) -> list[tuple[str, int | None]]:
        """This step's share of the ready work: within `frame_budget` window frames, held
        chunks left out. `stepping`: the step runs it (a hold that ran its
        course starts again after it)."""
        now = self.clock()
        ready = self._ready(now)
        held = set(self._held(ready, now, stepping))
        ready = [(rid, end) for rid, end in ready if rid not in held]
        picked, spent = [], 0
        for rid, end in ready:
            if end is not None:
                s = self._streams[rid]
                cost = end - s.done + min(self.settings.left_context, s.done)
                if picked and spent + cost > self.settings.frame_budget:
                    continue
                spent += cost
            picked.append((rid, end))
        return picked

    def _held(self, ready: list[tuple[str, int | None]], now: float, stepping: bool) -> list[str]:
        """The streams of `ready` whose chunks wait now for a newcomer's first chunk (module
        docstring): its _holdable ones while the hold holds, else none."""
        holdable, ends = self._holdable(ready), dict(ready)
        # A newcomer still short of its first chunk's frames. (Holding until that chunk is
        # decoded as well, so that its step takes no other chunks, did not pay: ~4% less
        # throughput at 16 requests at once.)
        gathering = any(s.chunks == 0 and not s.finished and ends.get(rid) is None
                        for rid, s in self._streams.items())
        wanted = self.settings.hold_margin_s is not None and gathering and bool(holdable)
        return holdable if self._hold.holds(wanted, self._least_left(holdable, now), now, stepping) else []

    def _least_left(self, rids: list[str], now: float) -> float:
        """The least speech a listener of `rids` has left to play (inf: none)."""
        return min((self._streams[rid].playback.left_to_play(now) for rid in rids), default=float("inf"))

    def _holdable(self, ready: list[tuple[str, int | None]]) -> list[str]:
        """The streams of `ready` that a hold keeps waiting: a later chunk of an answer the
        talker has finished (its listener has the most speech in hand; holding streams still
        being spoken let listeners at 16 requests run dry)."""
        return [rid for rid, end in ready
                if end is not None and self._streams[rid].chunks > 0 and self._streams[rid].finished]

    def step(self) -> list[StageOutput]:
        ready = self._pick(stepping=True)
        chunks = [(rid, end) for rid, end in ready if end is not None]
        windows = [Code2WavWindow(self._streams[rid].codes(), self._streams[rid].done, end,
                                  self.settings.left_context, self.settings.seamless) for rid, end in chunks]
        pcm = dict(zip((rid for rid, _ in chunks), self.model.decode_windows(windows) if windows else []))
        out, now = [], self.clock()
        for rid, end in ready:
            s = self._streams[rid]
            samples = pcm[rid].float().cpu() if rid in pcm else torch.zeros(0)
            if end is not None:
                s.done, s.chunks, s.last_chunk = end, s.chunks + 1, end - s.done
                s.playback.sent(samples.shape[0] / self.sample_rate, now)
            last = s.finished and s.done == s.total
            out.append(StageOutput(self.name, rid, AudioChunk(rid, samples, self.sample_rate, last), final=last))
            if last:
                del self._streams[rid]
        return out

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._pick())

    def wake_after(self) -> float | None:
        """Seconds until held chunks may go without new input (None: not holding): the hold's
        end, or a held listener's crossing of hold_margin_s."""
        if self._hold.since is None:
            return None
        now = self.clock()
        return self._hold.wake_after(self._least_left(self._holdable(self._ready(now)), now), now)

    def num_requests(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Nothing outside this process to release."""
