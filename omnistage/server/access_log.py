"""One access-log line per request, at INFO on the logger `omnistage.access`, written when
the request is over: after the last byte of a stream (or when its client left), after a
WebSocket session closed.

    request_id=chatcmpl-... method=POST route=/v1/chat/completions status=200 latency_ms=84.1
        prompt_tokens=12 completion_tokens=16 audio_s=1.92

Fields: the request id (the `X-Request-Id` answered, else the one sent, else `-`), method
(`WS` for a WebSocket session), the route (its template, `/v1/videos/{video_id}`; the path
when no route matched), status (101 for an accepted WebSocket), latency from arrival to the
end, then what the request made where known (`AccessRecord`: tokens, seconds of audio,
images), and `incomplete=1` when the response ended before its last byte (the client left).
Values with spaces, quotes or control characters are JSON-quoted, so a line stays one line.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("omnistage.access")

_PLAIN = re.compile(r"[\w./{}:@%+,\-]+")


@dataclass
class AccessRecord:
    """What a request made; routes fill it in as `request.state.access` (None: not known)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    audio_seconds: float | None = None      # speech made (or, for transcriptions, heard)
    images: int | None = None
    cut_short: bool = False                 # the app's response ended before its last byte

    def fields(self) -> list[str]:
        out = []
        for name, value in (("prompt_tokens", self.prompt_tokens),
                            ("completion_tokens", self.completion_tokens),
                            ("audio_s", None if self.audio_seconds is None else round(self.audio_seconds, 3)),
                            ("images", self.images)):
            if value is not None:
                out.append(f"{name}={value}")
        return out


def _quoted(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


class _Outcome:
    """What went out: the status and the request id header."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.request_id: str | None = None

    def see(self, message: Message) -> None:
        kind = message["type"]
        if kind in ("http.response.start", "websocket.http.response.start"):
            self.status = message["status"]
            self.request_id = Headers(raw=message.get("headers", [])).get("x-request-id")
        elif kind == "websocket.accept":
            self.status = 101
        elif kind == "websocket.close" and self.status is None:
            self.status = 403     # refused before the handshake


class ResponseEndMiddleware:
    """ASGI, innermost: marks the request's record `cut_short` when the app started a
    response and stopped before its last byte (its client left mid-stream). Outer layers
    cannot tell: Starlette's BaseHTTPMiddleware ends the body it relays properly either way."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = scope.get("state", {}).get("access")
        if scope["type"] != "http" or record is None:
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            record.cut_short = state["started"] and not state["ended"]


class AccessLogMiddleware:
    """ASGI, outermost: times each HTTP request and WebSocket session and logs its line when
    it is over (install ResponseEndMiddleware innermost with it)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        record = AccessRecord()
        scope.setdefault("state", {})["access"] = record
        outcome = _Outcome()

        async def observed_send(message: Message) -> None:
            outcome.see(message)
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(_line(scope, outcome, record, time.monotonic() - t0))


def _line(scope: Scope, outcome: _Outcome, record: AccessRecord, seconds: float) -> str:
    route = scope.get("route")
    path = route.path if route is not None else scope["path"]
    rid = outcome.request_id or Headers(scope=scope).get("x-request-id") or "-"
    method = "WS" if scope["type"] == "websocket" else scope["method"]
    status = outcome.status if outcome.status is not None else 500    # the app gave no answer
    parts = [f"request_id={_quoted(rid)}", f"method={_quoted(method)}", f"route={_quoted(path)}",
             f"status={status}", f"latency_ms={seconds * 1000:.1f}", *record.fields()]
    if record.cut_short:
        parts.append("incomplete=1")
    return " ".join(parts)
