"""Voice activity detection for the Realtime API's turn detection (server_vad, semantic_vad).

`SileroVad` is fed the session's 24 kHz pcm16 in chunks of any size and answers `VadEvent`s
("start", "stop") whose offsets count 24 kHz samples of the whole stream it was fed. It hears
speech, not loudness: the audio is resampled to 16 kHz as it comes (media/audio.py
StreamResampler: the same samples whatever the chunking) and every 32 ms window (WINDOW = 512
samples at 16 kHz = 768 at 24 kHz) gets the Silero model's speech probability
(media/silero.py). With the setting's VadConfig (server/turn_detection.py):

- a turn starts at `min_speech_ms` (two windows) of windows at or over `threshold` in a row;
  the start event's `speech` is the first of them, `at` is `prefix_padding_ms` before it (the
  turn's audio begins there; OpenAI's audio_start_ms);
- a window of a turn in progress under `release` (threshold - 0.15) is silence; the turn stops
  once the silence in a row reaches `pause_ms` (silence_duration_ms, or semantic_vad's rule);
  the stop event's `speech` is the end of the last speech window, `at` is where the silence
  confirmed it (the turn's audio ends there, silence included, as OpenAI's audio_end_ms).

Offsets are exact to a window (32 ms). Around the detector, `InputAudioBuffer` is the session's
input audio buffer that it cuts into turns.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from omnistage.media.audio import StreamResampler, pcm16_mono
from omnistage.media.silero import RATE as MODEL_RATE
from omnistage.media.silero import WINDOW, SileroState, SileroVadModel, load_silero
from omnistage.server.turn_detection import VadConfig


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["start", "stop"]
    at: int        # start: first sample of the turn's audio (speech minus padding, >= origin);
                   # stop: the sample where the turn's audio ends (speech + confirming silence)
    speech: int    # start: first sample of the first speech window; stop: end of the last one


class SileroLoader:
    """The server's one Silero model, loaded on first use (a session turning detection on),
    from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._model: SileroVadModel | None = None

    def get(self) -> SileroVadModel:
        with self._lock:
            if self._model is None:
                self._model = load_silero()
            return self._model


class SileroVad:
    """Feed pcm16 chunks in order; each `feed` answers the events its audio completed.

    Invariant: `_done` stream samples (whole windows past `origin`) were judged; the resampled
    samples after them wait in `_pending` for a whole window. Events alternate start, stop, ...
    """

    def __init__(self, model: SileroVadModel, cfg: VadConfig, rate: int = 24000, origin: int = 0):
        if (rate * WINDOW) % MODEL_RATE:
            raise ValueError(f"a {rate} Hz stream does not split into whole 32 ms windows")
        self.model, self.cfg, self.rate, self.origin = model, cfg, rate, origin
        self.frame = rate * WINDOW // MODEL_RATE           # stream samples per window
        self.frame_ms = 1000 * WINDOW // MODEL_RATE        # 32
        self.start_frames = max(1, math.ceil(cfg.min_speech_ms / self.frame_ms))
        self.padding = rate * cfg.prefix_padding_ms // 1000
        self._resampler = StreamResampler(rate, MODEL_RATE)
        self._state = SileroState()
        self._pending = np.zeros(0, np.float32)
        self._done = origin
        self.reset()

    @property
    def speaking(self) -> bool:
        return self._start is not None

    def reset(self) -> None:
        """Forgets the turn in progress (e.g. the client committed or cleared the buffer); the
        model's state and the unjudged samples are kept."""
        self._start: VadEvent | None = None  # the start event of the turn in progress
        self._run = 0                         # speech windows in a row, while not speaking
        self._quiet = 0                       # silent windows in a row, while speaking
        self._speech = 0                      # speech windows of the turn in progress

    def keep_from(self) -> int:
        """The first stream sample a future event may still point at: audio before it can go."""
        if self._start is not None:
            return self._start.at
        pending = self._done - self._run * self.frame     # onset of a run not yet long enough
        return max(self.origin, pending - self.padding)

    def feed(self, pcm: bytes) -> list[VadEvent]:
        x = self._resampler.feed(pcm16_mono(pcm))
        self._pending = np.concatenate([self._pending, x])
        n = self._pending.size // WINDOW
        windows = self._pending[:n * WINDOW].reshape(n, WINDOW)
        self._pending = self._pending[n * WINDOW:]
        events = []
        for p in self.model.probabilities(windows, self._state).tolist():
            ev = self._judge(p)
            if ev is not None:
                events.append(ev)
        return events

    def _judge(self, p: float) -> VadEvent | None:
        """One window (the one starting at `_done`) with speech probability `p`."""
        self._done += self.frame
        if self._start is None:
            self._run = self._run + 1 if p >= self.cfg.threshold else 0
            if self._run < self.start_frames:
                return None
            speech = self._done - self._run * self.frame
            self._start = VadEvent("start", max(self.origin, speech - self.padding), speech)
            self._speech, self._run, self._quiet = self._run, 0, 0
            return self._start
        if p >= self.cfg.release:
            self._speech += self._quiet + 1     # a pause that did not end the turn is part of it
            self._quiet = 0
            return None
        self._quiet += 1
        pause_ms = self.cfg.pause_ms(self._speech * self.frame_ms)
        if self._quiet * self.frame_ms < pause_ms:
            return None
        quiet = self._quiet
        self.reset()
        return VadEvent("stop", self._done, self._done - quiet * self.frame)


class InputAudioBuffer:
    """A Realtime session's input audio buffer (pcm16, appended, not yet committed), which an
    optional detector cuts into turns. Offsets count every sample ever appended; `start` is
    the offset of pcm[0]. With a detector, audio no future turn can reach (silence before the
    prefix padding) is dropped as it comes, so between turns the buffer stays small."""

    def __init__(self, rate: int = 24000, loader: SileroLoader | None = None):
        self.rate = rate
        self.loader = loader or SileroLoader()
        self.pcm = bytearray()
        self.start = 0
        self.vad: SileroVad | None = None

    def __len__(self) -> int:
        return len(self.pcm)              # bytes

    def end(self) -> int:
        return self.start + len(self.pcm) // 2

    def set_detector(self, cfg: VadConfig | None) -> bool:
        """Turns detection off (None) or on with `cfg`; True when that changed the detector,
        which then starts afresh at the next append (a turn in progress is forgotten, and audio
        buffered before a detector is turned on goes at that append: turns start after it)."""
        if cfg == (self.vad and self.vad.cfg):
            return False
        self.vad = (None if cfg is None
                    else SileroVad(self.loader.get(), cfg, self.rate, origin=self.end()))
        return True

    def append(self, raw: bytes) -> list[tuple[VadEvent, bytes]]:
        """Appends pcm16 and answers the turn edges it completed, in order: (start, b"") and
        (stop, the turn's pcm16 from the start's `at` to the stop's), cut out of the buffer."""
        self.pcm += raw
        if self.vad is None:
            return []
        edges = []
        for ev in self.vad.feed(raw):
            turn = self._cut(ev.at)           # start: silence before the padding; stop: the turn
            edges.append((ev, turn if ev.kind == "stop" else b""))
        self._cut(self.vad.keep_from())
        return edges

    def take(self) -> bytes:
        """Everything buffered (a commit or clear); a turn in progress ends unannounced."""
        if self.vad is not None:
            self.vad.reset()
        return self._cut(self.end())

    def _cut(self, upto: int) -> bytes:
        """Removes and returns the pcm16 before offset `upto`."""
        n = 2 * min(max(0, upto - self.start), len(self.pcm) // 2)
        head = bytes(self.pcm[:n])
        del self.pcm[:n]
        self.start += n // 2
        return head
