"""`omnistage demo` from the command line: with a MODEL it serves the model in its own process
for the page and stops it with the page; with neither a MODEL nor --api-base it says what to
give."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import wave
from types import SimpleNamespace

import httpx
import numpy as np
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


class _Speech:
    """The openai SDK's `client.audio.speech`, answering every request with one WAV."""

    def __init__(self, wav: bytes):
        self.wav = wav

    def create(self, **_) -> io.BytesIO:
        return io.BytesIO(self.wav)


def _client(wav: bytes) -> SimpleNamespace:
    """The openai client as the speech tab uses it: `client.audio.speech.create`."""
    return SimpleNamespace(audio=SimpleNamespace(speech=_Speech(wav)))


def test_demo_plays_the_servers_samples_unchanged():
    """The speech tab hands Gradio the server's 16-bit samples as they are: float samples
    would be rescaled by Gradio to full scale (a quiet answer played at full volume)."""
    pytest.importorskip("gradio")
    from omnistage.demo import DemoActions, Served

    samples = (np.sin(np.arange(2400) / 8.0) * 900).astype(np.int16)      # quiet: peak 900 of 32767
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes(samples.tobytes())
    (rate, played), note = DemoActions(_client(out.getvalue()), Served("m", voices=("a",))).speech("Hi.", None)
    assert note == "" and rate == 24000
    assert played.dtype == np.int16 and np.array_equal(played, samples)
