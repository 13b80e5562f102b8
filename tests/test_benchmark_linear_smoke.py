"""Keeps benchmarks/linear_kernel.py from rotting: a toy run over two small shapes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` lives at the root

from benchmarks import linear_kernel  # noqa: E402


def test_linear_kernel_benchmark_toy_run(c_compiler, tmp_path):
    out = tmp_path / "r.json"
    report = linear_kernel.main(["--shapes", "64x16,200x48", "--rows", "1,7", "--repeats", "2",
                                 "--bandwidth-gib", "0.01", "--out-json", str(out)])
    assert out.read_text().strip().startswith("{")
    assert [(r["out"], r["in"], r["rows"]) for r in report["shapes"]] == [
        (64, 16, 1), (64, 16, 7), (200, 48, 1), (200, 48, 7)]
    for r in report["shapes"]:
        for name in report["kernels"]:
            assert r[name]["us"] > 0
        assert r["native_vs_matmul"] > 0
    assert len(report["decode_step"]["rounds"]) == 3
