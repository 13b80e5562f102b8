"""Typed errors. Each message says what to change, not just what went wrong.

Client mistakes derive from `InvalidRequestError` (a server maps them to 4xx); problems with
a model folder derive from `ModelLoadError`.
"""


class OmniStageError(Exception):
    """Base class of every error omnistage raises on purpose."""


class InvalidRequestError(OmniStageError, ValueError):
    """A request or its sampling parameters are invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context window."""


class ModelLoadError(OmniStageError):
    """A model folder cannot be used: missing, corrupt, or of an unsupported kind."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist or lacks config.json."""


class CheckpointError(ModelLoadError):
    """The weights files are missing, unreadable, or do not match the config."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture omnistage does not implement."""


class RequestAbortedError(OmniStageError):
    """The request was aborted before it finished."""


class EngineDeadError(OmniStageError):
    """The engine loop stopped because of an internal fault; no new requests are accepted."""


class StageFailedError(OmniStageError):
    """A stage lost this request (e.g. its process died); other requests carry on, and the
    stage is restarted (or, past its restart budget, the model reports itself unhealthy)."""
