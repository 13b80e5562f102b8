"""Helpers for the routes' delta streams."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omnistage.outputs import Delta


async def chain(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`first` (already awaited, so request errors surfaced before any byte went out), then
    the rest. Closing the chain closes `rest`, which aborts an unfinished request."""
    try:
        yield first
        async for d in rest:
            yield d
    finally:
        await rest.aclose()


class DeltaStreamingResponse(StreamingResponse):
    """A streamed response over a request's deltas that aborts the request however the response
    ends. The body's own generator closes the deltas when it runs to its end or is closed;
    but a client that leaves before the first byte (while the request waited for its first
    delta) ends the response before the body ever starts, and a never-started generator runs
    no cleanup: the request would then run to its end for nobody (found under load, with
    stages in their own processes: the first delta comes later)."""

    def __init__(self, content, deltas: AsyncIterator[Delta], media_type: str):
        super().__init__(content, media_type=media_type)
        self._deltas = deltas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._deltas.aclose()        # a no-op once the body closed or finished them
