"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from omnistage.errors import InvalidRequestError, OmniStageError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 500: "internal_error"}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: OmniStageError) -> str:
    """The SSE event that ends a stream an error cut short after its first bytes (the status
    was sent already): the same error body as a response would carry."""
    if isinstance(exc, InvalidRequestError):
        error = {"message": str(exc), "type": _TYPES[400], "param": exc.param, "code": None}
    else:
        error = {"message": str(exc), "type": _TYPES[500], "param": None, "code": "generation_failed"}
    return f"data: {json.dumps({'error': error})}\n\n"
