"""The one protocol every stage kind implements (what stages emit: `omnistage.stage_messages`).

Stage kinds subclass `Stage` (so they inherit the defaults of its optional abilities). A
stage owns its batching: `add` queues work for a request, `step` advances everything it
can in one batched pass and returns what came out, `abort` drops a request and frees what it
held. `has_work` says whether `step` would compute anything now (a stage waiting for input
from upstream has none). Stages never import each other: the graph routes their outputs
along the recipe's edges.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from omnistage.stage_messages import StageOutput


@runtime_checkable
class Stage(Protocol):
    name: str
    dead: str | None      # why the stage cannot serve any more; None while it can

    def add(self, message: Any) -> None:
        """Queue input for a request (a new request, or more input for a running one)."""

    def step(self) -> list[StageOutput]:
        """Advance all queued work by one batched pass."""

    def abort(self, request_id: str) -> None:
        """Forget the request and free everything it holds (unknown ids are ignored)."""

    def has_work(self) -> bool:
        """Whether step() would compute something now."""

    def num_requests(self) -> int:
        """Requests the stage holds (running or waiting for input); 0 after all finished."""

    def close(self) -> None:
        """Release the stage's resources (its process, for a remote stage)."""

    # Optional abilities: stage kinds subclass Stage to inherit these defaults.
    def wake_after(self) -> float | None:
        """Seconds after which step() may have work again without new input (a stage that
        holds work back, as the vocoder keeping later chunks for a newcomer's first audio);
        None: only new input brings work."""
        return None

    def starving(self) -> bool:
        """Whether a request here waits for more input from upstream before its next piece of
        work (a vocoder stream short of codes for its next chunk). The graph then gives the
        stages feeding this one extra passes (StageGraph.step). False: never."""
        return False

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """The stage's own (name{labels}, kind, help, value) gauges for /metrics."""
        return []
