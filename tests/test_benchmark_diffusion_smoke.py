"""Keeps benchmarks/diffusion.py from rotting: the whole script (omnistage, step caches,
diffusers, the report) on the tiny Qwen-Image with a tiny workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_script_on_tiny_model_prints_one_json_line_last(tmp_path):
    env = {**os.environ, "OMNISTAGE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.diffusion", "--ckpt-size", "tiny", "--requests", "2",
         "--size", "32", "--steps", "3", "--threads", "1", "--out-json", str(tmp_path / "r.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "r.json").read_text())
    assert report["max_abs_vs_diffusers"] <= 1e-4          # the benchmark checks what it times
    assert report["throughput_ratio"] > 0 and set(report["caches"]) == {"teacache", "fbcache"}
    for c in report["caches"].values():
        assert c["steps"] == 6 and 0 <= c["skipped_steps"] <= 2    # only the middle step may skip
