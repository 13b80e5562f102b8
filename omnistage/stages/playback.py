"""A listener's playback as an audio stage models it, to pace its chunks.

The stage cannot see the client play; it assumes the listener starts with the first chunk sent
and plays without pause. What is left to play is then the speech sent minus the time since the
first chunk: negative once the listener ran dry (by how long, had it kept waiting)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlaybackClock:
    started: float | None = None         # clock time the first chunk went out
    sent_s: float = 0.0                  # seconds of speech sent

    def sent(self, seconds: float, now: float) -> None:
        """A chunk of `seconds` of speech went out at `now`."""
        self.started = now if self.started is None else self.started
        self.sent_s += seconds

    def left_to_play(self, now: float) -> float:
        """Seconds of sent speech the listener has not played yet; +inf before the first chunk."""
        return float("inf") if self.started is None else self.sent_s - (now - self.started)

    def ran_dry(self, now: float) -> bool:
        return self.left_to_play(now) < 0
