"""A Realtime session's turn detection setting (`session.audio.input.turn_detection`): what cuts
the input audio into turns, parsed from session.update and reported in session.created/updated.

Both kinds run the Silero speech detector (server/vad.py); they differ in when a pause ends the
turn:

- `server_vad` (OpenAI's fields and defaults): `threshold` is the speech probability a 32 ms
  window must reach to count as speech (0.5), `prefix_padding_ms` the audio kept before the
  detected start (300), `silence_duration_ms` the pause that ends the turn (500);
  `idle_timeout_ms` (default none) answers a user who stays silent: that long after a response
  ends (its audio played out), the buffer is committed and a response made.
- `semantic_vad` (`eagerness`: low, medium, high, auto = medium): OpenAI decides the end of a
  turn with a model of what was said; ours is a rule on the speech detector's output, so that a
  hesitation does not end a turn but an answered question does not wait either. A pause ends
  the turn after

      pause_ms = EAGERNESS_PAUSE_MS[eagerness]   (high 400, medium/auto 800, low 1600 ms)

  doubled while the turn holds less than SHORT_TURN_MS (1 s) of speech ("um...", "so,", a
  name said before the question: a short fragment is rarely a whole turn), and never longer
  than OpenAI's timeouts for that eagerness (high 2 s, medium 4 s, low 8 s). Threshold and
  padding are server_vad's defaults.

Both: `create_response` (a turn's end commits it and starts a response) and
`interrupt_response` (speech that starts while a response runs cancels it: barge-in).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.errors import InvalidRequestError

PARAM = "session.audio.input.turn_detection"
EAGERNESS_PAUSE_MS = {"high": 400, "medium": 800, "auto": 800, "low": 1600}
EAGERNESS_MAX_MS = {"high": 2000, "medium": 4000, "auto": 4000, "low": 8000}
SHORT_TURN_MS = 1000
SERVER_VAD_KEYS = ("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                   "create_response", "interrupt_response", "idle_timeout_ms")
SEMANTIC_VAD_KEYS = ("type", "eagerness", "create_response", "interrupt_response")


@dataclass(frozen=True)
class VadConfig:
    """The speech detector's knobs (server/vad.py)."""

    threshold: float = 0.5            # speech probability of a window that counts as speech
    prefix_padding_ms: int = 300      # audio kept before the detected start
    silence_duration_ms: int = 500    # server_vad: the pause that ends a turn
    eagerness: str | None = None      # semantic_vad's; None: server_vad
    min_speech_ms: int = 64           # speech in a row that starts a turn (two windows)

    @property
    def release(self) -> float:
        """Below this probability a window of a turn in progress is silence (hysteresis, as
        Silero's own iterator: 0.15 under the threshold)."""
        return max(self.threshold - 0.15, 0.01)

    def pause_ms(self, speech_ms: int) -> int:
        """The pause that ends a turn holding `speech_ms` of speech (module docstring)."""
        if self.eagerness is None:
            return self.silence_duration_ms
        pause = EAGERNESS_PAUSE_MS[self.eagerness] * (2 if speech_ms < SHORT_TURN_MS else 1)
        return min(pause, EAGERNESS_MAX_MS[self.eagerness])


@dataclass(frozen=True)
class TurnDetection:
    vad: VadConfig = VadConfig()
    create_response: bool = True          # a turn's end commits it and starts a response
    interrupt_response: bool = True       # speech that starts cancels the running response
    idle_timeout_ms: int | None = None    # server_vad only

    @property
    def kind(self) -> str:
        return "server_vad" if self.vad.eagerness is None else "semantic_vad"

    def to_json(self) -> dict:
        common = {"type": self.kind, "create_response": self.create_response,
                  "interrupt_response": self.interrupt_response}
        if self.vad.eagerness is not None:
            return {**common, "eagerness": self.vad.eagerness}
        return {**common, "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
                "idle_timeout_ms": self.idle_timeout_ms}


def parse_turn_detection(value) -> TurnDetection | None:
    """turn_detection: null, or a whole server_vad / semantic_vad object (omitted or null fields
    take OpenAI's defaults, not the session's previous values)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("server_vad", "semantic_vad"):
        raise InvalidRequestError(f"{PARAM} must be null, {{'type': 'server_vad', ...}} or "
                                  f"{{'type': 'semantic_vad', ...}}; got type {kind!r} (nothing "
                                  "of this update was applied)", param=f"{PARAM}.type")
    flags = {name: _get(value, name, True, lambda v: True, "true or false")
             for name in ("create_response", "interrupt_response")}
    if kind == "semantic_vad":
        eagerness = _get(value, "eagerness", "auto", lambda v: v in EAGERNESS_PAUSE_MS,
                         "one of low, medium, high, auto")
        return TurnDetection(VadConfig(eagerness=eagerness), **flags)
    vad = VadConfig(
        threshold=float(_get(value, "threshold", 0.5, _unit, "a number in [0, 1]")),
        prefix_padding_ms=_get(value, "prefix_padding_ms", 300, _ms, "an integer in [0, 10000]"),
        silence_duration_ms=_get(value, "silence_duration_ms", 500, _ms,
                                 "an integer in [0, 10000]"))
    idle = _get(value, "idle_timeout_ms", 0, lambda v: 1 <= v <= 3_600_000,
                "an integer in [1, 3600000] (milliseconds) or null")
    return TurnDetection(vad, idle_timeout_ms=idle or None, **flags)


def _get(value: dict, name: str, default, ok, must: str):
    v = value.get(name)
    if v is None:
        return default
    # bools are ints in Python: a bool field takes only bools, a number field none
    if (isinstance(v, bool) != isinstance(default, bool)
            or not isinstance(v, type(default) if not isinstance(default, float) else (int, float))
            or not ok(v)):
        raise InvalidRequestError(f"{PARAM}.{name} must be {must}; got {v!r}",
                                  param=f"{PARAM}.{name}")
    return v


def _unit(v) -> bool:
    return 0.0 <= v <= 1.0


def _ms(v) -> bool:
    return 0 <= v <= 10000
