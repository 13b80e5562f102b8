"""Graceful shutdown: on the first SIGTERM/SIGINT the app answers new work with 503 and
/health with 503 while in-flight requests finish (up to the timeout); then uvicorn stops.
A second signal stops at once. And where the server's API key comes from (`resolve_api_key`)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import InvalidRequestError

log = logging.getLogger(__name__)


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


def resolve_api_key(flag: str | None, path: str | None, env: str | None) -> str | None:
    """The API key from `--api-key` (flag) or `--api-key-file` (path; its content stripped of
    surrounding whitespace, the final newline), else from `$OMNISTAGE_API_KEY` (env); None
    when none is given. Both flags at once, an empty key, an unreadable file or a key with
    whitespace in it is refused (InvalidRequestError: the CLI prints it and exits 2) rather
    than picking one or serving without a key. A flag over a set variable wins, with a
    warning."""
    if flag is not None and path is not None:
        raise InvalidRequestError("give the API key with --api-key or --api-key-file, not both")
    if flag is None and path is None:
        key, where = env, "OMNISTAGE_API_KEY"
        if key is None:
            return None
    elif path is not None:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"--api-key-file {path}: cannot read it ({e})") from None
        where = f"--api-key-file {path}"
    else:
        key, where = flag, "--api-key"
    if env is not None and where != "OMNISTAGE_API_KEY":
        log.warning("the API key comes from %s; OMNISTAGE_API_KEY is ignored", where.split()[0])
    if not key.strip():
        raise InvalidRequestError(f"{where}: the API key is empty; give a key, or none of "
                                  "--api-key, --api-key-file, OMNISTAGE_API_KEY to serve without one")
    if key.split() != [key]:
        raise InvalidRequestError(f"{where}: the API key must be one word (no spaces or line "
                                  "breaks), as it is sent in 'Authorization: Bearer KEY'")
    return key
