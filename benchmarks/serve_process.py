"""An `omnistage serve` child process on loopback, for the benchmarks and the server tests: a
free port, a bounded wait until /health answers 200, and a stop that kills what does not end."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, output: Callable[[], str],
                 poll_s: float = 0.2) -> None:
    """Returns once `base`/health answers 200. A process start has no event to wait on, so it
    polls; RuntimeError with `output()` (what the process printed) if it exits first, and
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{output()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not become healthy within {timeout_s:g} s")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the server drains), then SIGKILL after `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
