"""Keeps the CPU benchmarks that need no peer from rotting: the decoder-stack A/B and the
quantization accuracy table run on the tiny Qwen2 (llama.cpp's side of cpu_peers is built only
by hand, never in CI)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` lives at the root

from benchmarks import decoder_stack  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402

pytestmark = pytest.mark.usefixtures("c_compiler")


def test_decoder_stack_benchmark_toy_run(tiny_qwen2, capsys):
    report = decoder_stack.main(["--model", tiny_qwen2, "--formats", "none,int4", "--pairs", "1"])
    for q in ("none", "int4"):
        [[a, b]] = report["results"][q]["runs_tok_s"]
        assert a > 0 and b > 0 and report["results"][q]["median_ratio"] > 0
    assert "stack vs per-op" in capsys.readouterr().out


def test_cpu_description_names_the_cpu():
    cpu = cpu_description()
    assert cpu["model"] and isinstance(cpu["extensions"], list)


def test_dit_attention_benchmark_toy_run(tiny_omni, capsys):
    from benchmarks import dit_attention

    report = dit_attention.main(["--model", tiny_omni, "--streams", "2", "--pairs", "1"])
    [[native, sdpa]] = report["runs_s"]
    assert native > 0 and sdpa > 0 and report["median_speedup"] > 0
    assert "speedup" in capsys.readouterr().err
