"""A start loads what serving needs, not torch's tracing stack: building a model on the meta
device and materialising it must not import sympy or torch._dynamo (to_empty's empty_like and
nn.Embedding's normal_ on meta tensors ran torch's Python references, which do: ~1.5 s of every
server start, CLI run and stage process). Checked in a fresh interpreter that loads the tiny
Qwen2.5-Omni (thinker, talker, encoders, DiT, BigVGAN) and Qwen3-Omni (MoE, code predictor,
code2wav, vision) through Omni."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from omnistage import Omni
for folder in sys.argv[1:]:
    with Omni(folder, num_threads=1):
        pass
print(sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
"""


def test_loading_the_omni_models_imports_no_tracing_stack(tiny_omni, tmp_path):
    from omnistage.tiny import build_tiny

    qwen3 = str(build_tiny("qwen3_omni", tmp_path / "q3", seed=0))
    done = subprocess.run([sys.executable, "-c", PROBE, tiny_omni, qwen3], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
