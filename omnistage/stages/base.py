"""The one protocol every stage kind implements, and the envelope of what stages emit.

A stage owns its batching: `add` queues work for a request, `step` advances everything it
can in one batched pass and returns what came out, `abort` drops a request and frees what it
held. `has_work` says whether `step` would compute anything now (a stage waiting for input
from upstream has none). Stages never import each other: the graph routes their outputs
along the recipe's edges.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from omnistage.errors import InvalidRequestError, OmniStageError, StageFailedError


class StageOutput(msgspec.Struct):
    """One message a stage emitted for one request; `payload` is the stage's own type."""

    stage: str
    request_id: str
    payload: Any
    final: bool = False     # the stage is done with this request (holds nothing for it now)


class StageFailure(msgspec.Struct):
    """A stage could not serve a request: it refused the input (`client_error`: the client's
    mistake, e.g. an InvalidRequestError the model raised only once it saw a decoded image), or
    it lost the request (a crash, its process died). Crosses processes as msgspec: the new
    fields have defaults, so both ends decode either form."""

    request_id: str
    message: str
    client_error: bool = False     # True: a refusal (the caller answers 4xx), not a fault
    param: str | None = None       # with client_error: the request field to change

    @classmethod
    def refused(cls, request_id: str, error: InvalidRequestError) -> StageFailure:
        return cls(request_id, str(error), client_error=True, param=error.param)

    def exception(self) -> OmniStageError:
        """What the caller raises: InvalidRequestError for a refusal, else StageFailedError."""
        if self.client_error:
            return InvalidRequestError(self.message, param=self.param)
        return StageFailedError(self.message or "a stage failed")


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
