"""Keeps benchmarks/omni_e2e.py from rotting: the whole script (omnistage levels, the
transformers subprocess, the report) on the tiny Qwen2.5-Omni with a tiny workload, plus the
ratio logic on made-up figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` lives at the root

from benchmarks.omni_e2e import LevelResult, RequestTiming, StageTimes, parse_args  # noqa: E402
from benchmarks.omni_peers import HFResult, summarize  # noqa: E402

LEVEL_KEYS = {"requests", "wall_s", "audio_s", "audio_s_per_wall_s", "ttfa_p50_s", "ttfa_p95_s",
              "ttft_p50_s", "last_audio_p50_s", "last_audio_p95_s", "lengths_ok", "other_cores",
              "stages"}
RATIOS = {"throughput_c16_vs_hf", "ttfa_c1_vs_hf_latency", "ttfa_p50_c8_vs_c1"}


def test_script_on_tiny_model_prints_one_json_line_last(tmp_path):
    # The default checkpoint path (built into the omnistage cache) under a private cache dir.
    # One thread per side: on a shared 2-core machine two OpenMP threads can wait on each
    # other for whole scheduler slices, which made this run take minutes instead of seconds.
    env = {**os.environ, "OMNISTAGE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.omni_e2e", "--size", "tiny", "--concurrency", "1,8",
         "--requests", "3", "--hf-requests", "1", "--text-tokens", "5", "--codec-tokens", "30",
         "--threads", "1", "--out-json", str(tmp_path / "report.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "report.json").read_text())
    assert not report["errors"], report["errors"]
    assert report["workload"]["audio_s_per_request"] == pytest.approx(30 * 0.02)
    assert set(report["levels"]) == {"1", "8"}
    for level in report["levels"].values():
        assert LEVEL_KEYS <= set(level) and level["requests"] == 3 and level["lengths_ok"]
        assert level["audio_s"] == pytest.approx(3 * 0.6)
        assert 0 < level["ttfa_p50_s"] <= level["last_audio_p50_s"]
        stages = level["stages"]
        assert {"thinker", "talker", "token2wav", "engine_step_s", "token2wav_dit_s"} <= set(stages)
        assert stages["thinker"]["calls"] > 0 and stages["talker"]["calls"] >= 30
        assert stages["encoder"]["calls"] == 0                         # text prompts only
        assert len(level["per_request"]["ttfa_s"]) == 3
    assert report["hf"]["requests"] == 1 and report["hf"]["audio_s"] == [pytest.approx(0.6)]
    assert report["hf"]["parts_s"]["token2wav_dit"] > 0
    assert len(report["code"]["commit"]) == 40
    # Same greedy thinker and talker on both sides: the same text tokens and codec codes.
    assert report["correctness"] == {"requests_compared": 1, "text_tokens_equal_hf": True,
                                     "talker_codes_equal_hf": True}
    assert set(report["ratios"]) == RATIOS
    assert report["ratios"]["throughput_c16_vs_hf"]["value"] is None   # no level 16 ran
    for name in ("ttfa_c1_vs_hf_latency", "ttfa_p50_c8_vs_c1"):
        r = report["ratios"][name]
        assert r["value"] > 0 and r["kind"] == "max"
        assert r["met"] is (r["value"] <= r["target"])    # the verdict follows the figure
    assert "[stages]   token2wav" in done.stdout and "[ratio] ttfa_p50_c8_vs_c1" in done.stdout


def _level(c: int, ttfa: list[float], wall: float) -> LevelResult:
    timings = [RequestTiming(i, t, t / 2, t + 1, t + 1, 6.0, [1] * 4) for i, t in enumerate(ttfa)]
    return LevelResult(c, timings, wall, StageTimes({}, {}, {}), 0.0)


def test_ratios_against_targets():
    hf = HFResult(1.0, [17.0, 19.0], [6.0, 6.0], [[1] * 4, [2] * 4],    # 0.333 audio-s per wall-s
                  [[5, 6], [7, 8]])
    levels = {1: _level(1, [1.0, 3.0, 9.0], 10.0), 8: _level(8, [4.5, 3.5], 4.0),
              16: _level(16, [5.0] * 16, 32.0)}                        # 96 s of audio in 32 s
    report = {"workload": {"audio_s_per_request": 6.0}}
    summarize(report, levels, hf, text_tokens=4)
    r = report["ratios"]
    assert r["throughput_c16_vs_hf"]["value"] == pytest.approx(3.0 / (12 / 36), abs=1e-3)
    assert r["throughput_c16_vs_hf"]["met"] is True                    # 9 >= 8
    # TTFA at C=1 over the requests transformers also ran (0 and 1): p50 2.0 s vs 18 s.
    assert r["ttfa_c1_vs_hf_latency"]["value"] == pytest.approx(2.0 / 18.0, abs=1e-4)
    assert r["ttfa_c1_vs_hf_latency"]["met"] is False                  # 0.111 > 0.1
    assert r["ttfa_p50_c8_vs_c1"]["value"] == pytest.approx(4.0 / 3.0, abs=1e-4)
    assert r["ttfa_p50_c8_vs_c1"]["met"] is True
    assert report["correctness"]["text_tokens_equal_hf"] is False       # request 1 differs
    assert report["correctness"]["talker_codes_equal_hf"] is None       # no codes recorded here
    assert report["levels"]["1"]["lengths_ok"] and report["levels"]["1"]["ttfa_p50_s"] == 3.0


def test_bad_flags_are_refused():
    for argv in (["--concurrency", "0,4"], ["--concurrency", "x"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
