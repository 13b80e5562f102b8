"""What every stage emits, in this process or across one: the envelope of a stage's output and
the failure of one request. Below both `stages/` (which make them) and `runtime/` (which
carries them between processes)."""

from __future__ import annotations

from typing import Any

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

    @classmethod
    def of(cls, request_id: str, error: OmniStageError) -> StageFailure:
        """A stage's error on taking a request: a refusal when it is the client's mistake."""
        if isinstance(error, InvalidRequestError):
            return cls.refused(request_id, error)
        return cls(request_id, str(error))

    def exception(self) -> OmniStageError:
        """What the caller raises: InvalidRequestError for a refusal, else StageFailedError."""
        if self.client_error:
            return InvalidRequestError(self.message, param=self.param)
        return StageFailedError(self.message or "a stage failed")
