"""Our engine against transformers on the same tiny weights: greedy tokens identical for
concurrent prompts, under every scheduling regime, and prefill logits allclose."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from omnistage import Omni, SamplingParams

NUM_NEW = 24
PROMPT_LENS = [1, 3, 7, 16, 17, 40, 64, 100, 129, 250]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    # Shared prefixes, so prefix caching has something to hit within one batch.
    prompts.append(prompts[8][:100] + prompts[2])
    prompts.append(prompts[8][:64] + [5])
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers generate, one prompt at a time, greedy, never stopping early."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    # An EOS id the model cannot produce: generate runs the full length, like ignore_eos.
    never = hf.config.vocab_size
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=never,
                           pad_token_id=never)
    outs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            # An explicit mask: without it generate treats every pad-id token as padding.
            ids = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
            ids = ids[0, len(p):].tolist()
            assert len(ids) == NUM_NEW
            outs.append(ids)
    return hf, prompts, outs


def _run(model_dir: str, prompts, **options):
    llm = Omni(model_dir, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, [o.token_ids for o in outs], outs


# Block sizes of 16 run decodes through the native kernel (where a C compiler builds it),
# others through the PyTorch path; "torch_attention" forces the latter at the default size.
REGIMES = {
    "default": {},
    "torch_attention": {"attention_kernel": "torch"},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 8, "block_size": 4},
    "chunked_prefill_bs16": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 40, "block_size": 8, "max_model_len": 300},
    "preemption_bs16": {"num_kv_blocks": 20, "max_model_len": 300},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_tokens_match_transformers(tiny_model, reference, regime):
    _, prompts, expected = reference
    llm, got, _ = _run(tiny_model, prompts, **REGIMES[regime])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) differs under {regime}"
    engine = llm.engine.llm
    assert engine.num_free_blocks == engine.num_blocks
    if regime.startswith("preemption"):
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_prefix_cache_hits_and_still_matches(tiny_model, reference):
    _, prompts, expected = reference
    llm = Omni(tiny_model, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    # Every prompt of >= 5 tokens now finds its full blocks cached.
    for p, o in zip(prompts, again):
        assert o.num_cached_tokens == (len(p) - 1) // 4 * 4
    assert llm.engine.llm.num_free_blocks == llm.engine.llm.num_blocks


def test_prefill_logits_allclose(tiny_model, reference):
    hf, prompts, _ = reference
    llm = Omni(tiny_model, enable_prefix_caching=False, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, return_hidden_states=True)
    for p, o in zip(prompts, outs):
        hidden = o.outputs[0].hidden_states[:len(p)]   # prompt positions (chunked over steps)
        ours = llm.engine.llm.model.compute_logits(hidden)
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        # 2e-4: the native decoder stack's RMSNorm sums squares in another order than torch's
        # (measured 1.2e-4 at most on logits up to ~20, the per-op path 6.5e-5): float32
        # rounding, amplified by the tiny model's random layers (omnistage/tiny/init.py).
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
