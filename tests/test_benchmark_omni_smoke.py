"""Keeps benchmarks/omni_e2e.py from rotting: the whole script (omnistage levels, the
transformers subprocess, the report) on the tiny Qwen2.5-Omni and the tiny Qwen3-Omni with tiny
workloads, plus the ratio, real-time and frame logic on made-up figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` lives at the root

from benchmarks.omni_e2e import (LevelResult, RequestTiming, StageTimes, finish_args,  # noqa: E402
                                 parse_args, realtime_gap, resolve_family, round_figures)
from benchmarks.omni_peers import HFResult, summarize  # noqa: E402
from benchmarks.qwen3_omni_peer import frames_from_windows  # noqa: E402

LEVEL_KEYS = {"requests", "wall_s", "audio_s", "audio_s_per_wall_s", "ttfa_p50_s", "ttfa_p95_s",
              "ttft_p50_s", "last_audio_p50_s", "last_audio_p95_s", "lengths_ok", "other_cores",
              "stages"}
RATIOS = {"throughput_c16_vs_hf", "ttfa_c1_vs_hf_latency", "ttfa_p50_c8_vs_c1"}
QWEN3_TARGETS = RATIOS | {"ttfa_c1_s", "realtime_worst_gap_s"}


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
                                     "talker_codes_equal_hf": True, "first_differing_code": {"0": None},
                                     "codes_compared": {"0": [30, 30]}}
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


def test_rounds_pool_and_report_each_ratio():
    """--rounds: a level's rounds pool into one result (every request; walls, stage times and
    calls summed; the busiest round's other load), and each round's C=8 / C=1 ratio is kept."""
    first, second = _level(1, [1.0, 3.0], 10.0), _level(1, [2.0, 2.0], 6.0)
    first.stages = StageTimes({"talker": 4.0}, {"talker": 10}, {})
    second.stages, second.other_cores = StageTimes({"talker": 2.0}, {"talker": 5}, {}), 0.3
    pooled = LevelResult.pooled([first, second])
    assert [t.ttfa_s for t in pooled.timings] == [1.0, 3.0, 2.0, 2.0] and pooled.wall_s == 16.0
    assert pooled.throughput == pytest.approx(24.0 / 16.0) and pooled.other_cores == 0.3
    assert pooled.stages.step_s["talker"] == 6.0 and pooled.stages.calls["talker"] == 15
    assert LevelResult.pooled([first]) is first
    rounds = {1: [first, second], 8: [_level(8, [4.0, 6.0], 4.0), _level(8, [5.0, 5.0], 4.0)]}
    figures = round_figures(rounds)
    assert figures["1"]["ttfa_p50_s"] == [2.0, 2.0] and figures["8"]["audio_s_per_wall_s"] == [3.0, 3.0]
    assert figures["ttfa_p50_c8_vs_c1"] == {"per_round": [2.5, 2.5], "median": 2.5}
    assert "ttfa_p50_c8_vs_c1" not in round_figures({1: [first]})
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_bad_flags_are_refused():
    for argv in (["--concurrency", "0,4"], ["--concurrency", "x"], ["--requests", "0"],
                 ["--concurrency", "1,4", "--requests", "2,3,4"], ["--concurrency", "4,4"],
                 ["--family", "qwen4"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    args = parse_args(["--concurrency", "8,1", "--requests", "5,2"])      # one count per level, given order
    assert args.concurrency == [1, 8] and args.requests_per_level == {1: 2, 8: 5}
    assert parse_args(["--concurrency", "1,16"]).requests_per_level == {1: 4, 16: 32}
    with pytest.raises(SystemExit):                                       # the name says the family
        resolve_family(parse_args(["--model", "qwen3_omni", "--family", "qwen2_5_omni"]))
    args = parse_args(["--token2wav-bf16"])
    args.family = "qwen3_omni"
    with pytest.raises(SystemExit):                                       # Qwen2.5-Omni's token2wav only
        finish_args(args)


# ---- Qwen3-Omni -------------------------------------------------------------------------------
QWEN3_FRAMES, SPF, TRIMMED = 12, 1920, 555     # tiny code2wav: 1920 samples a frame, 555 cut a chunk


def test_qwen3_script_on_tiny_model(tmp_path):
    """`--model qwen3_omni --size tiny` (built into a private cache) at C=1 (2 requests, each
    alone: their frames are captured) and C=8 (3 together); transformers runs the first chat."""
    env = {**os.environ, "OMNISTAGE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.omni_e2e", "--model", "qwen3_omni", "--size", "tiny",
         "--concurrency", "1,8", "--requests", "2,3", "--hf-requests", "1", "--text-tokens", "5",
         "--codec-tokens", str(QWEN3_FRAMES), "--threads", "1", "--out-json", str(tmp_path / "r.json"),
         "--timeline", str(tmp_path / "timeline.jsonl")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "r.json").read_text())
    assert not report["errors"], report["errors"]
    assert report["family"] == "qwen3_omni" and report["size"] == "tiny"
    assert report["workload"]["audio_s_per_request"] == pytest.approx(QWEN3_FRAMES * SPF / 24000)
    _check_qwen3_levels(report)
    hf = report["hf"]
    assert hf["requests"] == 1 and hf["audio_s"] == [pytest.approx((QWEN3_FRAMES * SPF - TRIMMED) / 24000)]
    assert all(hf["parts_s"][k] > 0 for k in ("thinker", "talker", "code_predictor", "code2wav"))
    assert hf["talker_settings"]["talker_max_new_tokens"] == QWEN3_FRAMES + 1
    # The first chat on both sides: the same greedy text and all 16 codebooks of every frame.
    assert report["correctness"] == {"requests_compared": 1, "text_tokens_equal_hf": True,
                                     "talker_codes_equal_hf": True, "first_differing_frame": {"0": None},
                                     "frames_compared": {"codebooks": 16, "frames": [QWEN3_FRAMES]}}
    _check_qwen3_targets(report)
    assert "[check] 1 request(s) on both sides: thinker tokens equal transformers': True; talker " \
           "frames (16 codebooks) equal: True" in done.stdout
    assert "[target] realtime_worst_gap_s" in done.stdout and "[target] ttfa_c1_s" in done.stdout
    # --timeline: every stage step of both levels, then each request's first and last audio
    lines = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "stage" in x]
    assert {x["level"] for x in steps} == {1, 8} and {"thinker", "talker", "code2wav"} <= {x["stage"] for x in steps}
    assert all(0 <= x["start"] <= x["end"] for x in steps)
    requests = [x for x in lines if "request" in x]
    assert len(requests) == 5 and all(0 < x["ttfa"] <= x["last_audio"] == x["chunks"][-1][0] for x in requests)


def _check_qwen3_levels(report: dict) -> None:
    assert set(report["levels"]) == {"1", "8"}
    for c, n in (("1", 2), ("8", 3)):
        level = report["levels"][c]
        assert LEVEL_KEYS <= set(level) and level["requests"] == n and level["lengths_ok"]
        # each request: 12 frames, less 555 samples for each of its (1 .. 12) chunks
        assert n * (QWEN3_FRAMES * (SPF - TRIMMED)) / 24000 <= level["audio_s"] < n * QWEN3_FRAMES * SPF / 24000
        assert 0 < level["ttfa_p50_s"] <= level["last_audio_p50_s"]
        stages = level["stages"]
        assert {"thinker", "talker", "code2wav", "encoder", "engine_step_s"} <= set(stages)
        assert stages["thinker"]["calls"] > 0 and stages["code2wav"]["calls"] > 0
        assert stages["talker"]["calls"] >= QWEN3_FRAMES + 1 and stages["encoder"]["calls"] == 0
        gaps = level["per_request"]["realtime_gap_s"]
        assert len(gaps) == n and level["realtime_worst_gap_s"] == pytest.approx(max(gaps), abs=1e-4)


def _check_qwen3_targets(report: dict) -> None:
    """Every target's figure is the one the levels and transformers' line show; verdicts follow."""
    r, lv, hf = report["ratios"], report["levels"], report["hf"]
    assert set(r) == QWEN3_TARGETS and r["throughput_c16_vs_hf"]["value"] is None   # no level 16
    want = {"ttfa_c1_vs_hf_latency": lv["1"]["per_request"]["ttfa_s"][0] / hf["latency_p50_s"],
            "ttfa_p50_c8_vs_c1": lv["8"]["ttfa_p50_s"] / lv["1"]["ttfa_p50_s"],
            "ttfa_c1_s": lv["1"]["ttfa_p50_s"],
            "realtime_worst_gap_s": max(lv[c]["realtime_worst_gap_s"] for c in ("1", "8"))}
    for name, value in want.items():
        assert r[name]["value"] == pytest.approx(value, rel=1e-3, abs=1e-4), name
        assert r[name]["kind"] == "max" and r[name]["met"] is (r[name]["value"] <= r[name]["target"])
    assert (r["ttfa_c1_s"]["target"], r["realtime_worst_gap_s"]["target"]) == (0.4, 0.0)


def test_realtime_gap():
    # chunks (arrival s since submit, audio s): 0.32 s at 1.0, 0.64 s at 1.2, 1.0 s at 2.5
    # before the 2nd: 0.2 s since the first, 0.32 s of audio (ahead); before the 3rd: 1.5 vs 0.96
    assert realtime_gap([(1.0, 0.32), (1.2, 0.64), (2.5, 1.0)]) == pytest.approx(0.54)
    assert realtime_gap([(1.0, 0.32), (1.2, 0.64), (1.9, 1.0)]) == pytest.approx(-0.06)
    assert realtime_gap([(0.5, 2.0)]) == -2.0 and realtime_gap([]) is None


def test_frames_from_windows_drop_the_left_context():
    codes = torch.arange(16 * 30).reshape(16, 30)
    windows, start = [], 0
    for end in (4, 12, 28, 30):                      # chunks of 4, 8, 16 and the last 2 frames
        ctx = min(25, start)
        windows.append(codes[None, :, start - ctx:end])
        start = end
    assert frames_from_windows(windows, 25) == codes.tolist()
    assert frames_from_windows([torch.cat([windows[0]] * 2)], 25) is None   # two requests' rows


def _timing(i: int, ttfa: float, chunks: list[tuple[float, float]]) -> RequestTiming:
    return RequestTiming(i, ttfa, ttfa / 2, chunks[-1][0], chunks[-1][0], sum(a for _, a in chunks),
                         [1] * 4, chunks=chunks, samples=int(24000 * sum(a for _, a in chunks)))


def test_qwen3_targets_on_made_up_figures():
    ahead = [(0.3, 0.32), (0.5, 0.64), (1.0, 1.28)]               # gaps -0.12, -0.26
    late = [(0.9, 0.32), (1.5, 0.64), (3.0, 1.28)]                # gaps 0.28, 1.14
    levels = {1: LevelResult(1, [_timing(0, 0.3, ahead), _timing(1, 0.35, ahead)], 2.0, StageTimes({}, {}, {}), 0),
              8: LevelResult(8, [_timing(2, 0.5, ahead)], 1.0, StageTimes({}, {}, {}), 0),
              16: LevelResult(16, [_timing(3, 0.9, late)], 1.0, StageTimes({}, {}, {}), 0)}
    hf = HFResult(1.0, [5.0, 5.0], [2.2, 2.2], [[1] * 4, [1] * 4], [[[1, 2]], [[1, 2]]])
    report = {"workload": {"audio_s_per_request": 2.24}}
    summarize(report, levels, hf, 4, audio_ok=lambda t: t.samples == 53760, family="qwen3_omni")
    r = report["ratios"]
    assert set(r) == QWEN3_TARGETS
    assert r["ttfa_c1_s"]["value"] == pytest.approx(0.325) and r["ttfa_c1_s"]["met"] is True
    # C=16's late request does not count (the target is for C <= 8); C=1's and C=8's are ahead
    assert r["realtime_worst_gap_s"]["value"] == pytest.approx(-0.12) and r["realtime_worst_gap_s"]["met"]
    assert report["levels"]["16"]["realtime_worst_gap_s"] == pytest.approx(1.14)
    assert r["ttfa_c1_vs_hf_latency"]["value"] == pytest.approx(0.065)       # 0.325 s / 5 s
    assert r["throughput_c16_vs_hf"]["value"] == pytest.approx(2.24 / 0.44, abs=1e-4)   # 2.24 / (4.4 / 10)
    assert r["throughput_c16_vs_hf"]["met"] is False
    assert report["levels"]["1"]["lengths_ok"]
    assert report["correctness"]["talker_codes_equal_hf"] is None   # no frames captured here
