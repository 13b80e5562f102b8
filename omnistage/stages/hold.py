"""A hold: an audio stage keeps other listeners' work back while a newcomer gathers its first
chunk, so each graph round costs only the thinker's and talker's steps and the newcomer's
first audio comes sooner. Bounded twice: a hold lasts at most `max_s` (then one step of the
held work goes, and the hold starts again), and it ends while a held listener has less than
`margin_s` of sent speech left to play. The stage decides what is held and who is waiting;
this keeps the clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hold:
    max_s: float
    margin_s: float
    since: float | None = None          # clock time the current hold began (None: not holding)

    def holds(self, wanted: bool, least_left: float, now: float, stepping: bool) -> bool:
        """Whether the held work waits now. `wanted`: a newcomer gathers and there is work to
        hold; `least_left`: the least speech a held listener has left to play (inf: none has
        started); `stepping`: the stage's step acts on the answer (a hold that ran its course
        then starts again after that step)."""
        if not wanted:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if now - self.since < self.max_s and least_left >= self.margin_s:
            return True
        if stepping:
            self.since = now
        return False

    def wake_after(self, least_left: float, now: float) -> float | None:
        """Seconds until the held work may go without new input (None: not holding): the
        hold's end, or the held listener's crossing of margin_s."""
        if self.since is None:
            return None
        return max(0.0, min(self.since + self.max_s - now, least_left - self.margin_s))
