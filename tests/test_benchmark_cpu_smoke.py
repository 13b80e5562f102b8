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


def test_isa_proxy_runs_the_script_again_in_its_environment():
    """--isa avx2: the script is run again with our kernels' target, ATen, oneDNN and MKL held
    to AVX2 (torch reads them at import, so only a fresh process can have them)."""
    import os
    import subprocess

    from benchmarks.machine import ISA_ENV

    env = {k: v for k, v in os.environ.items() if k not in ISA_ENV["avx2"]}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "benchmarks.machine", "--isa", "avx2"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert "running again" in out.stderr
    held = out.stdout.strip().splitlines()[-1].split()
    assert sorted(held) == sorted(f"{k}={v}" for k, v in ISA_ENV["avx2"].items())
    native = subprocess.run([sys.executable, "-m", "benchmarks.machine"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    assert "running again" not in native.stderr and "(no variable held)" in native.stdout


def test_isa_proxy_names_what_a_cpu_lacks():
    from benchmarks.machine import isa_missing

    zen3 = ["avx", "avx2", "f16c", "fma"]
    assert isa_missing("avx2", zen3) == set() and isa_missing("avx2-vnni", zen3) == {"avx_vnni"}
    assert isa_missing("avx2", ["avx"]) == {"avx2", "fma"} and isa_missing("native", []) == set()


def test_dit_attention_benchmark_toy_run(tiny_omni, capsys):
    from benchmarks import dit_attention

    report = dit_attention.main(["--model", tiny_omni, "--streams", "2", "--pairs", "1"])
    [[native, sdpa]] = report["runs_s"]
    assert native > 0 and sdpa > 0 and report["median_speedup"] > 0
    assert "speedup" in capsys.readouterr().err


def test_dit_stack_benchmark_toy_run(tiny_omni, capsys):
    """Both kinds of products (int8, float32), one pair each."""
    from benchmarks import dit_stack

    for flags, products in (([], "int8"), (["--float32"], "float32")):
        report = dit_stack.main(["--model", tiny_omni, "--streams", "2", "--pairs", "1", *flags])
        assert report["products"] == products
        [level] = report["levels"]
        [[stack, per_block]] = level["runs_s"]
        assert level["streams"] == 2 and stack > 0 and per_block > 0 and level["median_speedup"] > 0
        assert "speedup" in capsys.readouterr().err


def test_dit_gemm_benchmark_toy_run(tiny_omni, capsys):
    """Needs bf16 dot products for its solve A/B (the recipe's --token2wav-bf16 packing)."""
    from benchmarks import dit_gemm
    from omnistage.layers.onednn import onednn_bf16_available

    if not onednn_bf16_available():
        pytest.skip("no bf16 dot products on this CPU: the solve A/B packs the DiT in bf16")
    report = dit_gemm.main(["--model", tiny_omni, "--rows", "37", "--streams", "2", "--pairs", "1"])
    assert [p["product"] for p in report["products"]] == ["qkv", "out", "ff_up", "ff_down"]
    assert all(p["median_ratio"] > 0 for p in report["products"])
    [[base, int8]] = report["solve"]["runs_s"]
    assert base > 0 and int8 > 0
    rms = report["mel_rel_rms"]
    assert rms["fp32"] == 0 and 0 < rms["int8"] < 0.01 and 0 < rms["int8+bf16"] < 0.01
    assert "solve median speedup" in capsys.readouterr().err
