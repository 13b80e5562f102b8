"""`omnistage generate` with image and video models writes the files (progress on stderr)."""

from __future__ import annotations

import subprocess
import sys

import av
import pytest
from PIL import Image

from omnistage.entrypoints.model_source import tiny_checkpoint


def generate(*args, cwd):
    return subprocess.run([sys.executable, "-m", "omnistage.cli", "generate", *args, "--num-threads", "1"],
                          cwd=cwd, capture_output=True, text=True, timeout=180)


def test_images(tmp_path):
    folder = str(tiny_checkpoint("qwen_image"))
    done = generate(folder, "a red cat", "--size", "48x32", "--steps", "3", "--seed", "4", "--n", "2",
                    "--out", "cat.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("cat-1.png", "cat-2.png"):
        with Image.open(tmp_path / name) as im:
            assert im.size == (48, 32)
    assert "seed 4" in done.stderr and "3/3" in done.stderr     # the progress bar finished
    bad = generate(folder, "a red cat", "--size", "50x32", cwd=tmp_path)
    assert bad.returncode != 0 and "multiple" in bad.stderr


@pytest.mark.parametrize("arch", ["wan"])
def test_video(tmp_path, arch):
    done = generate(str(tiny_checkpoint(arch)), "a red cat", "--size", "32x32", "--steps", "2",
                    "--num-frames", "5", "--fps", "8", "--out", "cat.mp4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    with av.open(str(tmp_path / "cat.mp4")) as c:
        frames = [f for f in c.decode(video=0)]
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)
