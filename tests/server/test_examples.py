"""Every script of examples/ run as a user would (a subprocess, OPENAI_BASE_URL and
OPENAI_API_KEY in its environment) against real servers of tiny models, and what it wrote
checked: WAVs with sound, PNGs of the asked size, an MP4 with frames."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from omnistage.entrypoints.model_source import tiny_checkpoint

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def diffusion_servers(start_server):
    """Base URLs of tiny:qwen_image, tiny:qwen_image_edit_plus and tiny:wan servers, started
    side by side."""
    archs = {"image": ("qwen_image", ()), "edit": ("qwen_image_edit_plus", ()),
             "video": ("wan", ("--max-video-frames", "17"))}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        started = {k: pool.submit(stack.enter_context, start_server(str(tiny_checkpoint(a)), *flags))
                   for k, (a, flags) in archs.items()}
        yield {k: f.result().base for k, f in started.items()}


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory) -> Path:
    import soundfile as sf

    t = np.arange(16000) / 16000
    path = tmp_path_factory.mktemp("q") / "question.wav"
    sf.write(path, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 16000)
    return path


def _run(base: str, key: str, cwd: Path, script: str, *args: str) -> str:
    env = {**os.environ, "OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": key}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _wav_samples(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def test_audio_examples(omni_server, api_key, tmp_path, question_wav):
    out = _run(omni_server, api_key, tmp_path, "chat_audio.py", "--audio", str(question_wav), "--out", "a.wav")
    assert "text:" in out and _wav_samples(tmp_path / "a.wav").size > 0
    _run(omni_server, api_key, tmp_path, "stream_speech_to_wav.py", "Tell me about the sea", "--out", "s.wav")
    assert np.abs(_wav_samples(tmp_path / "s.wav")).max() > 0
    _run(omni_server, api_key, tmp_path, "speech.py", "Hello there", "--out", "h.wav")
    assert np.abs(_wav_samples(tmp_path / "h.wav")).max() > 0
    _run(omni_server, api_key, tmp_path, "transcribe.py", str(question_wav))
    _run(omni_server, api_key, tmp_path, "realtime_turn.py", str(question_wav), "--out", "r.wav")
    assert _wav_samples(tmp_path / "r.wav").size > 2400


def test_image_and_video_examples(diffusion_servers, api_key, tmp_path):
    from PIL import Image

    s = diffusion_servers
    _run(s["image"], api_key, tmp_path, "image.py", "a red cube", "--size", "48x32", "--steps", "2",
         "--seed", "1", "--out", "i.png")
    assert Image.open(tmp_path / "i.png").size == (48, 32)
    _run(s["image"], api_key, tmp_path, "image.py", "a red cube", "--size", "32x32", "--steps", "3",
         "--partial-images", "2", "--out", "p.png")
    assert Image.open(tmp_path / "p.png").size == (32, 32)
    assert sorted(p.name for p in tmp_path.glob("p.partial*.png")) == ["p.partial0.png", "p.partial1.png"]
    _run(s["edit"], api_key, tmp_path, "image_edit.py", str(tmp_path / "i.png"), "make it green",
         "--size", "48x32", "--steps", "2", "--out", "e.png")
    assert Image.open(tmp_path / "e.png").size == (48, 32)
    out = _run(s["video"], api_key, tmp_path, "video.py", "a wave", "--size", "32x32", "--seconds", "1",
               "--steps", "2", "--out", "v.mp4")
    import av

    with av.open(io.BytesIO((tmp_path / "v.mp4").read_bytes())) as box:
        assert sum(1 for _ in box.decode(video=0)) > 1
    assert "video: v.mp4" in out
