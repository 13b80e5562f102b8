"""The native attention kernels (omnistage/kernels/paged_attention.c) against softmax(q k^T) v
over contiguous keys, and their selection by `attention_kernel`."""

from __future__ import annotations

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.errors import InvalidRequestError
from omnistage.kernels.paged_attention import PagedAttentionKernel, unsupported_reason
from omnistage.layers.attention import KVCache
from omnistage.layers.rotary import RotaryEmbedding

needs_cc = pytest.mark.usefixtures("c_compiler")


def _case(hq, hkv, d, bs, lens, seed, spread=1.0, kv_dtype=torch.float32):
    """A cache with each sequence's blocks scattered over the pool, and strided queries."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    cache = KVCache(hkv, num_blocks, bs, d, kv_dtype, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, k = [], 0
    for n in lens:
        tables.append(perm[k:k + -(-n // bs)])
        k += -(-n // bs)
    # Queries as a slice of a wider projection row, like q out of the fused qkv output.
    wide = torch.randn(len(lens), (hq + 3) * d, generator=g) * spread
    q = wide[:, :hq * d].view(len(lens), hq, d)
    return cache, tables, q


def _reference(cache: KVCache, table, ctx, q, scale):
    """Plain float64 attention of q (n, Hq, D), the last row seeing `ctx` keys of `table`
    laid out contiguously, causal before that."""
    hq, hkv = q.shape[1], cache.kv.shape[1]
    kv = cache.kv[:, :, table].flatten(2, 3)[:, :, :ctx].double()     # (2, Hkv, ctx, D)
    k = kv[0].repeat_interleave(hq // hkv, dim=0)                      # (Hq, ctx, D)
    v = kv[1].repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0]).unsqueeze(1) + ctx - q.shape[0]
    scores.masked_fill_(torch.arange(ctx).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v).float()


def _padded(tables) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _decode(kernel, cache, tables, lens, q, scale):
    out = torch.full(q.shape, float("nan"))
    kernel.decode(q, cache.kv, _padded(tables), torch.tensor(lens), out, scale)
    return out


def _decode_reference(cache, tables, lens, q, scale):
    return torch.cat([_reference(cache, t, n, q[i:i + 1], scale) for i, (t, n) in enumerate(zip(tables, lens))])


SHAPES = [(4, 2, 16, 16), (8, 2, 64, 16), (7, 1, 32, 32), (2, 2, 128, 16), (12, 4, 48, 48)]
# (shape, cache dtype): every shape over a float32 cache, two over a bfloat16 one (read
# widened: the reference sees the same stored values).
CASES = [(*s, torch.float32) for s in SHAPES] + [(*s, torch.bfloat16) for s in SHAPES[1:3]]


@needs_cc
@pytest.mark.parametrize("hq,hkv,d,bs,kv_dtype", CASES)
def test_decode_matches_attention(hq, hkv, d, bs, kv_dtype, kernel_march):
    """Both builds (kernel_march: this CPU's, and AVX2's where it can run it)."""
    # Lengths on and around block and 16-key boundaries, a single key, and long contexts.
    lens = [1, 2, 15, 16, 17, bs - 1, bs, bs + 1, 3 * bs + 5, 300, 777]
    cache, tables, q = _case(hq, hkv, d, bs, lens, seed=hq * 100 + d, kv_dtype=kv_dtype)
    kernel = PagedAttentionKernel(hq, hkv, d, bs, kv_dtype)
    scale = d ** -0.5
    got = _decode(kernel, cache, tables, lens, q, scale)
    torch.testing.assert_close(got, _decode_reference(cache, tables, lens, q, scale), atol=3e-6, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("hq,hkv,d,bs,kv_dtype", CASES)
def test_prefill_matches_attention(hq, hkv, d, bs, kv_dtype, kernel_march):
    """Chunks of one step side by side: whole prompts (context = chunk) and later chunks
    over a cached prefix, lengths around tile (16) and block boundaries."""
    chunks = [(2, 2), (16, 16), (17, 17), (33, 33 + bs), (5, 300), (40, 41), (100, 100), (3, 777)]
    cache, tables, _ = _case(hq, hkv, d, bs, [ctx for _, ctx in chunks], seed=hq + d, kv_dtype=kv_dtype)
    starts = [sum(n for n, _ in chunks[:i]) + 3 for i in range(len(chunks))]  # 3 decode rows first
    wide = torch.randn(starts[-1] + chunks[-1][0], (hq + 2) * d, generator=torch.Generator().manual_seed(9))
    q = wide[:, :hq * d].view(-1, hq, d)
    kernel = PagedAttentionKernel(hq, hkv, d, bs, kv_dtype)
    out = torch.full(q.shape, float("nan"))
    kernel.prefill(q, cache.kv, _padded(tables), torch.tensor(starts), torch.tensor([n for n, _ in chunks]),
                   torch.tensor([c for _, c in chunks]), out, d ** -0.5)
    assert out[:3].isnan().all()                # rows of no chunk are left alone
    for (n, ctx), s0, table in zip(chunks, starts, tables):
        torch.testing.assert_close(out[s0:s0 + n], _reference(cache, table, ctx, q[s0:s0 + n], d ** -0.5),
                                   atol=3e-6, rtol=1e-5)


@needs_cc
def test_kernels_with_peaked_scores():
    """Scores 100s apart: most weights underflow to 0 and one key dominates; the running
    maximum of prefill jumps between spans."""
    lens = [5, 40, 129]
    cache, tables, q = _case(8, 2, 64, 16, lens, seed=3, spread=60.0)
    kernel = PagedAttentionKernel(8, 2, 64, 16)
    got = _decode(kernel, cache, tables, lens, q, 0.125)
    torch.testing.assert_close(got, _decode_reference(cache, tables, lens, q, 0.125), atol=2e-5, rtol=1e-4)
    q = torch.randn(129, 8, 64, generator=torch.Generator().manual_seed(4)) * 60
    out = torch.empty_like(q)
    kernel.prefill(q, cache.kv, _padded(tables[2:]), torch.tensor([0]), torch.tensor([129]),
                   torch.tensor([129]), out, 0.125)
    torch.testing.assert_close(out, _reference(cache, tables[2], 129, q, 0.125), atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_unsupported_reasons():
    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    assert unsupported_reason(cpu, f32, f32, 8, 2, 64, 16) is None
    assert unsupported_reason(cpu, f32, bf16, 8, 2, 64, 16) is None
    assert "compute in float32" in unsupported_reason(cpu, bf16, bf16, 8, 2, 64, 16)
    assert "float32 or bfloat16 caches" in unsupported_reason(cpu, f32, torch.float16, 8, 2, 64, 16)
    assert "block_size" in unsupported_reason(cpu, f32, f32, 8, 2, 64, 8)
    assert "head_dim" in unsupported_reason(cpu, f32, f32, 8, 2, 40, 16)
    assert "CPUs" in unsupported_reason(torch.device("meta"), f32, f32, 8, 2, 64, 16)



@needs_cc
def test_native_and_torch_paths_agree(tiny_model, random_prompts):
    """Greedy tokens of concurrent requests equal with either decode attention."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    native = Omni(tiny_model, attention_kernel="native")
    plain = Omni(tiny_model, attention_kernel="torch")
    assert (native.engine.llm.attention_kernel, plain.engine.llm.attention_kernel) == ("native", "torch")
    prompts = random_prompts(9, 7, 5, 37)
    got = [o.token_ids for o in native.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]


def test_attention_kernel_option(tiny_qwen2, tmp_path, monkeypatch):
    with pytest.raises(InvalidRequestError, match="attention_kernel"):
        Omni(tiny_qwen2, attention_kernel="fast")
    with pytest.raises(InvalidRequestError, match="block_size"):
        Omni(tiny_qwen2, attention_kernel="native", block_size=8)
    assert Omni(tiny_qwen2, block_size=8).engine.llm.attention_kernel == "torch"
    # A compiler that fails: auto falls back to PyTorch; native says why it cannot serve.
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert Omni(tiny_qwen2).engine.llm.attention_kernel == "torch"
    with pytest.raises(InvalidRequestError, match="could not compile|does not run"):
        Omni(tiny_qwen2, attention_kernel="native")


@needs_cc
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_prompt_rows_do_not_depend_on_chunking(tiny_qwen2, budget, random_prompts):
    """The native path gives a prompt's hidden rows bit for bit however the token budget
    splits it (one-token chunks included) and whatever else shares the steps."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = random_prompts(3, 7, 5, 37)
    whole = Omni(tiny_qwen2, attention_kernel="native", enable_prefix_caching=False)
    split = Omni(tiny_qwen2, attention_kernel="native", enable_prefix_caching=False,
                 max_num_batched_tokens=budget)
    ref = [o.outputs[0].hidden_states for o in whole.generate(prompts, params, return_hidden_states=True)]
    got = [o.outputs[0].hidden_states for o in split.generate(prompts, params, return_hidden_states=True)]
    for p, r, g in zip(prompts, ref, got):
        n = len(p["prompt_token_ids"])
        assert torch.equal(r[:n], g[:n])


@needs_cc
@pytest.mark.parametrize("mrope,kv_dtype", [(False, torch.float32), (True, torch.float32),
                                            (False, torch.bfloat16)])
def test_rope_write_matches_torch(mrope, kv_dtype):
    """The native RoPE + cache write equals RotaryEmbedding.apply and KVCache.write: rotated
    q and k heads in place, k and v at their slots (a bfloat16 cache: rounded as torch rounds,
    bit for bit), every other slot untouched."""
    hq, hkv, d, bs, t = 8, 2, 64, 16, 37
    g = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(d, 512, 10000.0, "cpu", (8, 12, 12) if mrope else None)
    positions = (torch.randint(0, 512, (3, t), generator=g) if mrope
                 else torch.randint(0, 512, (t,), generator=g))
    cos_sin = rope.lookup(positions, torch.float32)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    slots = torch.randperm(10 * bs, generator=g)[:t]
    ref_cache = KVCache(hkv, 10, bs, d, kv_dtype, torch.device("cpu"))
    ref_cache.kv.copy_(torch.randn(ref_cache.kv.shape, generator=g))
    cache = KVCache(hkv, 10, bs, d, kv_dtype, torch.device("cpu"))
    cache.kv.copy_(ref_cache.kv)
    qk = RotaryEmbedding.apply(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos_sin)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    if kv_dtype == torch.bfloat16:   # ties and NaN: the rounding's edge cases
        v[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), -float("inf")])
    ref_cache.write(qk[:, hq:], v, slots)
    PagedAttentionKernel(hq, hkv, d, bs, kv_dtype).rope_write(qkv, *cos_sin, slots, cache.kv)
    torch.testing.assert_close(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), qk, atol=1e-6, rtol=1e-6)
    if kv_dtype == torch.bfloat16:
        # k is rotated in the same float32 arithmetic by both, except for rounding of the
        # products: a last-bit difference in float32 may move a bfloat16 rounding by 1 ulp.
        got, ref = cache.kv[1], ref_cache.kv[1]
        assert torch.equal(got.isnan(), ref.isnan()) and got.isnan().sum() == 1
        assert torch.equal(got.nan_to_num(0).view(torch.int16), ref.nan_to_num(0).view(torch.int16))
        torch.testing.assert_close(cache.kv[0], ref_cache.kv[0], atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(cache.kv, ref_cache.kv, atol=1e-6, rtol=1e-6)
