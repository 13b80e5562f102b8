"""ASGI middleware bounding request bodies, whether sized (Content-Length) or chunked."""

from __future__ import annotations

from omnistage.server.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        size = headers.get(b"content-length")
        if size is not None:
            if not size.isdigit() or int(size) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        # Chunked (or no) body: read it here, up to the limit, then replay it to the app.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, receive), send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"request body over {self.max_bytes} bytes")
        await response(scope, receive, send)


def _replay(messages: list, then=None):
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()   # e.g. http.disconnect later on
        return {"type": "http.disconnect"}

    return receive
