"""Keeps benchmarks/cascade_vs_e2e.py from rotting: the whole script (the cascade and the tiny
Qwen2.5-Omni in one process, one level, one round) and its per-request dithering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` lives at the root

from benchmarks.cascade_vs_e2e import dithered  # noqa: E402


def test_every_request_hears_other_bytes_of_the_same_speech():
    speech = np.sin(np.linspace(0, 200, 16000)).astype(np.float32) * 0.3
    a, b = dithered(speech, 1), dithered(speech, 2)
    assert not np.array_equal(a, b) and np.array_equal(a, dithered(speech, 1))
    assert np.abs(a - speech).max() < 1e-3                 # inaudible: -60 dBFS at most


def test_script_on_tiny_models(tmp_path, tiny_qwen2):
    env = {**os.environ, "OMNISTAGE_CACHE": os.environ.get("OMNISTAGE_CACHE", str(tmp_path))}
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cascade_vs_e2e", "--omni", "tiny:qwen2_5_omni:tiny",
         "--llm", tiny_qwen2, "--concurrency", "1", "--rounds", "1", "--threads", "1",
         "--out-json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    assert [(r["side"], r["concurrency"]) for r in report["runs"]] == [("cascade", 1), ("e2e", 1)]
    for r in report["runs"]:
        assert r["requests"] == 3 and r["ttfa_p50_s"] > 0 and r["audio_s_per_wall_s"] > 0
    cascade, e2e = report["runs"]
    assert set(cascade["stage_s"]) >= {"asr", "llm", "tts"} and cascade["stage_s"]["asr"] > 0
    assert set(e2e["stage_s"]) >= {"encoder", "thinker", "talker", "token2wav"}
    # both spoke about the same amount: the talker's codes were sized on the cascade's reply
    assert abs(e2e["audio_s_per_request"] - cascade["audio_s_per_request"]) < 0.5
    assert report["medians"]["1"]["e2e_over_cascade"]["ttfa_p50_s"] > 0
