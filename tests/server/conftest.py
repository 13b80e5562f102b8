"""A real `omnistage serve` process on a free loopback port, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def server(tiny_qwen2):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.cli", "serve", tiny_qwen2, "--port", str(port),
         "--served-model-name", "tiny", "--api-key", API_KEY, "--block-size", "4",
         "--num-threads", "1", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60          # bounded wait for start-up
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not become healthy within 60 s")
        time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
