"""`omnistage demo` from the command line: with a MODEL it serves the model in its own process
for the page and stops it with the page; with neither a MODEL nor --api-base it says what to
give."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.serve_process import free_port


def test_demo_needs_a_model_or_a_server():
    done = subprocess.run([sys.executable, "-m", "omnistage.cli", "demo"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "give a MODEL to serve, or --api-base" in done.stderr


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree with pgrep")
def test_demo_serves_the_model_in_its_own_process(tiny_qwen2):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "omnistage.cli", "demo", tiny_qwen2, "--port", str(port)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:     # a process start has no event to wait on: the page is asked, bounded
            assert proc.poll() is None, proc.stderr.read()
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                if page.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the demo page did not come up"
            time.sleep(0.2)
        # the page was built from the server's /v1/models card: the model's server answered,
        # and it runs in the demo's process (no server process was started for it)
        assert f"omnistage: {tiny_qwen2}" in page.text
        assert _children(proc.pid) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read()
