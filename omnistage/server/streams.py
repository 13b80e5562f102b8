"""Helpers for the routes' delta streams."""

from __future__ import annotations

from typing import AsyncIterator

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
