"""1,000 requests aborted at random points leave the KV block pool exactly full again."""

from __future__ import annotations

import random
from collections import Counter

from omnistage.config import EngineConfig
from omnistage.llm.engine import LLMEngine
from omnistage.llm.sequence import SequenceStatus
from omnistage.models.loader import load_text_model
from omnistage.sampling_params import SamplingParams


def _phase(engine: LLMEngine, rid: str) -> str:
    seq = engine.requests[rid].samples[0].seq
    if seq.status is SequenceStatus.WAITING:
        return "preempted" if seq.num_output_tokens else "waiting"
    return "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode"


def test_random_aborts_leave_pool_full(tiny_qwen2):
    # A small pool and budget: prefill chunks, prefix hits, forks and preemptions all occur.
    config = EngineConfig(tiny_qwen2, block_size=4, num_kv_blocks=64, max_model_len=200,
                          max_num_batched_tokens=48, max_num_seqs=24)
    engine = LLMEngine(config, *load_text_model(config))
    rng = random.Random(0)
    shared = [rng.randrange(500) for _ in range(40)]
    abort_at: dict[str, int] = {}     # request id -> step at which to abort it
    phases: Counter = Counter()
    step = submitted = 0
    while sum(phases.values()) < 1000 or engine.has_unfinished_requests():
        while sum(phases.values()) + len(engine.requests) < 1000 and len(engine.requests) < 40:
            prompt = shared[:rng.randrange(0, 40)] + [rng.randrange(500) for _ in range(rng.randrange(1, 60))]
            rid = f"r{submitted}"
            engine.add_request(rid, prompt, SamplingParams(
                n=rng.choice([1, 1, 1, 2, 3]), temperature=1.0, seed=submitted,
                max_tokens=rng.randrange(20, 120), ignore_eos=True))
            abort_at[rid] = step + rng.randrange(0, 30)
            submitted += 1
        for rid in [r for r in engine.requests if abort_at[r] <= step]:
            phases[_phase(engine, rid)] += 1
            assert engine.abort_request(rid)
        engine.step()
        step += 1
        assert step < 20000
    assert sum(phases.values()) >= 1000
    assert min(phases[p] for p in ("waiting", "prefill", "decode", "preempted")) > 0, phases
    assert engine.block_manager.num_prefix_hit_tokens > 0
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert engine.num_free_blocks == engine.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
