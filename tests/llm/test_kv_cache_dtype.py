"""`kv_cache_dtype`: a bfloat16 KV cache under a float32 model, on every attention path (the
native decoder stack, the native kernels per layer, PyTorch), its pool size, batch invariance
and its errors. Its accuracy against the float32 cache is in test_quantization.py."""

from __future__ import annotations

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.errors import InvalidRequestError

needs_cc = pytest.mark.usefixtures("c_compiler")
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _prompts(n: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 500, (int(k),), generator=g).tolist()}
            for k in torch.randint(1, 90, (n,), generator=g)]


def _run(omni: Omni, prompts: list[dict]):
    outs = omni.generate(prompts, PARAMS)
    return [o.token_ids for o in outs], torch.tensor([[t.logprob for t in o.outputs[0].logprobs]
                                                      for o in outs])


@needs_cc
def test_bfloat16_cache_on_every_attention_path(tiny_qwen2):
    """The C stack, the per-layer kernels and PyTorch over a bfloat16 cache: the same greedy
    tokens, logprobs close. Chunked prefill (48-token budget) mixes prefill chunks over cached
    bfloat16 keys with decodes. Close, not within float32 rounding as over a float32 cache
    (2e-4, test_decoder_stack.py): a last-bit difference of a key before it is stored can move
    the stored value by a bfloat16 step (2^-8), which the random tiny model amplifies (2e-3
    measured); against the float32 cache its logprobs move by up to ~1.8."""
    options = dict(kv_cache_dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=48)
    stack = Omni(tiny_qwen2, **options)
    per_layer = Omni(tiny_qwen2, **options)
    per_layer.engine.llm.model.native_stack = None
    plain = Omni(tiny_qwen2, attention_kernel="torch", **options)
    assert stack.engine.llm.model.native_stack is not None
    for omni in (stack, plain):
        assert {c.kv.dtype for c in omni.engine.llm.runner.caches} == {torch.bfloat16}
    prompts = _prompts(9)
    tokens, logprobs = _run(stack, prompts)
    for other in (per_layer, plain):
        other_tokens, other_logprobs = _run(other, prompts)
        assert other_tokens == tokens
        torch.testing.assert_close(other_logprobs, logprobs, atol=1e-2, rtol=0)
    # The cache is what it says: against the float32 cache the logprobs move (a little).
    _, f32_logprobs = _run(Omni(tiny_qwen2, enable_prefix_caching=False, max_num_batched_tokens=48),
                           prompts)
    assert (f32_logprobs - logprobs).abs().max() > 0


def test_bfloat16_cache_holds_twice_the_tokens(tiny_qwen2):
    # Room for 64 float32 blocks of 8 KiB (the pool is capped by it, not by the seats).
    options = dict(kv_cache_memory_gb=64 * 8192 / 2**30, max_model_len=128, attention_kernel="torch")
    f32 = Omni(tiny_qwen2, **options).engine.llm
    bf16 = Omni(tiny_qwen2, kv_cache_dtype="bfloat16", **options).engine.llm
    assert bf16.kv_cache.block_bytes * 2 == f32.kv_cache.block_bytes
    assert (f32.kv_cache.num_blocks, bf16.kv_cache.num_blocks) == (64, 128)
    assert bf16.runner.kv_cache_bytes == f32.runner.kv_cache_bytes


@needs_cc
def test_request_alone_equals_request_in_batch(tiny_qwen2):
    omni = Omni(tiny_qwen2, kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    prompts = _prompts(17, seed=8)
    [alone] = omni.generate(prompts[4:5], PARAMS)
    batch = omni.generate(prompts, PARAMS)
    assert [(t.token_id, t.logprob, t.top) for t in alone.outputs[0].logprobs] == \
        [(t.token_id, t.logprob, t.top) for t in batch[4].outputs[0].logprobs]


def test_kv_cache_dtype_errors(tiny_qwen2):
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        Omni(tiny_qwen2, kv_cache_dtype="int8")
    # float16: PyTorch serves it; the native kernels read float32 or bfloat16 only.
    with pytest.raises(InvalidRequestError, match="float32 or bfloat16 caches"):
        Omni(tiny_qwen2, kv_cache_dtype="float16", attention_kernel="native")
    llm = Omni(tiny_qwen2, kv_cache_dtype="float16").engine.llm
    assert llm.attention_kernel == "torch" and llm.runner.caches[0].kv.dtype == torch.float16
