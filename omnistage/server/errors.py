"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 500: "internal_error"}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
