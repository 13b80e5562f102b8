"""An internal fault is a clean 500 (503 for a dead engine) in OpenAI's JSON, without
internals, carrying the request id; the app is driven in-process through ASGI."""

from __future__ import annotations

import asyncio
import types

import httpx

from omnistage.errors import EngineDeadError
from omnistage.server.app import build_app


def test_faults_become_openai_errors_with_request_id():
    app = build_app(types.SimpleNamespace(dead=None), "m")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    @app.get("/dead")
    async def dead():
        raise EngineDeadError("stopped")

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return [await c.get(p, headers={"X-Request-Id": "rid-7"}) for p in ("/boom", "/dead")]

    boom_r, dead_r = asyncio.run(main())
    assert boom_r.status_code == 500 and "secret" not in boom_r.text
    assert boom_r.json()["error"]["type"] == "internal_error" and "rid-7" in boom_r.json()["error"]["message"]
    assert boom_r.headers["x-request-id"] == "rid-7"
    assert dead_r.status_code == 503 and dead_r.json()["error"]["type"] == "service_unavailable"
