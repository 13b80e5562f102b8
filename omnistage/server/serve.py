"""Graceful shutdown: on the first SIGTERM/SIGINT the app answers new work with 503 and
/health with 503 while in-flight requests finish (up to the timeout); then uvicorn stops.
A second signal stops at once."""

from __future__ import annotations

import threading

import uvicorn
from fastapi import FastAPI

from omnistage.entrypoints.async_omni import AsyncOmni


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncOmni, timeout: float):
        super().__init__(config)
        self._app, self._engine, self._timeout = app, engine, timeout

    def handle_exit(self, sig, frame) -> None:
        if self._app.state.draining:
            return super().handle_exit(sig, frame)
        self._app.state.draining = True

        def drain() -> None:
            self._engine.wait_idle(self._timeout)
            super(DrainingServer, self).handle_exit(sig, frame)

        threading.Thread(target=drain, name="omnistage-drain", daemon=True).start()
