"""Helpers shared by the server test files (imported by name: tests/server is on sys.path)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import httpx


@dataclass
class Req:
    """A hostile-input case's request: a JSON body, or raw bytes (application/json unless
    headers say otherwise), or multipart (`files` a dict, or a list of (field, (name, bytes,
    mime)) so that a field may repeat)."""
    path: str
    json: object = None
    content: bytes | None = None
    files: dict | list | None = None
    data: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)


def send(http: httpx.Client, req: Req) -> httpx.Response:
    """POST it. Connection: close, so that a badly answered case cannot poison the next one's
    connection."""
    headers = {"Connection": "close", **req.headers}
    if req.files is not None:
        return http.post(req.path, files=req.files or None, data=req.data, headers=headers)
    if req.content is not None:
        headers.setdefault("Content-Type", "application/json")
        return http.post(req.path, content=req.content, headers=headers)
    return http.post(req.path, json=req.json, headers=headers)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG signature + IHDR declaring `width` x `height`, then one tiny IDAT: the header lies."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)      # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def cut_off_streams(base: str, auth: dict, body: dict, count: int, lines_cycle: int,
                    timeout_s: float) -> None:
    """Open `count` streaming chat completions (32 at a time) and leave each after reading
    2 + i % lines_cycle non-empty lines, which closes its connection mid-stream."""
    import asyncio

    async def cut_off(client: httpx.AsyncClient, gate: asyncio.Semaphore, lines_to_read: int):
        async with gate:
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += bool(line)
                    if seen >= lines_to_read:
                        break       # leaving the block closes the connection mid-stream

    async def main():
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(headers=auth, timeout=60) as client:
            await asyncio.wait_for(asyncio.gather(
                *(cut_off(client, gate, 2 + i % lines_cycle) for i in range(count))), timeout_s)

    asyncio.run(main())
