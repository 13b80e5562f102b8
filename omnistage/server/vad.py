"""An energy-based voice activity detector for the Realtime API's `server_vad` turn detection.

`EnergyVad` is fed 24 kHz pcm16 chunks of any size and answers `VadEvent`s ("start", "stop")
whose offsets count samples of the whole stream it was fed. It is our own, dependency-free
detector (no model): it hears *loudness*, not speech, so a cough or a door counts as a turn.
Around it: `TurnDetection`, the session's server_vad setting (parsed from session.update), and
`InputAudioBuffer`, the session's input buffer that the detector cuts into turns.

Per frame (`frame_ms`, 20 ms = 480 samples at 24 kHz) it measures the level in dBFS,
10*log10(mean(x^2)) with x in [-1, 1] (a full-scale sine is -3 dBFS; digital silence is clamped
to -100 dBFS). A frame is loud ("voiced") when its level clears both

    an absolute gate:       gate_db   = -60 + 30 * threshold   (dBFS)
    the noise floor plus:   margin_db =   5 + 20 * threshold   (dB)

`threshold` is OpenAI's 0..1 knob (default 0.5 -> at least -45 dBFS and 15 dB over the floor;
0 -> -60 dBFS and 5 dB; 1 -> -30 dBFS and 25 dB): higher needs louder audio, as OpenAI's does.
The noise floor is the quietest frame among the `floor_window_ms` (3 s) before the current one
("minimum statistics": it follows steady background noise, and drops at once when the noise
stops). The window starts full of digital silence, so a voice at the very first sample is
heard; the price: a sound there from the start, or one steady without a dip for longer than
the window, is speech until the window has heard only it; then it is the floor, and the turn
ends (a loud hum at session start reads as one ~3 s turn).

Speech starts after `min_speech_ms` of consecutive voiced frames (a click is no turn); the start
event's `speech` is the first of them, and `at` is `prefix_padding_ms` before it (the audio to
commit begins there). Speech stops after `silence_duration_ms` of consecutive unvoiced frames
(rounded up to whole frames); the stop event's `speech` is the end of the last voiced frame, and
`at` is where the silence confirmed it (the audio to commit ends there, silence included, as
OpenAI's `audio_end_ms` does). Offsets are exact to one frame: a burst's edges fall inside the
frame that reports them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from omnistage.errors import InvalidRequestError

FLOOR_DB = -100.0             # level of digital silence, and the floor before any history


@dataclass(frozen=True)
class VadConfig:
    """The detector's knobs; the first three are OpenAI's ServerVad fields."""

    threshold: float = 0.5            # 0..1, see the module docstring for the dB mapping
    prefix_padding_ms: int = 300      # audio kept before the detected start
    silence_duration_ms: int = 500    # silence that ends a turn
    frame_ms: int = 20                # analysis frame
    min_speech_ms: int = 60           # voiced audio in a row needed to start a turn
    floor_window_ms: int = 3000       # how far back the noise floor looks

    @property
    def gate_db(self) -> float:
        return -60.0 + 30.0 * self.threshold

    @property
    def margin_db(self) -> float:
        return 5.0 + 20.0 * self.threshold


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["start", "stop"]
    at: int        # start: first sample of the turn's audio (speech minus padding, >= origin);
                   # stop: the sample where the turn's audio ends (speech + confirming silence)
    speech: int    # start: first sample of the first voiced frame; stop: end of the last one


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad`: the detector's knobs, and what a detected turn does to responses."""

    vad: VadConfig = VadConfig()
    create_response: bool = True          # a stop commits the turn and starts a response
    interrupt_response: bool = True       # a start cancels the running response

    def to_json(self) -> dict:
        return {"type": "server_vad", "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None}


def parse_turn_detection(value) -> TurnDetection | None:
    """session.audio.input.turn_detection: null, or a whole server_vad object (omitted fields
    take OpenAI's defaults, not the session's previous values)."""
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "server_vad":
        raise InvalidRequestError(
            f"{param} must be null or {{'type': 'server_vad', ...}}; got type {kind!r} "
            "(semantic_vad is not supported; nothing of this update was applied)", param=param)
    if value.get("idle_timeout_ms") is not None:
        raise InvalidRequestError(f"{param}.idle_timeout_ms is not supported; set it to null",
                                  param=f"{param}.idle_timeout_ms")

    def get(name: str, default, ok, must: str):
        v = value.get(name)
        if v is None:
            return default
        # bools are ints in Python: a bool field takes only bools, a number field none
        if isinstance(v, bool) != isinstance(default, bool) or not ok(v):
            raise InvalidRequestError(f"{param}.{name} must be {must}; got {v!r}",
                                      param=f"{param}.{name}")
        return v

    def number(v) -> bool:
        return isinstance(v, (int, float)) and 0.0 <= v <= 1.0

    def ms(v) -> bool:
        return isinstance(v, int) and 0 <= v <= 10000

    def flag(v) -> bool:
        return True

    vad = VadConfig(
        threshold=float(get("threshold", 0.5, number, "a number in [0, 1]")),
        prefix_padding_ms=get("prefix_padding_ms", 300, ms, "an integer in [0, 10000]"),
        silence_duration_ms=get("silence_duration_ms", 500, ms, "an integer in [0, 10000]"))
    return TurnDetection(vad, get("create_response", True, flag, "true or false"),
                         get("interrupt_response", True, flag, "true or false"))


class EnergyVad:
    """Feed pcm16 chunks in order; each `feed` answers the events its audio completed.

    Invariant: `_done` (a multiple of the frame length past `origin`) samples were judged; the
    `_rest` samples after them wait for a whole frame. Events alternate start, stop, start, ...
    """

    def __init__(self, cfg: VadConfig, rate: int = 24000, origin: int = 0):
        self.cfg, self.rate, self.origin = cfg, rate, origin
        self.frame = rate * cfg.frame_ms // 1000                  # samples per frame
        self.start_frames = max(1, math.ceil(cfg.min_speech_ms / cfg.frame_ms))
        self.stop_frames = max(1, math.ceil(cfg.silence_duration_ms / cfg.frame_ms))
        self.padding = rate * cfg.prefix_padding_ms // 1000
        window = max(1, cfg.floor_window_ms // cfg.frame_ms)
        self._levels = deque([FLOOR_DB] * window, maxlen=window)   # dBFS of the last frames
        self._rest = np.zeros(0, dtype=np.int16)
        self._done = origin
        self.reset()

    @property
    def speaking(self) -> bool:
        return self._start is not None

    def reset(self) -> None:
        """Forgets the turn in progress (e.g. the client committed or cleared the buffer); the
        noise floor and the unjudged samples are kept."""
        self._start: VadEvent | None = None  # the start event of the turn in progress
        self._run = 0                         # voiced frames in a row, while not speaking
        self._quiet = 0                       # unvoiced frames in a row, while speaking

    def keep_from(self) -> int:
        """The first stream sample a future event may still point at: audio before it can go."""
        if self._start is not None:
            return self._start.at
        pending = self._done - self._run * self.frame     # onset of a run not yet long enough
        return max(self.origin, pending - self.padding)

    def feed(self, pcm: bytes | np.ndarray) -> list[VadEvent]:
        samples = np.frombuffer(pcm, dtype="<i2") if isinstance(pcm, bytes) else pcm
        samples = np.concatenate([self._rest, samples.astype(np.int16, copy=False)])
        n = samples.size // self.frame
        self._rest = samples[n * self.frame:].copy()
        x = samples[:n * self.frame].reshape(n, self.frame).astype(np.float32) / 32768.0
        levels = 10.0 * np.log10(np.mean(x * x, axis=1) + 1e-10)      # (n,) dBFS
        events = []
        for level in np.maximum(levels, FLOOR_DB).tolist():
            ev = self._judge(level)
            if ev is not None:
                events.append(ev)
        return events

    def _judge(self, level: float) -> VadEvent | None:
        """One frame (the one starting at `_done`) at `level` dBFS."""
        floor = min(self._levels)
        voiced = level >= self.cfg.gate_db and level >= floor + self.cfg.margin_db
        self._levels.append(level)
        self._done += self.frame
        if self._start is None:
            self._run = self._run + 1 if voiced else 0
            if self._run < self.start_frames:
                return None
            speech = self._done - self._run * self.frame
            self._start = VadEvent("start", max(self.origin, speech - self.padding), speech)
            self._run, self._quiet = 0, 0
            return self._start
        self._quiet = 0 if voiced else self._quiet + 1
        if self._quiet < self.stop_frames:
            return None
        self.reset()
        return VadEvent("stop", self._done, self._done - self.stop_frames * self.frame)


class InputAudioBuffer:
    """A Realtime session's input audio buffer (pcm16, appended, not yet committed), which an
    optional detector cuts into turns. Offsets count every sample ever appended; `start` is
    the offset of pcm[0]. With a detector, audio no future turn can reach (silence before the
    prefix padding) is dropped as it comes, so between turns the buffer stays small."""

    def __init__(self, rate: int = 24000):
        self.rate = rate
        self.pcm = bytearray()
        self.start = 0
        self.vad: EnergyVad | None = None

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
        self.vad = None if cfg is None else EnergyVad(cfg, self.rate, origin=self.end())
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
