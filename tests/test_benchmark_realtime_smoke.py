"""Keeps benchmarks/realtime_latency.py from rotting: the whole script (two served variants,
streamed input on and off, manual and VAD turns and a barge-in over the real WebSocket) on the tiny
Qwen2.5-Omni with a 2 s utterance, and its playback-gap logic on made-up arrivals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` lives at the root

from benchmarks.realtime_latency import playback_gaps  # noqa: E402


def test_playback_gaps():
    # 1 s of audio at t=0 plays until 1.0; the next arrives at 1.5: a 0.5 s stall; then
    # audio arriving early queues behind what plays
    assert playback_gaps([(0.0, 1.0), (1.5, 0.5), (1.7, 1.0), (3.0, 0.1)]) == [0.5]
    assert playback_gaps([(0.0, 0.2), (0.1, 0.2), (0.3, 0.2)]) == []


def test_script_on_tiny_model(tmp_path):
    env = {**os.environ, "OMNISTAGE_CACHE": os.environ.get("OMNISTAGE_CACHE", str(tmp_path))}
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.realtime_latency", "--model", "tiny:qwen2_5_omni:tiny",
         "--lengths", "2", "--sessions", "1", "--modes", "manual,vad,bargein", "--repeats", "1",
         "--max-tokens", "4", "--port", "0", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    runs = {(r["variant"], r["mode"]): r for r in report["runs"]}
    assert set(runs) == {(v, m) for v in ("streamed", "plain") for m in ("manual", "vad", "bargein")}
    for (variant, mode), r in runs.items():
        assert not r["errors"], (variant, mode, r["errors"])
        [detail] = r["sessions_detail"]
        assert detail["status"] in ("completed", "incomplete") and detail["audio_s"] > 0
        assert r["delay_p50_s"] > 0
        if mode == "manual":
            assert 0 < r["first_text_p50_s"] <= r["delay_p50_s"]
        else:           # the VAD's silence window comes first: the stop, then the answer
            assert detail["stop_s"] > 0 and 0 < detail["after_stop_s"] <= detail["delay_s"]
        if mode == "bargein":   # the long answer was cut once the speech started
            assert detail["cancel_s"] is not None and detail["cancel_s"] >= 0
        else:
            assert detail["cancel_s"] is None
